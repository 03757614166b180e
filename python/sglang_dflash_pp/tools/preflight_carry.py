"""The carry between ``preflight``'s stage processes (``preflight_stage`` and, for the last
stage, ``preflight_last``): one gloo process group of all stages, and the inbound partial."""

from __future__ import annotations

import datetime

from sglang_dflash_pp.tools.preflight_spec import CARRY_STORE, PreflightSpec

CARRY_TAG = 0


def carry_group(spec: PreflightSpec, stage: int):
    """A gloo process group of all PP stages, for the carry only (it leaves the default
    ``torch.distributed`` group to sglang on the last stage)."""
    import torch.distributed as dist

    store = dist.PrefixStore("carry/", dist.FileStore(spec.path(CARRY_STORE), spec.pp))
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=spec.timeout_s)
    return dist.ProcessGroupGloo(store, stage, spec.pp, opts)


def recv_partial(spec: PreflightSpec, group, stage: int):
    import torch

    buf = torch.empty(spec.tokens, spec.hidden, dtype=spec.torch_dtype(spec.carry_dtype))
    group.recv([buf], stage - 1, CARRY_TAG).wait()
    return buf
