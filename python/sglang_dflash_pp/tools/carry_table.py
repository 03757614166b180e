"""Carry bytes per token on each PP hop: the DFlash context partial vs the concat carry.

The partial is what our stages send (``pp_stage_carry``): one ``[T, H]`` tensor in the carry
dtype on every hop after the first stage that owns a feature. The concat carry is what stock
DSpark relays (``dspark_hidden_states``): the raw captures accumulated so far, ``k * H`` in the
model dtype, growing stage by stage. Used by ``sglang-dflash-pp check`` and by
``benchmark/pp_carry/carry_bytes.py``, so both print the same numbers.

Pure: takes the partition as data (the caller gets it from sglang's ``get_pp_indices``).
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

from sglang_dflash_pp.srt.models.capture_ownership import (
    FeatureOwnership,
    compute_feature_ownership,
)
from sglang_dflash_pp.srt.models.context_partial import CARRY_DTYPES

# Short names used in the table's keys ("partial_fp32_bytes_per_token", ...).
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16"}


def partial_key(carry_dtype_name: str) -> str:
    return f"partial_{SHORT_NAMES[carry_dtype_name]}_bytes_per_token"


def carry_dtype_bytes() -> Dict[str, int]:
    """Bytes per element of every carry dtype ``SGLANG_DFLASH_PP_CARRY_DTYPE`` accepts."""
    return {name: dtype.itemsize for name, dtype in CARRY_DTYPES.items()}


def carry_table_for_ownership(
    ownership: FeatureOwnership, hidden: int, model_dtype_bytes: int = 2
) -> dict:
    """Per-stage rows, totals over all hops and the worst hop, for every carry dtype."""
    widths = carry_dtype_bytes()
    rows, cumulative = [], 0
    for s in ownership.stages:
        cumulative += len(s.features)
        is_hop = s.stage < ownership.pp_size - 1
        sends = ownership.sends_partial(s.stage)
        row = dict(
            stage=s.stage,
            layers=[s.start_layer, s.end_layer],
            features=list(s.features),
            captured_layers=list(s.layer_ids),
            hop=f"{s.stage}->{s.stage + 1}" if is_hop else None,
        )
        for name, nbytes in widths.items():
            row[partial_key(name)] = nbytes * hidden if sends else 0
        row["concat_bytes_per_token"] = model_dtype_bytes * hidden * cumulative if is_hop else 0
        rows.append(row)
    keys = [partial_key(name) for name in widths] + ["concat_bytes_per_token"]
    totals = {key: sum(r[key] for r in rows) for key in keys}
    worst = {key: max(r[key] for r in rows) for key in keys}
    table = dict(
        num_layers=ownership.num_layers,
        pp_size=ownership.pp_size,
        target_layer_ids=list(ownership.target_layer_ids),
        hidden=hidden,
        stages=rows,
        total_over_hops=totals,
        worst_hop=worst,
    )
    for name in widths:
        short, key = SHORT_NAMES[name], partial_key(name)
        table[f"concat_over_partial_{short}_total"] = _ratio(
            totals["concat_bytes_per_token"], totals[key]
        )
    table["concat_over_partial_fp32_worst_hop"] = _ratio(
        worst["concat_bytes_per_token"], worst[partial_key("float32")]
    )
    return table


def carry_table(
    stage_layers: Sequence[Tuple[int, int]],
    target_layer_ids: Sequence[int],
    num_layers: int,
    hidden: int,
    model_dtype_bytes: int = 2,
) -> dict:
    """:func:`carry_table_for_ownership` for a partition; raises ``OwnershipError`` if the
    partition cannot serve the draft."""
    ownership = compute_feature_ownership(stage_layers, target_layer_ids, num_layers)
    return carry_table_for_ownership(ownership, hidden, model_dtype_bytes)


def _ratio(a: int, b: int):
    return a / b if b else None
