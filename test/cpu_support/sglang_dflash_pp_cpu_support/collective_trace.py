"""Test-only: record every torch.distributed collective a server process enters.

Enabled by ``SGLANG_DFLASH_PP_TEST_COLLECTIVE_LOG=<dir>``. Each process appends one JSON line per
collective to ``<dir>/rank<global rank>-<pid>.jsonl``: the op and the global ranks of its group.
The startup-deadlock test compares, group by group, the sequences that the members of a group
entered: a collective that one PP stage enters and another does not (the deadlock class the
last-stage draft build had) shows up as a difference even where it happens not to hang.

Point-to-point ops (send/recv) are not collectives and are not recorded. Nothing here changes
what the call does.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading

ENV = "SGLANG_DFLASH_PP_TEST_COLLECTIVE_LOG"
OPS = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "barrier", "all_gather_object", "broadcast_object_list",
    "gather", "scatter", "reduce", "all_to_all", "all_to_all_single", "gather_object",
)  # fmt: skip
_lock = threading.Lock()


def _group_ranks(dist, group):
    try:
        if group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(group))
    except Exception:
        return None


def _wrap(dist, name, directory):
    original = getattr(dist, name)

    @functools.wraps(original)
    def traced(*args, **kwargs):
        group = kwargs.get("group")
        if group is None:
            # positional group: all_reduce(t, op, group), broadcast(t, src, group), barrier(group)
            for a in args:
                if a.__class__.__name__ in ("ProcessGroup", "_ProcessGroupWrapper"):
                    group = a
                    break
        if dist.is_initialized():
            record = {"op": name, "group": _group_ranks(dist, group)}
            path = os.path.join(directory, f"rank{dist.get_rank()}-{os.getpid()}.jsonl")
            with _lock, open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return original(*args, **kwargs)

    traced.__sglang_dflash_pp_traced__ = True
    setattr(dist, name, traced)
    # Modules that bound the function by name before this process loaded plugins
    # (managers/scheduler.py: ``from torch.distributed import barrier``).
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("sglang.") and getattr(module, name, None) is original:
            setattr(module, name, traced)


def install() -> None:
    directory = os.environ.get(ENV)
    if not directory:
        return
    import torch.distributed as dist

    os.makedirs(directory, exist_ok=True)
    for name in OPS:
        if hasattr(dist, name) and not getattr(getattr(dist, name), "__sglang_dflash_pp_traced__", False):
            _wrap(dist, name, directory)
