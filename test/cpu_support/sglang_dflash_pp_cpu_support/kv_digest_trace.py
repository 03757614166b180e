"""Test-only: record every composed KV digest verification, and corrupt one byte on request.

Enabled by ``SGLANG_DFLASH_PP_TEST_KV_DIGEST_DIR=<dir>`` (registered by the test-support plugin
only when that variable is set), on a decode server. Two hooks on the product's
``sglang_dflash_pp.srt.disaggregation.kv_digest_verify`` (module functions it calls through its
module globals, on the decode's scheduler thread), or on the module that
``SGLANG_DFLASH_PP_TEST_KV_DIGEST_MODULE`` names: the same module in-tree
(``sglang.srt.disaggregation.kv_digest_verify`` on the tree ``export-patches`` generates, where
the plugin is not loaded and this instrument imports nothing of it):

* AROUND ``verify_request(scheduler, inbox, req)``: when the request's rid contains
  ``corrupt-draft``, ``corrupt-target`` or ``corrupt-state``, flip bit 0 of one byte the transfer
  wrote for it, on attention TP rank 0 only, after the transfer and before the verification:
  byte 5 of the request's first page of the first draft KV entry / of the first target KV entry,
  or byte 5 of its slot of the first state component. This is the "corrupted in flight" case:
  the decode holds a byte that no prefill sent. On another TP rank nothing is flipped, so that
  rank must drop the request because rank 0 found a mismatch (the agreed drop set).
* AFTER ``record_outcome(room, rid, outcome, detail)``: append ``{pid, tp_rank, room, rid,
  outcome, detail}`` to ``<dir>/outcomes-<pid>.jsonl``, so a test counts the verified requests.

Nothing else is changed.
"""

from __future__ import annotations

import ctypes
import json
import os

ENV = "SGLANG_DFLASH_PP_TEST_KV_DIGEST_DIR"
MODULE_ENV = "SGLANG_DFLASH_PP_TEST_KV_DIGEST_MODULE"
MODULE = os.environ.get(MODULE_ENV) or "sglang_dflash_pp.srt.disaggregation.kv_digest_verify"
KINDS = ("draft", "target", "state")


def _tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().attn_tp_rank)


def _flip(address: int) -> None:
    byte = ctypes.c_ubyte.from_address(int(address))
    byte.value ^= 0x01


def corrupt_on_request(original, scheduler, inbox, req, *args, **kwargs):
    kind = next((k for k in KINDS if f"corrupt-{k}" in str(req.rid)), None)
    if kind is not None and _tp_rank() == 0:
        from sglang.srt.disaggregation.checksum import (
            page_indices_for_request,
            state_indices_for_request,
        )

        kv_args = inbox.kv_args
        seq_len, start = len(req.origin_input_ids), req.kv.cache_protected_len
        if kind == "state":
            slot = int(state_indices_for_request(scheduler, req, seq_len, start_idx=start)[0])
            base, item = kv_args.state_data_ptrs[0][0], kv_args.state_item_lens[0][0]
        else:
            slot = int(page_indices_for_request(scheduler, req, seq_len, start_idx=start)[0])
            n = len(kv_args.kv_data_ptrs)
            e = n - int(kv_args.num_draft_entries) if kind == "draft" else 0
            base, item = kv_args.kv_data_ptrs[e], kv_args.kv_item_lens[e]
        _flip(int(base) + slot * int(item) + 5)
    return original(scheduler, inbox, req, *args, **kwargs)


def record(result, room, rid, outcome, detail="", *args, **kwargs):
    directory = os.environ.get(ENV)
    if directory:
        row = {"pid": os.getpid(), "tp_rank": _tp_rank(), "room": int(room), "rid": str(rid),
               "outcome": outcome, "detail": detail}  # fmt: skip
        with open(os.path.join(directory, f"outcomes-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    return None


HOOKS = (
    (f"{MODULE}.verify_request", corrupt_on_request, "around"),
    (f"{MODULE}.record_outcome", record, "after"),
)
