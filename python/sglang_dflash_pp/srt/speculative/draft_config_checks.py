"""Checks on what a DFlash draft's config.json declares: the context features the PP path
depends on, and the per-layer attention types stock checks only when it builds the draft.

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


DRAFT_LAYER_TYPES = ("full_attention", "sliding_attention")


def draft_layer_types_refusal(
    layer_types: Optional[Sequence[str]],
    sliding_window: Optional[int],
    num_layers: int,
    *,
    where: str,
) -> Optional[str]:
    """What ``DFlashAttention`` checks per layer while the draft is built, on every server
    (``_get_dflash_layer_attention_params``, sglang/srt/models/dflash.py:166-190, and
    ``get_dflash_attention_sliding_window_size``, speculative/dflash_utils.py:400-417): one
    ``layer_types`` entry per draft layer, each full or sliding attention, and a
    ``sliding_window`` when any layer slides. None when they hold (or no ``layer_types``)."""
    if layer_types is None:
        return None
    types = list(layer_types)
    if len(types) < num_layers:
        return (
            f"The draft at {where} lists {len(types)} layer_types for {num_layers} layers; "
            "stock DFlashAttention needs one entry per draft layer. Fix layer_types in the "
            "draft's config.json."
        )
    unknown = sorted({t for t in types[:num_layers] if t not in DRAFT_LAYER_TYPES})
    if unknown:
        return (
            f"The draft at {where} has layer_types {unknown}; stock DFlashAttention accepts "
            f"only {list(DRAFT_LAYER_TYPES)}. Fix layer_types in the draft's config.json."
        )
    if "sliding_attention" in types and sliding_window is None:
        return (
            f"The draft at {where} has sliding_attention layers but no sliding_window; stock "
            "DFLASH refuses it when it builds the draft. Set sliding_window in the draft's "
            "config.json."
        )
    return None
