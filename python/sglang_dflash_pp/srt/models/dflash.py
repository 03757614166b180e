"""The patch to ``sglang/srt/models/dflash.py`` (0.5.23): the last PP stage's context projection.

Hook: AROUND ``DFlashDraftModel.project_target_hidden``.

Why: under PP the last stage's ``logits_output.hidden_states`` holds only the features it captured
itself (``[N, k_last*H]``), and the earlier stages' contribution arrives as the accumulated partial
``P_in``. The stock method expects ``[N, K*H]`` and normalises ``fc`` of it. While a
:class:`LastStageContext` is stashed on the draft instance (by the PP worker, around its stock
forward, cleared in ``finally``) the hook returns ``hidden_norm(P_in + x W_last^T)`` instead, with
the sum and the norm in fp32 (``last_stage_context``). Everything downstream of the projection (padding trim, fused or
sequential per-layer K/V write, LiLiCorr anchor) stays stock. With nothing stashed the hook calls
the original with the same arguments, so every other deployment is untouched; a KV-write-only
draft (``kv_write_only``, whose ``fc`` is the last stage's block only) refuses that instead of
projecting the wrong width.
"""

from __future__ import annotations

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.models.kv_write_only import require_full_fc
from sglang_dflash_pp.srt.models.last_stage_context import (  # noqa: F401 (the worker's names)
    LastStageContext,
    project_last_stage,
    stashed,
    stashed_context,
)


def project_target_hidden_around(original, self, target_hidden, *args, **kwargs):
    context = stashed(self)
    if context is None:
        require_full_fc(self)  # a KV-write-only draft projects only through the stash
        return original(self, target_hidden, *args, **kwargs)
    return project_last_stage(self, context, target_hidden)


HOOKS = (
    PluginHook(
        "sglang.srt.models.dflash.DFlashDraftModel.project_target_hidden",
        project_target_hidden_around,
        "around",
        "last PP stage: normalise the carried partial plus its own features' projection",
    ),
)
