"""Worker selection for DFLASH on a PP prefill server (the patch to ``speculative/spec_info.py``
and ``speculative/draft_worker_common.py`` of sglang 0.5.23).

Hooks:

* AROUND ``SpeculativeAlgorithm.create_worker``: DFLASH with ``pp_size > 1`` on a PD prefill server
  gets ``PPDFlashWorkerV2`` (``dflash_pp_worker``); every other configuration, DFLASH PP1 included,
  gets exactly the class stock returns.
* AROUND ``draft_worker_common.build_draft_tp_worker``: while ``PPDFlashWorkerV2`` builds its draft
  on the last stage, pass the stage-local load group. Stock DFLASH builds with the default (world)
  group, and an InstantTensor load on the last stage alone would wait forever for the other
  stages. The group is captured before ``draft_pp_context`` (inside it ``pp_size`` reads 1), as
  DSpark does. Outside that window the hook passes the call through untouched.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Any, Iterator

from sglang_dflash_pp.hooks import PluginHook

_stage_load_group: contextvars.ContextVar = contextvars.ContextVar(
    "sglang_dflash_pp_stage_load_group", default=None
)


@contextmanager
def stage_load_group(group: Any) -> Iterator[None]:
    token = _stage_load_group.set(group)
    try:
        yield
    finally:
        _stage_load_group.reset(token)


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
    from sglang_dflash_pp.srt.speculative.dflash_pp_worker import PPDFlashWorkerV2

    return PPDFlashWorkerV2


def build_draft_tp_worker_around(original, *args, **kwargs):
    group = _stage_load_group.get()
    if group is not None and "load_group" not in kwargs:
        kwargs["load_group"] = group
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
        "last PP stage: load the DFLASH draft with the stage-local load group",
    ),
)
