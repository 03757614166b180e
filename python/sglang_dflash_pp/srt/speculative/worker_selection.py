"""Worker selection for DFLASH on a PP prefill server (the patch to ``speculative/spec_info.py``
and ``speculative/draft_worker_common.py`` of sglang 0.5.23).

Hooks:

* AROUND ``SpeculativeAlgorithm.create_worker``: DFLASH with ``pp_size > 1`` on a PD prefill server
  gets ``PPDFlashWorkerV2`` (``dflash_pp_worker``); every other configuration, DFLASH PP1 included,
  gets exactly the class stock returns.
* AROUND ``draft_worker_common.build_draft_tp_worker``: while ``PPDFlashWorkerV2`` builds its draft
  on the last stage, pass the target's already-synchronised random seed and the stage-local load
  group (``last_stage_draft_build`` says why: without them the last stage waits in a WORLD
  collective the other stages never enter, and the server deadlocks at startup). Outside that
  window the hook passes the call through untouched.
"""

from __future__ import annotations

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.speculative.last_stage_draft_build import current_draft_build


def _is_pp_prefill(server_args) -> bool:
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    return int(cfg.pp_size) > 1 and cfg.disaggregation_mode == "prefill"


def create_worker_around(original, self, server_args, *args, **kwargs):
    worker_cls = original(self, server_args, *args, **kwargs)
    if not (self.is_dflash() and _is_pp_prefill(server_args)):
        return worker_cls
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    if worker_cls is not DFlashWorkerV2:
        return worker_cls  # an out-of-tree platform's own worker
    from sglang_dflash_pp.hooks import require_hooks_applied
    from sglang_dflash_pp.srt.arg_groups.dflash_pp_gate import CONFIGURATION
    from sglang_dflash_pp.srt.speculative.dflash_pp_worker import PPDFlashWorkerV2

    require_hooks_applied(CONFIGURATION)
    return PPDFlashWorkerV2


def build_draft_tp_worker_around(original, *args, **kwargs):
    build = current_draft_build()
    if build is not None:
        if build.load_group is not None:
            kwargs.setdefault("load_group", build.load_group)
        if kwargs.get("random_seed") is None:
            kwargs["random_seed"] = build.random_seed
    return original(*args, **kwargs)


HOOKS = (
    PluginHook(
        "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker",
        create_worker_around,
        "around",
        "DFLASH on a PP prefill server: draft on the last stage, context partials before it",
    ),
    PluginHook(
        "sglang.srt.speculative.draft_worker_common.build_draft_tp_worker",
        build_draft_tp_worker_around,
        "around",
        "last PP stage: build the DFLASH draft with the synchronised seed and stage load group",
    ),
)
