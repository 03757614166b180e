"""The patch to ``sglang/srt/models/dflash.py`` (0.5.23): the last PP stage's context projection.

Hook: AROUND ``DFlashDraftModel.project_target_hidden``.

Why: under PP the last stage's ``logits_output.hidden_states`` holds only the features it captured
itself (``[N, k_last*H]``), and the earlier stages' contribution arrives as the accumulated partial
``P_in``. The stock method expects ``[N, K*H]`` and normalises ``fc`` of it. While a
:class:`LastStageContext` is stashed on the draft instance (by the PP worker, around its stock
forward, cleared in ``finally``) the hook returns ``hidden_norm(P_in + x W_last^T)`` instead, with
the sum and the norm in fp32. Everything downstream of the projection (padding trim, fused or
sequential per-layer K/V write, LiLiCorr anchor) stays stock. With nothing stashed the hook calls
the original with the same arguments, so every other deployment is untouched; a KV-write-only
draft (``kv_write_draft``, whose ``fc`` is the last stage's block only) refuses that instead of
projecting the wrong width.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.models.context_partial import finish_context
from sglang_dflash_pp.srt.models.kv_write_draft import kv_write_only

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


def project_target_hidden_around(original, self, target_hidden, *args, **kwargs):
    context = self.__dict__.get(_STASH_ATTR)
    if context is None:
        if kv_write_only(self) is not None:
            raise RuntimeError(
                "The last PP stage's KV-write-only DFlash draft holds only its own fc column "
                "block; it projects through the PP context stash, never on its own."
            )
        return original(self, target_hidden, *args, **kwargs)
    # The fp32 sum goes through the norm's reference implementation: the fused CUDA RMSNorm
    # kernels take the weight's dtype only.
    return finish_context(
        context.partial_in,
        target_hidden,
        context.w_last,
        self.hidden_norm.forward_native,
        target_hidden.dtype,
    )


HOOKS = (
    PluginHook(
        "sglang.srt.models.dflash.DFlashDraftModel.project_target_hidden",
        project_target_hidden_around,
        "around",
        "last PP stage: normalise the carried partial plus its own features' projection",
    ),
)
