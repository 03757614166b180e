"""The verifying half of the composed KV digest (``kv_digest``) on a Mooncake PD decode rank, with
``--disaggregation-enable-kv-checksum`` (sglang 0.5.23).

Every prefill rank that writes to this decode rank sends, per room, the digest sums of what it
wrote (``kv_digest_send``), ahead of its transfer status. When a request enters its first batch
(where stock verifies its own digest: after the transfer, before any KV is cached or decoded),
this rank digests the request's pages of every KV entry and its state slot, adds up the senders'
sums per buffer, and compares. A request is verified here whatever the two sides' layouts: PP
stages, other TP widths, head slices. On a mismatch the request is dropped with an error naming
the room, the buffer (target / draft KV entry and layer, or state component) and the prefill
ranks that wrote it, and the server keeps serving; the drop set is agreed over the attention TP
group first, as stock does, so the ranks keep running the same batches.

Hooks:

* AFTER ``decode.DecodePreallocQueue.__init__``: with the checksum flag on a Mooncake decode,
  build the digest engine (before serving) and the inbox of senders' sums.
* AROUND ``mooncake.conn.MooncakeKVManager.handle_chunk_ready``, the first handler of every
  message the decode thread receives: a digest message is taken into the inbox, anything else
  goes on to sglang's handlers.
* AROUND ``mooncake.conn.MooncakeKVReceiver.poll``: a room whose transfer completed but whose
  senders' sums are incomplete (some, not all, arrived) stays Transferring for at most
  ``SGLANG_DFLASH_KV_DIGEST_TIMEOUT_S`` seconds (default 10), then fails naming the senders that
  did not deliver; never a hang. A room with no sums at all came from a prefill that does not
  compose digests and is left to stock's rules.
* AROUND ``decode.SchedulerDisaggregationDecodeMixin._verify_kv_checksums``: the verification
  above, then stock's own (which finds no stock digest from a composing prefill).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.disaggregation.kv_digest import (
    DEFAULT_TIMEOUT_S,
    MESSAGE_TAG,
    TIMEOUT_ENV,
    Blocks,
    BufferKind,
    BufferTable,
    Contribution,
    Mismatch,
    as_sums,
    compare,
    decode,
    describe_senders,
    slots_of,
)

logger = logging.getLogger(__name__)

_INBOX_ATTR = "_dflash_kv_digest_inbox"  # on the decode's KV manager


class Inbox:
    """Senders' sums per room, filled by the decode thread, emptied by the scheduler."""

    def __init__(self, engine, kv_args, timeout_s: float):
        self.engine = engine
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._rooms: Dict[int, Dict[int, Contribution]] = {}
        self._first_complete: Dict[int, float] = {}
        self.tables = decode_tables(kv_args)
        self.keys = slots_of(self.tables)
        self.kv_args = kv_args

    def put(self, c: Contribution) -> None:
        with self._lock:
            self._rooms.setdefault(c.room, {})[c.sender.rank_id] = c

    def count(self, room: int) -> int:
        with self._lock:
            return len(self._rooms.get(room, ()))

    def senders(self, room: int):
        with self._lock:
            return [c.sender for c in self._rooms.get(room, {}).values()]

    def pop(self, room: int) -> List[Contribution]:
        with self._lock:
            self._first_complete.pop(room, None)
            return list(self._rooms.pop(room, {}).values())

    def waited(self, room: int) -> float:
        """Seconds since the room's transfer was first seen complete with sums missing."""
        with self._lock:
            first = self._first_complete.setdefault(room, time.monotonic())
        return time.monotonic() - first


def inbox_of(manager) -> Optional[Inbox]:
    return getattr(manager, _INBOX_ATTR, None)


def _flat(lists) -> list:
    return [int(x) for xs in (lists or []) for x in xs]


def decode_tables(kv_args) -> Tuple[BufferTable, BufferTable]:
    """This rank's buffers in the order its registration publishes them (what senders address)."""
    kv = BufferTable(BufferKind.KV, list(kv_args.kv_data_ptrs))
    state = BufferTable(BufferKind.STATE, _flat(kv_args.state_data_ptrs), first_slot=len(kv))
    return kv, state


