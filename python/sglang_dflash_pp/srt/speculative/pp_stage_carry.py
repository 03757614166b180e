"""What one PP stage of the prefill server puts on the wire for the DFlash context.

Kimi-K3 in 0.5.23 relays a non-last stage's captures as the proxy key ``dspark_hidden_states``
(the cumulative raw concat, up to K x H per token). A DFLASH PP stage pops that key before the
proxy leaves and puts the running partial projection under ``dflash_ctx_partial`` instead (one
``[T, H]`` tensor in the carry dtype), so the next stage never receives raw captures and its own
concat holds only its local features.

The key is present on a hop iff some stage up to the sender owns a feature: a static rule, so every
TP rank of a stage emits the same keys, dtypes and shapes for every batch, idle and empty ones
included (the receiver all-gathers each tensor across the attention-TP ranks). Nothing is cached
across micro-batches: the carry rides in the proxy dict of its own micro-batch and chunk.

Pure: torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import MutableMapping, Optional, Tuple

import torch

from sglang_dflash_pp.srt.models.capture_ownership import FeatureOwnership
from sglang_dflash_pp.srt.models.context_partial import accumulate_partial
from sglang_dflash_pp.srt.models.stage_capture import CAPTURE_KEY

PARTIAL_KEY = "dflash_ctx_partial"


class CarryProtocolError(RuntimeError):
    """A stage received or produced a proxy that breaks the static key/shape rule."""


@dataclass(frozen=True)
class StageCarry:
    """One stage's role in the carry, fixed at startup from the ownership rule."""

    stage: int
    pp_size: int
    features: Tuple[int, ...]
    hidden_size: int
    receives: bool
    sends: bool

    @classmethod
    def of(cls, ownership: FeatureOwnership, stage: int, hidden_size: int) -> "StageCarry":
        return cls(
            stage=stage,
            pp_size=ownership.pp_size,
            features=ownership.stages[stage].features,
            hidden_size=int(hidden_size),
            receives=ownership.receives_partial(stage),
            sends=ownership.sends_partial(stage),
        )

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp_size - 1


def inbound_partial(
    carry: StageCarry, inbound: Optional[MutableMapping[str, torch.Tensor]]
) -> Optional[torch.Tensor]:
    """The partial the previous stage sent, or None when no earlier stage owns a feature."""
    if not carry.receives:
        return None
    partial = None if inbound is None else inbound.get(PARTIAL_KEY)
    if partial is None:
        raise CarryProtocolError(
            f"PP stage {carry.stage} expected '{PARTIAL_KEY}' from stage {carry.stage - 1} but "
            "it is missing; every stage must run sglang-dflash-pp with the same draft and "
            "SGLANG_PP_LAYER_PARTITION."
        )
    return partial


def replace_capture_with_partial(
    carry: StageCarry,
    outbound: MutableMapping[str, torch.Tensor],
    inbound: Optional[MutableMapping[str, torch.Tensor]],
    w_stage: Optional[torch.Tensor],
    carry_dtype: torch.dtype,
) -> None:
    """Non-last stage: turn the outbound proxy's raw captures into the running partial."""
    local = outbound.pop(CAPTURE_KEY, None)
    if carry.features:
        width = len(carry.features) * carry.hidden_size
        if local is None or local.ndim != 2 or local.shape[1] != width:
            got = None if local is None else tuple(local.shape)
            raise CarryProtocolError(
                f"PP stage {carry.stage} owns features {list(carry.features)} and expected "
                f"'{CAPTURE_KEY}' of width {width} from the target, got {got}. The target must "
                "capture the draft's target_layer_ids on every stage (Kimi-K3)."
            )
    elif local is not None:
        raise CarryProtocolError(
            f"PP stage {carry.stage} owns no feature but the target emitted '{CAPTURE_KEY}' "
            f"{tuple(local.shape)}; stages disagree on the capture layout."
        )
    partial = accumulate_partial(
        inbound_partial(carry, inbound),
        local if carry.features else None,
        w_stage,
        carry_dtype,
    )
    if carry.sends:
        outbound[PARTIAL_KEY] = partial.contiguous()
