"""The last PP stage's DFlash context projection: the earlier stages' carried partial plus the
projection of this stage's own features, normalised.

Under PP the last stage's ``logits_output.hidden_states`` holds only the features it captured
itself (``[N, k_last*H]``), and the earlier stages' contribution arrives as the accumulated partial
``P_in``. While a :class:`LastStageContext` is stashed on the draft model (by the PP worker, around
its forward, cleared in ``finally``), ``DFlashDraftModel.project_target_hidden`` returns
``hidden_norm(P_in + x W_last^T)`` (:func:`project_last_stage`), the sum and the norm in fp32,
instead of normalising ``fc`` of the full ``[N, K*H]`` concatenation. Everything downstream of
the projection is unchanged; with nothing stashed the method is unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from sglang_dflash_pp.srt.models.context_partial import finish_context

_STASH_ATTR = "_dflash_pp_last_stage_context"


@dataclass
class LastStageContext:
    w_last: torch.Tensor  # [H, k_last*H] view of fc.weight: the last stage's own features
    partial_in: Optional[torch.Tensor]  # [>=N, H] sum of the earlier stages, or None


@contextmanager
def stashed_context(draft_model, context: LastStageContext) -> Iterator[None]:
    """Make ``project_target_hidden`` of ``draft_model`` finish the PP partial while inside."""
    draft_model.__dict__[_STASH_ATTR] = context
    try:
        yield
    finally:
        draft_model.__dict__.pop(_STASH_ATTR, None)


def stashed(draft_model) -> Optional[LastStageContext]:
    return draft_model.__dict__.get(_STASH_ATTR)


def project_last_stage(
    draft_model, context: LastStageContext, target_hidden: torch.Tensor
) -> torch.Tensor:
    """``hidden_norm(P_in + target_hidden @ W_last^T)`` in fp32, in ``target_hidden``'s dtype."""
    # The fp32 sum goes through the norm's reference implementation: the fused CUDA RMSNorm
    # kernels take the weight's dtype only.
    return finish_context(
        context.partial_in,
        target_hidden,
        context.w_last,
        draft_model.hidden_norm.forward_native,
        target_hidden.dtype,
    )