def page_runs(pages: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(first page, length) of each run of consecutive page ids."""
    p = np.asarray(pages, dtype=np.int64).reshape(-1)
    if p.size == 0:
        return p, p
    starts = np.flatnonzero(np.diff(p, prepend=p[0] - 2) != 1)
    lengths = np.diff(np.append(starts, p.size))
    return p[starts], lengths


def request_blocks(kv_args, pages, state_indices) -> Blocks:
    """What this rank holds of one request: its pages of every KV entry, its state slots."""
    first, length = page_runs(pages)
    parts = []
    for e, (base, item) in enumerate(zip(kv_args.kv_data_ptrs, kv_args.kv_item_lens)):
        if first.size:
            item = int(item)
            parts.append(Blocks.of(int(base) + first * item, first * item, length * item, e))
    state_ptrs, state_lens = _flat(kv_args.state_data_ptrs), _flat(kv_args.state_item_lens)
    slots = np.asarray([] if state_indices is None else state_indices, np.int64).reshape(-1)
    n_kv = len(kv_args.kv_data_ptrs)
    for c, (base, item) in enumerate(zip(state_ptrs, state_lens)):
        if slots.size:
            parts.append(Blocks.of(base + slots * item, slots * item, item, n_kv + c))
    return Blocks.concat(parts)


def describe_buffer(kv_args, kind: BufferKind, index: int) -> str:
    """A decode buffer by what it holds: target or draft KV (entry, component, layer), or state."""
    if kind is BufferKind.STATE:
        ids = _flat(getattr(kv_args, "state_layer_ids", None))
        one_per_buffer = len(ids) == len(_flat(kv_args.state_data_ptrs))
        layer = f", layer {ids[index]}" if one_per_buffer and index < len(ids) else ""
        return f"state component {index} (KDA / Mamba{layer})"
    n = len(kv_args.kv_data_ptrs)
    n_draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    ids = list(getattr(kv_args, "kv_layer_ids", None) or [])
    layer = f" layer {ids[index]}" if index < len(ids) else ""
    if index >= n - n_draft:
        q = index - (n - n_draft)
        half = n_draft // 2
        comp = "K" if q < half else "V"
        return f"draft KV entry {index} ({comp}, draft layer {q % max(half, 1)}){layer}"
    n_target = n - n_draft
    return f"target KV entry {index}{layer} (of {n_target} target entries)"


def mismatch_message(room: int, rid, kv_args, mismatches: Sequence[Mismatch]) -> str:
    parts = [
        f"{describe_buffer(kv_args, m.kind, m.index)}: expected {m.expected:#018x}, "
        f"got {m.actual:#018x}, {describe_senders(m.senders)}"
        for m in mismatches[:4]
    ]
    more = f"; and {len(mismatches) - 4} more buffer(s)" if len(mismatches) > 4 else ""
    return (
        f"KV checksum mismatch: room {room} (req {rid}) on this decode rank: "
        + "; ".join(parts)
        + more
    )


def record_outcome(room: int, rid, outcome: str, detail: str = "") -> None:
    """One request's verification (``verified`` / ``mismatch``), for the log."""
    logger.debug("KV digest room %s req %s: %s %s", room, rid, outcome, detail)


def _drop(scheduler, req, message: str) -> None:
    """Stock's handling of a checksum mismatch (abort, stream, release, count), our message."""
    from http import HTTPStatus

    from sglang.srt.disaggregation.utils import prepare_abort
    from sglang.srt.mem_cache.common import release_kv_cache

    prepare_abort(req, message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
    scheduler.output_streamer.stream_output([req], req.return_logprob)
    release_kv_cache(req, scheduler.tree_cache, checkpoint=False)
    if scheduler.metrics_reporter.enable_metrics:
        scheduler.metrics_collector.increment_transfer_failed_reqs()


def verify_request(scheduler, inbox: Inbox, req) -> Optional[str]:
    """None when the request's bytes meet its senders' sums (or no sender composed a digest);
    else the mismatch message."""
    from sglang.srt.disaggregation.checksum import (
        page_indices_for_request,
        state_indices_for_request,
    )

    contributions = inbox.pop(int(req.bootstrap_room))
    if not contributions:
        return None
    seq_len = len(req.origin_input_ids)
    start = req.kv.cache_protected_len
    pages = page_indices_for_request(scheduler, req, seq_len, start_idx=start)
    state = state_indices_for_request(scheduler, req, seq_len, start_idx=start)
    blocks = request_blocks(
        inbox.kv_args,
        pages.cpu().numpy(),
        None if state is None else state.cpu().numpy(),
    )
    actual = as_sums(inbox.tables, inbox.engine.digest(blocks, inbox.keys))
    mismatches = compare(actual, contributions)
    if not mismatches:
        record_outcome(req.bootstrap_room, req.rid, "verified",
                       f"{len(actual)} buffers from {len(contributions)} senders")  # fmt: skip
        return None
    message = mismatch_message(req.bootstrap_room, req.rid, inbox.kv_args, mismatches)
    record_outcome(req.bootstrap_room, req.rid, "mismatch", message)
    return message


def verify_composed_digests(scheduler, batch) -> None:
    """Verify every request of ``batch`` that its senders composed a digest for, and drop the
    mismatched ones (the drop set agreed over the attention TP group first, as stock does).
    Runs where ``_verify_kv_checksums`` starts, before stock's own check."""
    inbox = inbox_of(scheduler.disagg_decode_prealloc_queue.kv_manager)
    if inbox is None:
        return
    from sglang.srt.disaggregation.checksum import is_health_check_req
    from sglang.srt.disaggregation.utils import all_reduce_flags

    import torch.distributed as dist

    flags = [0] * len(batch.reqs)
    messages: Dict[int, str] = {}
    for i, req in enumerate(batch.reqs):
        if is_health_check_req(req):
            inbox.pop(int(req.bootstrap_room))
            continue
        try:
            message = verify_request(scheduler, inbox, req)
        except Exception as e:  # the check failed, not the bytes: say so, keep serving
            logger.exception("KV digest verification of room %s failed", req.bootstrap_room)
            message = f"KV checksum could not be verified for room {req.bootstrap_room}: {e!r}"
        if message is not None:
            flags[i], messages[i] = 1, message
    flags = all_reduce_flags(flags, scheduler.attn_tp_cpu_group, dist.ReduceOp.MAX)
    if any(flags):
        for i, req in enumerate(batch.reqs):
            if flags[i]:
                message = messages.get(i, (
                    f"KV checksum mismatch: room {req.bootstrap_room} (req {req.rid}) on "
                    "another attention TP rank of this decode (its log names the buffer)"))
                logger.error(message)
                _drop(scheduler, req, message)
        batch.filter_batch(keep_indices=[i for i, bad in enumerate(flags) if not bad])


def verify_kv_checksums_around(original, self, batch, *args, **kwargs):
    verify_composed_digests(self, batch)
    return original(self, batch, *args, **kwargs)


def take_digest_message(manager, msg) -> bool:
    """True when ``msg`` (one the decode thread received) is a prefill rank's digest sums: taken
    into the inbox (a malformed one, or one for a room this rank does not hold, is dropped).
    Runs in the decode thread before its other handlers."""
    inbox = inbox_of(manager)
    if inbox is None or not msg or msg[0] != MESSAGE_TAG:
        return False
    try:
        c = decode(msg)
    except ValueError as e:
        logger.warning("Dropping malformed KV digest message: %s", e)
        return True
    if c.room in getattr(manager, "request_status", {}):
        inbox.put(c)
    return True


def handle_chunk_ready_around(original, self, msg, *args, **kwargs):
    if take_digest_message(self, msg):
        return True
    return original(self, msg, *args, **kwargs)


def poll_digest_sums(receiver, status):
    """``status`` (the receiver's poll) unless the room's transfer completed with some, not all,
    of its senders' sums: Transferring then, for at most the inbox's timeout, then Failed naming
    the senders that delivered."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    inbox = inbox_of(receiver.kv_mgr)
    if inbox is None or status != KVPoll.Success:
        return status
    room = int(receiver.bootstrap_room)
    required = getattr(receiver, "required_prefill_response_num", None)
    have = inbox.count(room)
    if have == 0 or required is None or have >= int(required):
        return status
    waited = inbox.waited(room)
    if waited < inbox.timeout_s:
        return KVPoll.Transferring
    got = ", ".join(s.describe() for s in inbox.senders(room))
    reason = (
        f"KV checksum: room {room}'s transfer completed but only {have} of its {required} "
        f"prefill ranks sent their digest sums within {inbox.timeout_s:g} s (received from "
        f"{got}); the others never delivered theirs ({TIMEOUT_ENV})"
    )
    inbox.pop(room)
    logger.error(reason)
    receiver.kv_mgr.record_failure(room, reason)
    receiver.conclude_state = KVPoll.Failed
    return KVPoll.Failed


def receiver_poll_around(original, self, *args, **kwargs):
    return poll_digest_sums(self, original(self, *args, **kwargs))


def start_verify_digest(queue) -> None:
    """With the checksum flag on a Mooncake decode (``queue``: its ``DecodePreallocQueue``, the
    KV manager built), build the digest engine (before serving) and the inbox of the senders'
    sums. Runs once ``DecodePreallocQueue.__init__`` built the KV manager."""
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.runtime_context import get_disagg

    if not get_disagg().disaggregation_enable_kv_checksum:
        return
    if queue.transfer_backend != TransferBackend.MOONCAKE:
        return
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import (
        DigestEngine,
        unsupported_state,
    )

    manager = queue.kv_manager
    if unsupported_state(manager.kv_args) is not None:
        logger.info("KV checksum: the composed digest is off on this decode (%s)",
                    unsupported_state(manager.kv_args))  # fmt: skip
        return
    engine = DigestEngine(getattr(queue.token_to_kv_pool, "device", "cpu"))
    timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    setattr(manager, _INBOX_ATTR, Inbox(engine, manager.kv_args, timeout))
    logger.info("KV checksum: this decode verifies composed digests (%s)", engine.describe())


def prealloc_queue_init_after(result, self, *args, **kwargs):
    start_verify_digest(self)
    return None


HOOKS = (
    PluginHook(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.__init__",
        prealloc_queue_init_after,
        "after",
        "KV checksum on a Mooncake decode: build the composed digest's engine and inbox",
    ),
    PluginHook(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.handle_chunk_ready",
        handle_chunk_ready_around,
        "around",
        "take the prefill ranks' digest sums off the decode thread's messages",
    ),
    PluginHook(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVReceiver.poll",
        receiver_poll_around,
        "around",
        "a room whose senders' digest sums are incomplete waits for them, bounded",
    ),
    PluginHook(
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin._verify_kv_checksums",
        verify_kv_checksums_around,
        "around",
        "verify every request against its senders' composed digest sums, any layout",
    ),
)
