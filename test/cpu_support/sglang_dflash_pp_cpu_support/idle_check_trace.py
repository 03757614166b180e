"""Test-only: a per-rank record of the last stock idle leak check that passed.

Enabled by ``SGLANG_DFLASH_PP_TEST_IDLE_CHECK_DIR=<dir>``. AFTER
``managers/scheduler_components/invariant_checker.SchedulerInvariantChecker._check_req_pool``:
stock ``Scheduler.on_idle`` calls it on every rank (every PP stage, every TP rank) once the
scheduler is fully idle, right after its KV pool conservation check
(``available + evictable + protected + session_held == total``), which raises when
``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`` is on; ``_check_req_pool`` itself raises on a
leaked request row. So reaching the end of it means this rank passed the stock strict idle check.
The hook then overwrites ``<dir>/pp<pp rank>-tp<tp rank>.json`` with the time, a running count
and the pool numbers the check saw (``num_used`` = KV slots held by requests, the radix cache's
evictable slots not counted).

The record also holds the size of each per-room table of the process's KV managers (AFTER
``disaggregation/common/conn.CommonKVManager.__init__`` keeps a reference to each): the series'
KV checksum tables and upstream's room tables, which must all be empty when nothing is in flight.

Why: sglang's ``/v1/loads`` reports one scheduler per DP rank (PP rank 0, attention TP rank 0;
``Scheduler.init_ipc_channels``), so it cannot see a PP prefill's last stage or a decode's TP rank
1. These files show, per rank, that the stock check ran (and passed) after a given moment.
Writes are at most one per 50 ms per process; nothing the server reads or decides is changed.
"""

from __future__ import annotations

import json
import os
import time

ENV = "SGLANG_DFLASH_PP_TEST_IDLE_CHECK_DIR"
TARGET = (
    "sglang.srt.managers.scheduler_components.invariant_checker."
    "SchedulerInvariantChecker._check_req_pool"
)
MIN_INTERVAL_S = 0.05
_state = {"count": 0, "written_at": 0.0}
_managers = []
# The per-room tables of a KV manager (those it has in its role).
ROOM_TABLES = (
    "kv_checksum_sums", "kv_checksum_reports", "request_status", "transfer_infos",
    "req_to_decode_prefix_len", "prefill_response_tracker",
    "required_prefill_response_num_table", "failure_records",
)


def keep_manager(result, manager, *args, **kwargs):
    _managers.append(manager)
    return None


def room_tables() -> dict:
    """Entries left in each per-room table of this process's KV managers."""
    out = {}
    for manager in _managers:
        for name in ROOM_TABLES:
            table = getattr(manager, name, None)
            if hasattr(table, "__len__"):
                out[name] = out.get(name, 0) + len(table)
    return out


def record_passed_idle_check(result, checker, *args, **kwargs):
    directory = os.environ.get(ENV)
    if not directory:
        return None
    _state["count"] += 1
    now = time.time()
    if now - _state["written_at"] < MIN_INTERVAL_S:
        return None
    _state["written_at"] = now
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    stats = checker.pool_stats_observer.get_pool_stats()
    req_pool = checker.req_to_token_pool
    record = {
        "time": now,
        "pid": os.getpid(),
        "checks": _state["count"],
        "pp_rank": parallel.pp_rank,
        "tp_rank": parallel.tp_rank,
        "num_used": int(stats.full_num_used),
        "available": int(stats.full_available_size),
        "evictable": int(stats.full_evictable_size),
        "capacity": int(stats.full_capacity),
        "free_req_slots": len(req_pool.free_slots),
        "req_slots": int(req_pool.size + req_pool.pre_alloc_size),
        "room_tables": room_tables(),
    }
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"pp{parallel.pp_rank}-tp{parallel.tp_rank}.json")
    with open(path + f".{os.getpid()}.tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + f".{os.getpid()}.tmp", path)
    return None


HOOKS = (
    (TARGET, record_passed_idle_check, "after"),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.__init__", keep_manager, "after"),
)
