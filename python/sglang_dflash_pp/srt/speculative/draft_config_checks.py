"""Checks on a DFlash draft's declared context features that the PP path depends on.

Pure: no sglang import, so the CLI and the tests can call it on a bare config.
"""

from __future__ import annotations

from typing import Optional, Sequence


def target_layer_ids_refusal(
    target_layer_ids: Optional[Sequence[int]], *, where: str
) -> Optional[str]:
    """The fc input order is the ``target_layer_ids`` order, while a PP target appends its
    captures in ascending layer order, stage after stage. The two agree only for strictly
    increasing ids; anything else would multiply each feature by another feature's columns."""
    if target_layer_ids is None:
        return None  # sglang derives evenly spaced, increasing ids
    ids = [int(i) for i in target_layer_ids]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        return (
            f"The draft at {where} lists target_layer_ids {ids} with duplicates {duplicates}; "
            "DFLASH with --pp-size > 1 needs each captured layer once. Fix dflash_config."
            "target_layer_ids in the draft's config.json."
        )
    if ids != sorted(ids):
        return (
            f"The draft at {where} lists target_layer_ids {ids} out of order; DFLASH with "
            "--pp-size > 1 needs them in ascending order (the order the pipeline stages "
            f"capture them), e.g. {sorted(ids)} with fc's column blocks permuted to match."
        )
    return None
