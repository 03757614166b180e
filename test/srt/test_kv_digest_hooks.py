"""The composed KV digest's hooks stay out of the way unless the checksum is on, and its
decode-side wait is bounded.

The real paths run through real servers (``test/e2e``: every request verified, a corrupted byte
and a missing sender's sums each fail one request); here the hook functions are called directly:
``batch_transfer_sync_around``, ``send_aux_around`` and ``maybe_send_extra_around`` on a manager
with no digest, ``handle_chunk_ready_around`` on one with and without an inbox, and
``receiver_poll_around``'s wait for sums that arrived in part. The receiver and managers are
plain stand-ins holding the few attributes the hooks read (the real ones need a bootstrapped
PD pair; the e2e tests run those).
"""

from __future__ import annotations

import types

import pytest

from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_dflash_pp.srt.disaggregation import kv_digest_send, kv_digest_verify
from sglang_dflash_pp.srt.disaggregation.kv_digest import Contribution, Sender, encode


def _recording():
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return 0

    return original, calls


def test_send_side_hooks_are_inert_without_the_digest():
    manager = types.SimpleNamespace(engine=object())
    original, calls = _recording()
    args = ("session", [1, 2], [3, 4], [8, 8])
    assert kv_digest_send.batch_transfer_sync_around(original, manager.engine, *args) == 0
    assert calls == [((manager.engine,) + args, {})]
    req = types.SimpleNamespace(room=7, mooncake_session_id="s", is_dummy=False)
    original, calls = _recording()
    kv_digest_send.send_aux_around(original, manager, req, 3, [10])
    assert calls == [((manager, req, 3, [10]), {})]
    original, calls = _recording()
    kv_digest_send.maybe_send_extra_around(original, manager, req, [[1]], "executor")
    assert calls == [((manager, req, [[1]], "executor"), {})]
    with kv_digest_send.scope(manager, "s", "executor") as executor:
        assert executor == "executor"  # no digest: the executor passes through untouched


def test_decode_message_hook_takes_only_digest_messages():
    original, calls = _recording()
    plain = types.SimpleNamespace(request_status={5: KVPoll.Transferring})
    msg = encode(Contribution(5, Sender(1, 0, 3), {(1, 0): 9}))
    # no inbox (checksum off): every message goes to sglang's handlers, ours included
    assert kv_digest_verify.handle_chunk_ready_around(original, plain, msg) == 0
    assert len(calls) == 1
    inbox = kv_digest_verify.Inbox(None, types.SimpleNamespace(
        kv_data_ptrs=[4096], state_data_ptrs=[], kv_item_lens=[64], state_item_lens=[]), 1.0)
    manager = types.SimpleNamespace(request_status={5: KVPoll.Transferring},
                                    _dflash_kv_digest_inbox=inbox)
    assert kv_digest_verify.handle_chunk_ready_around(original, manager, msg) is True
    assert inbox.count(5) == 1 and len(calls) == 1
    other = [b"CHUNK_READY", b"5"]
    assert kv_digest_verify.handle_chunk_ready_around(original, manager, other) == 0
    assert len(calls) == 2
    # a room this decode does not hold is dropped, not kept
    late = encode(Contribution(6, Sender(0, 0, 1), {(1, 0): 1}))
    assert kv_digest_verify.handle_chunk_ready_around(original, manager, late) is True
    assert inbox.count(6) == 0


def test_partial_sums_wait_bounded_then_fail_naming_what_arrived(monkeypatch):
    inbox = kv_digest_verify.Inbox(None, types.SimpleNamespace(
        kv_data_ptrs=[], state_data_ptrs=[], kv_item_lens=[], state_item_lens=[]), 5.0)
    failures = {}
    mgr = types.SimpleNamespace(_dflash_kv_digest_inbox=inbox,
                                record_failure=lambda room, why: failures.update({room: why}))
    receiver = types.SimpleNamespace(kv_mgr=mgr, bootstrap_room=11,
                                     required_prefill_response_num=2, conclude_state=None)
    success = lambda self: KVPoll.Success  # noqa: E731

    # no sums at all: a prefill that composes no digest; stock's rules
    assert kv_digest_verify.receiver_poll_around(success, receiver) == KVPoll.Success
    inbox.put(Contribution(11, Sender(1, 0, 4), {}))
    now = [1000.0]
    monkeypatch.setattr(kv_digest_verify.time, "monotonic", lambda: now[0])
    assert kv_digest_verify.receiver_poll_around(success, receiver) == KVPoll.Transferring
    now[0] += 4.9
    assert kv_digest_verify.receiver_poll_around(success, receiver) == KVPoll.Transferring
    now[0] += 0.2
    assert kv_digest_verify.receiver_poll_around(success, receiver) == KVPoll.Failed
    assert receiver.conclude_state == KVPoll.Failed
    why = failures[11]
    assert "only 1 of its 2 prefill ranks" in why and "prefill pp rank 1 / attention TP rank 0" in why
    assert kv_digest_verify.TIMEOUT_ENV in why
    # all sums there: the transfer's own verdict stands
    inbox.put(Contribution(12, Sender(0, 0, 0), {}))
    inbox.put(Contribution(12, Sender(1, 0, 4), {}))
    receiver.bootstrap_room = 12
    assert kv_digest_verify.receiver_poll_around(success, receiver) == KVPoll.Success


def test_one_digest_per_chunk_and_every_rank_gets_its_sums_before_the_last_aux():
    """A chunk sent to two decode ranks: target descriptors through the engine hook, one of them
    from an executor thread (as ``send_kvcache_slice`` sends), draft blocks queued by the draft
    send (as a function the digest thread runs). No message goes out before the room's last aux;
    then both ranks' messages go out before that aux (sglang sends the status right after it).
    Each rank's sums equal the host reference over exactly the bytes it was sent, and each
    distinct block of the chunk is digested once, whenever the thread got to it (the second
    rank's parts equal the first's)."""
    import concurrent.futures

    import numpy as np

    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv
    from sglang_dflash_pp.srt.disaggregation.kv_digest import (
        Blocks,
        BufferKind,
        decode,
        digest_blocks_host,
        buffer_key,
    )
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    base = src.ctypes.data
    engine_calls = []

    class CountingEngine(DigestEngine):
        def submit(self, blocks, keys, wait_events=()):
            engine_calls.append(blocks.count)
            return super().submit(blocks, keys, wait_events)

    sent = []
    regs = {s: types.SimpleNamespace(dst_kv_ptrs=[1 << 40, 1 << 41], dst_state_data_ptrs=[])
            for s in ("d0", "d1")}
    manager = types.SimpleNamespace(
        engine=object(), decode_kv_args_table=regs, request_status={9: KVPoll.Transferring},
        _dflash_kv_digest=kv_digest_send.SendDigest(CountingEngine("cpu"), Sender(1, 0, 2)),
        _send_multipart_locked=lambda endpoint, frames, is_ipv6=False: sent.append(frames),
        conclude_failure=lambda **kw: (_ for _ in ()).throw(AssertionError(kw)))
    original, calls = _recording()
    mooncake_draft_kv.begin_chunk(manager, types.SimpleNamespace(room=9, wait_event=None))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for s in ("d0", "d1"):
                with kv_digest_send.scope(manager, s, pool) as scoped:
                    # entry 0 from the worker thread, entry 1 from the executor's thread
                    kv_digest_send.batch_transfer_sync_around(
                        original, manager.engine, s, [base], [(1 << 40) + 128], [256])
                    scoped.submit(kv_digest_send.batch_transfer_sync_around, original,
                                  manager.engine, s, [base + 512], [(1 << 41) + 64], [128]).result()
                kv_digest_send.add_blocks(manager, 9, s, regs[s],
                                          lambda: Blocks.of([base + 1024], [0], 64, 1, rows=2,
                                                            src_stride=128, dst_stride=64))
        assert len(calls) == 4
        aux = [types.SimpleNamespace(room=9, mooncake_session_id=s, is_dummy=False,
                                     required_dst_info_num=2, endpoint="127.0.0.1", dst_port=1)
               for s in ("d0", "d1")]
        kv_digest_send.send_aux_around(original, manager, aux[0], 0, [])
        assert sent == []
        kv_digest_send.send_aux_around(original, manager, aux[1], 0, [])
    finally:
        mooncake_draft_kv.end_chunk()
    assert sum(engine_calls) == 3  # the chunk's three distinct blocks, each digested once
    assert [decode(f).room for f in sent] == [9, 9] and len(calls) == 6
    keys = [buffer_key(BufferKind.KV, i) for i in range(2)]
    want = digest_blocks_host(Blocks.concat([
        Blocks.of([base], [128], 256, 0), Blocks.of([base + 512], [64], 128, 1),
        Blocks.of([base + 1024], [0], 64, 1, rows=2, src_stride=128, dst_stride=64)]), keys)
    for frames in sent:
        c = decode(frames)
        assert c.sums == {(1, 0): int(want[0]), (1, 1): int(want[1])}
        assert c.sender == Sender(1, 0, 2)


def _chunk_manager(engine, failures, sent):
    regs = {"d0": types.SimpleNamespace(dst_kv_ptrs=[1 << 40], dst_state_data_ptrs=[])}
    return regs, types.SimpleNamespace(
        engine=object(), decode_kv_args_table=regs, request_status={},
        _dflash_kv_digest=kv_digest_send.SendDigest(engine, Sender(0, 0, 0)),
        _send_multipart_locked=lambda endpoint, frames, is_ipv6=False: sent.append(frames),
        conclude_failure=lambda **kw: failures.append(kw))


def _send_one_chunk(manager, regs, room, base, nbytes, last=False, dst=0, aux=True):
    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv, transfer_chunk

    original, _ = _recording()
    manager.request_status[room] = KVPoll.Transferring
    mooncake_draft_kv.begin_chunk(manager, types.SimpleNamespace(room=room, wait_event=None,
                                                                 is_last_chunk=last))  # fmt: skip
    try:
        with kv_digest_send.scope(manager, "d0", None):
            kv_digest_send.batch_transfer_sync_around(original, manager.engine, "d0", [base],
                                                      [(1 << 40) + dst], [nbytes])  # fmt: skip
        if aux:
            aux = types.SimpleNamespace(room=room, mooncake_session_id="d0", is_dummy=False,
                                        required_dst_info_num=1, endpoint="127.0.0.1", dst_port=1)
            kv_digest_send.send_aux_around(original, manager, aux, 0, [])
    finally:
        mooncake_draft_kv.end_chunk()
        assert transfer_chunk.chunk_manager() is None


def test_a_later_chunk_with_the_same_descriptors_is_digested_again():
    """The digest thread reuses a part's sums within a chunk only: the next chunk sends the
    same addresses with other bytes in them, and its sums are those bytes'."""
    import numpy as np

    from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks, BufferKind, buffer_key
    from sglang_dflash_pp.srt.disaggregation.kv_digest import decode, digest_blocks_host
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

    src = np.arange(256, dtype=np.uint8)
    failures, sent = [], []
    regs, manager = _chunk_manager(DigestEngine("cpu"), failures, sent)
    keys = [buffer_key(BufferKind.KV, 0)]
    want = []
    for room in (1, 2):
        _send_one_chunk(manager, regs, room, src.ctypes.data, 256)
        want.append(int(digest_blocks_host(Blocks.of([src.ctypes.data], [0], 256, 0), keys)[0]))
        src[7] ^= 0x5A  # the next chunk's bytes at the same place
    got = [decode(f).sums[(1, 0)] for f in sent]
    assert failures == [] and got == want and want[0] != want[1]


def test_a_stuck_digest_thread_fails_the_room_without_its_sums(monkeypatch):
    """The worker waits for the digest thread a bounded time before the room's status: past it
    the room fails naming the thread and the bound, no sums are sent, and the worker returns."""
    import threading
    import time

    import numpy as np

    from sglang_dflash_pp.srt.disaggregation.kv_digest import TIMEOUT_ENV
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

    release = threading.Event()

    class StuckEngine(DigestEngine):
        def submit(self, blocks, keys, wait_events=()):
            release.wait(30)
            return super().submit(blocks, keys, wait_events)

    monkeypatch.setenv(TIMEOUT_ENV, "0.5")
    src = np.zeros(64, dtype=np.uint8)
    failures, sent = [], []
    regs, manager = _chunk_manager(StuckEngine("cpu"), failures, sent)
    t0 = time.monotonic()
    try:
        _send_one_chunk(manager, regs, 5, src.ctypes.data, 64)
    finally:
        release.set()
    assert time.monotonic() - t0 < 5
    assert sent == [] and [f["bootstrap_room"] for f in failures] == [5]
    reason = failures[0]["failure_reason"]
    assert "digest thread" in reason and TIMEOUT_ENV in reason and "0.5 s" in reason


def test_the_digest_thread_runs_when_a_worker_enters_a_transfer_or_the_workers_are_idle():
    """Jobs wait for a worker to enter a transfer (the GIL free) or to wait for the thread; with
    no transfer for IDLE_S they run anyway; jobs run in order."""
    import threading
    import time

    from sglang_dflash_pp.srt.disaggregation.kv_digest_thread import IDLE_S, DigestThread

    ran = []
    thread = DigestThread("test-digest")
    first = threading.Event()
    thread.submit(lambda: (ran.append(1), first.set()))
    time.sleep(IDLE_S / 5)
    assert ran == []  # no window yet, and not idle long enough
    thread.wake()  # a worker enters a transfer
    assert first.wait(5)
    t0 = time.monotonic()
    thread.submit(ran.append, 2)
    assert thread.wait(5)  # the waiting worker opens the window itself
    assert ran == [1, 2] and time.monotonic() - t0 < IDLE_S * 10
    idle = threading.Event()
    thread.submit(idle.set)
    assert idle.wait(5)  # no window at all: after IDLE_S


def test_a_room_sums_its_middle_chunks_and_its_last_chunk_on_the_thread():
    """Two middle chunks of a room (digested on the thread after each ends) and its last chunk
    (on the thread too, done before the status): the decode rank's sums cover the three chunks'
    bytes."""
    import numpy as np

    from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks, BufferKind, buffer_key
    from sglang_dflash_pp.srt.disaggregation.kv_digest import decode, digest_blocks_host
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

    src = np.random.default_rng(3).integers(0, 256, 768, dtype=np.uint8)
    failures, sent = [], []
    regs, manager = _chunk_manager(DigestEngine("cpu"), failures, sent)
    for i in range(3):
        _send_one_chunk(manager, regs, 7, src.ctypes.data + 256 * i, 256, last=i == 2,
                        dst=256 * i, aux=i == 2)  # fmt: skip
    keys = [buffer_key(BufferKind.KV, 0)]
    want = digest_blocks_host(Blocks.of([src.ctypes.data], [0], 768, 0), keys)
    assert failures == [] and len(sent) == 1
    assert decode(sent[0]).sums == {(1, 0): int(want[0])}


@pytest.mark.parametrize("known_ranks", [False, True])
def test_a_last_chunk_is_digested_during_its_own_long_transfers_and_read_before_its_status(
    monkeypatch, known_ranks
):
    """On a room's last chunk, the first transfer of at least EAGER_DIGEST_MIN_BYTES to a decode
    rank has the digest thread digest, while it runs, what the ranks sent before handed over
    (and what is queued of this one), so the status waits only for the tail; a short transfer,
    or one to the first rank, only lets the thread resolve; every block is read before the
    status."""
    import threading

    import numpy as np

    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv
    from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks, BufferKind, buffer_key
    from sglang_dflash_pp.srt.disaggregation.kv_digest import decode, digest_blocks_host
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

    monkeypatch.setattr(kv_digest_send, "WINDOW_MIN_BYTES", 256)
    monkeypatch.setattr(kv_digest_send, "EAGER_DIGEST_MIN_BYTES", 512)
    src = np.random.default_rng(5).integers(0, 256, 2048, dtype=np.uint8)
    base = src.ctypes.data
    digested = []  # (blocks, bytes) per engine call

    class CountingEngine(DigestEngine):
        def submit(self, blocks, keys, wait_events=()):
            digested.append(blocks.total_bytes)
            return super().submit(blocks, keys, wait_events)

    failures, sent = [], []
    regs, manager = _chunk_manager(CountingEngine("cpu"), failures, sent)
    regs["d1"] = types.SimpleNamespace(dst_kv_ptrs=[1 << 41], dst_state_data_ptrs=[])
    if known_ranks:  # sglang's transfer_infos of the room: two decode ranks and a dummy
        manager.transfer_infos = {11: {s: types.SimpleNamespace(is_dummy=s == "x")
                                       for s in ("d0", "d1", "x")}}  # fmt: skip
    thread = manager._dflash_kv_digest.thread
    during = {}

    def transfer(engine, session_id, buffers, peer_buffer_addresses, lengths, *a, **k):
        # Mooncake's wait, the GIL free: the thread runs what the hook queued meanwhile
        idle = threading.Event()
        thread.submit(idle.set)
        assert idle.wait(5)
        during[session_id] = list(digested)
        return 0

    at_status = []
    manager.request_status[11] = KVPoll.Transferring
    mooncake_draft_kv.begin_chunk(
        manager, types.SimpleNamespace(room=11, wait_event=None, is_last_chunk=True))
    try:
        for i, s in enumerate(("d0", "d1")):
            with kv_digest_send.scope(manager, s, None):
                # one long transfer (eager) and one short one (only the window) per decode rank
                kv_digest_send.batch_transfer_sync_around(
                    transfer, manager.engine, s, [base + 1024 * i], [regs[s].dst_kv_ptrs[0]], [768])
                kv_digest_send.batch_transfer_sync_around(
                    transfer, manager.engine, s, [base + 1024 * i + 768],
                    [regs[s].dst_kv_ptrs[0] + 768], [256])
        for s in ("d0", "d1"):
            aux = types.SimpleNamespace(room=11, mooncake_session_id=s, is_dummy=False,
                                        required_dst_info_num=2, endpoint="127.0.0.1", dst_port=1)
            kv_digest_send.send_aux_around(
                lambda *a, **k: at_status.append((thread.idle, sum(digested))), manager, aux)
    finally:
        mooncake_draft_kv.end_chunk()
    # d1's long transfer digested d0's 1024 bytes and its own first 768 while it ran; the rest
    # (d1's short transfer's 256) at the status
    assert during == {"d0": [], "d1": [1024 + 768]}
    assert digested == [1024 + 768, 256]
    # sglang's status follows the room's last aux: by then every byte was read (the first aux
    # goes out before the worker waits for the thread)
    assert at_status[-1] == (True, 2048) and len(at_status) == 2
    keys = [buffer_key(BufferKind.KV, 0)]
    assert failures == []
    for i, frames in enumerate(sent):
        want = digest_blocks_host(Blocks.of([base + 1024 * i], [0], 1024, 0), keys)
        assert decode(frames).sums == {(1, 0): int(want[0])}


def test_a_last_chunk_hides_few_engine_calls_in_its_long_transfers():
    """Which long transfer of a last chunk also has the thread digest what is queued: with the
    room's decode ranks known, once when half the ranks before the last were handed over, at the
    last rank's first, and at each later one of the last rank that follows a hand-over (so the
    status waits only for what the last transfers handed over); for one decode rank, at a long
    transfer after a hand-over; not known, at each new rank's first; never on a middle chunk
    (its digest runs after it) or in the synchronous design."""
    P = kv_digest_send._Pending

    def fired(p, sends):
        out = []
        for s, handed_first in sends:  # a long transfer to session s
            # sglang's descriptor lists are handed over by the transfer hook, after the check;
            # the draft's pages by its send, before its transfer
            before = set(p.handed) | ({s} if handed_first else set())
            p.handed.add(s)
            p.seen.add(s)
            if p.digest_during(s, before):
                p.handed.clear()
                out.append(s if not handed_first else (s, "handed first"))
        return out

    sends = [(r, False) for r in ("a", "b", "c") for _ in range(2)]  # two long transfers per rank
    assert fired(P(last=True, ranks=3), sends) == ["b", "c"]
    assert fired(P(last=True, ranks=1), [("a", False)] * 3) == ["a"]
    assert fired(P(last=True, ranks=0), sends) == ["b", "c"]
    assert fired(P(last=False, ranks=3), sends) == []
    inline = P(last=True, ranks=3)
    inline.inline = True
    assert fired(inline, sends) == []
    # Kimi-K3's last stage (kv_digest_cost.py): 8 decode ranks, each sent its target MLA entries
    # then its draft: calls at rank 4's MLA (ranks 0..3 and it), rank 7's MLA (4..6 and it) and
    # rank 7's draft; the status waits for rank 7's state only
    k3 = [(r, draft) for r in range(8) for draft in (False, True)]
    assert fired(P(last=True, ranks=8), k3) == [4, 7, (7, "handed first")]
    assert fired(P(last=False, ranks=8), k3) == []


def test_begin_chunk_counts_the_rooms_decode_ranks_from_sglangs_transfer_infos():
    """The ranks a last chunk's eager digest waits for are the room's non-dummy decode
    requests in ``MooncakeKVManager.transfer_infos`` (0 when the room has none there)."""
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

    failures, sent = [], []
    _, manager = _chunk_manager(DigestEngine("cpu"), failures, sent)
    manager.transfer_infos = {4: {s: types.SimpleNamespace(is_dummy=s == "x")
                                  for s in ("a", "b", "c", "x")}}  # fmt: skip
    try:
        for room, want in ((4, 3), (5, 0)):
            kv_digest_send.begin_chunk(manager, types.SimpleNamespace(room=room, is_last_chunk=True))
            assert kv_digest_send._pending().ranks == want and kv_digest_send._pending().last
    finally:
        kv_digest_send.end_chunk(manager)


@pytest.mark.parametrize("bad", ["below its buffers", "no buffer table"])
def test_a_descriptor_below_its_decodes_buffers_fails_its_room_and_the_rest_is_digested(bad):
    """The chunk's descriptor lists are resolved together; one whose destination lies below
    its decode's buffers (but above another decode's), or whose decode registration gives no
    buffer table, fails the room naming why, and the other decode rank's sums are still those
    of its bytes."""
    import numpy as np

    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv
    from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks, BufferKind, buffer_key
    from sglang_dflash_pp.srt.disaggregation.kv_digest import digest_blocks_host
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

    src = np.random.default_rng(9).integers(0, 256, 512, dtype=np.uint8)
    failures, sent = [], []
    regs, manager = _chunk_manager(DigestEngine("cpu"), failures, sent)
    regs["d1"] = types.SimpleNamespace(dst_kv_ptrs=[1 << 42], dst_state_data_ptrs=[])
    if bad == "no buffer table":
        regs["d1"] = types.SimpleNamespace(dst_kv_ptrs=None, dst_state_data_ptrs=[])
    original, _ = _recording()
    manager.request_status[3] = KVPoll.Transferring
    mooncake_draft_kv.begin_chunk(manager, types.SimpleNamespace(room=3, wait_event=None,
                                                                 is_last_chunk=True))  # fmt: skip
    try:
        for s, dst in (("d0", 1 << 40), ("d1", (1 << 41) + 64)):  # d1's: below its 2**42
            with kv_digest_send.scope(manager, s, None):
                kv_digest_send.batch_transfer_sync_around(original, manager.engine, s,
                                                          [src.ctypes.data], [dst], [256])  # fmt: skip
        assert kv_digest_send.flush(manager)
    finally:
        mooncake_draft_kv.end_chunk()
    assert [f["bootstrap_room"] for f in failures] == [3]
    reason = failures[0]["failure_reason"]
    assert "d1" in reason
    assert ("below every decode buffer" if bad == "below its buffers" else "NoneType") in reason
    keys = [buffer_key(BufferKind.KV, 0)]
    want = digest_blocks_host(Blocks.of([src.ctypes.data], [0], 256, 0), keys)
    assert manager._dflash_kv_digest.pop(3, "d0").sums == {(1, 0): int(want[0])}
    assert manager._dflash_kv_digest.pop(3, "d1").sums == {}


def _state_manager(engine, failures, sent, state_lists):
    """A manager whose decode rank ``d0`` has one state buffer, and whose ``maybe_send_extra``
    sends ``state_lists()`` (sglang's state send, as the hooked transfer engine sees it)."""
    regs, manager = _chunk_manager(engine, failures, sent)
    regs["d0"].dst_state_data_ptrs = [[1 << 42]]
    original, calls = _recording()
    manager.state_sends = calls

    def maybe_send_extra(req, states, executor, registration=None):
        for src, dst, length in state_lists():
            kv_digest_send.batch_transfer_sync_around(original, manager.engine,
                                                      req.mooncake_session_id, src, dst, length)
        return 0

    manager.maybe_send_extra = maybe_send_extra
    manager.transfer_infos = {7: {"d0": types.SimpleNamespace(
        is_dummy=False, mooncake_session_id="d0", dst_state_indices=[[0]])}}  # fmt: skip
    return regs, manager


def _last_chunk_with_state(manager, regs, state_lists, send_state=True):
    """Room 7's last chunk to d0: its state send (if ``send_state``) and its aux; the engine
    calls the digest made, and how many of them came after the worker's state send."""
    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv

    thread = manager._dflash_kv_digest.thread
    manager.request_status[7] = KVPoll.Transferring
    mooncake_draft_kv.begin_chunk(manager, types.SimpleNamespace(
        room=7, wait_event=None, is_last_chunk=True, state_indices=[[3]]))  # fmt: skip
    try:
        assert thread.wait(5)  # the prepare job ran (it would run during the chunk's KV)
        before = len(manager.engine_calls)
        if send_state:
            req = manager.transfer_infos[7]["d0"]
            original, _ = _recording()
            with kv_digest_send.state_scope(manager, req, None):
                for src, dst, length in state_lists():
                    kv_digest_send.batch_transfer_sync_around(original, manager.engine, "d0",
                                                              src, dst, length)
        aux = types.SimpleNamespace(room=7, mooncake_session_id="d0", is_dummy=False,
                                    required_dst_info_num=1, endpoint="127.0.0.1", dst_port=1)
        kv_digest_send.send_aux_around(lambda *a, **k: 0, manager, aux)
    finally:
        mooncake_draft_kv.end_chunk()
    return len(manager.engine_calls) - before


def _counting_engine(calls):
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

    class Counting(DigestEngine):
        def submit(self, blocks, keys, wait_events=()):
            calls.append(blocks.total_bytes)
            return super().submit(blocks, keys, wait_events)

    return Counting("cpu")


@pytest.mark.parametrize("case", ["sent as prepared", "not sent", "sent otherwise"])
def test_a_last_chunks_state_is_digested_from_its_start_and_only_what_is_sent_is_added(case):
    """On a room's last chunk with a state, the digest thread runs sglang's state send dry at the
    chunk's start (nothing transferred) and digests it then: when the worker's state send hands
    over the same lists, the status makes no engine call and the sums are the sent bytes'; a
    state the worker does not send adds nothing; lists the send does not repeat are digested as
    they come."""
    import numpy as np

    from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks, BufferKind, buffer_key
    from sglang_dflash_pp.srt.disaggregation.kv_digest import decode, digest_blocks_host

    src = np.random.default_rng(11).integers(0, 256, 1024, dtype=np.uint8)
    base = src.ctypes.data
    prepared = ([base, base + 512], [1 << 42, (1 << 42) + 512], [256, 256])
    lists = [prepared]
    failures, sent, calls = [], [], []
    regs, manager = _state_manager(_counting_engine(calls), failures, sent, lambda: lists)
    manager.engine_calls = calls
    if case == "sent otherwise":  # the worker's send differs from the dry run's
        sent_lists = [([base + 256], [(1 << 42) + 256], [512])]
    else:
        sent_lists = lists
    after_state = _last_chunk_with_state(manager, regs, lambda: sent_lists,
                                         send_state=case != "not sent")  # fmt: skip
    assert failures == [] and len(sent) == 1
    assert manager.state_sends == []  # the dry run moved nothing
    assert calls[0] == 512  # the prepare job's one engine call, at the chunk's start
    sums = decode(sent[0]).sums
    key = [buffer_key(BufferKind.KV, 0), buffer_key(BufferKind.STATE, 0)]
    if case == "not sent":
        assert sums == {} and after_state == 0
        return
    srcs, dsts, lens = sent_lists[0]
    want = digest_blocks_host(
        Blocks.concat([Blocks.of([s], [d - (1 << 42)], n, 1) for s, d, n in zip(srcs, dsts, lens)]),
        key)  # fmt: skip
    assert sums == {(int(BufferKind.STATE), 0): int(want[1])}
    assert after_state == (0 if case == "sent as prepared" else 1)


def test_a_window_has_nothing_new_when_every_queued_part_is_a_draft_head_already_digested():
    """The state's dry run waits for a window with nothing new queued: an empty queue, or only
    draft parts whose sums the chunk knows (a head another decode rank holds too). A descriptor
    list, or a draft part not digested yet, is new."""
    import numpy as np

    reg = types.SimpleNamespace(dst_kv_ptrs=[1 << 40, 1 << 41], dst_state_data_ptrs=[])
    memo = {}
    pages = np.arange(4, dtype=np.int64)
    known = kv_digest_send.DraftPart(object(), pages, pages, memo)
    other = kv_digest_send.DraftPart(object(), pages, pages, memo)
    pending = kv_digest_send._Pending(last=True, ranks=2)
    manager = object()
    assert pending.nothing_new()
    pending.known[known.signature + kv_digest_send._tables_and_keys(reg)[2]] = (None, 0, 2)
    pending.hand(manager, 1, "decode-a", reg, known, ())
    assert pending.nothing_new()
    pending.hand(manager, 1, "decode-b", reg, other, ())
    assert not pending.nothing_new()
    pending.take()
    pending.hand(manager, 1, "decode-a", reg,
                 kv_digest_send._Descriptors(kv_digest_send.BufferKind.KV, [0], [1 << 40], [4]), ())
    assert not pending.nothing_new()


# -- the worker digesting inside its own transfers (Mooncake's asynchronous batch API) ----------


class _RecordingMooncake:
    """The real Mooncake engine of sglang's ``MooncakeTransferEngine``, its batch calls recorded
    in ``order`` (and the submit's result replaced where ``submit_result`` is set); everything
    else passes through."""

    def __init__(self, real, order):
        self._real, self.order, self.submit_result = real, order, None

    def batch_transfer_async_write(self, *args):
        self.order.append("submit")
        batch = self._real.batch_transfer_async_write(*args)
        return batch if self.submit_result is None else self.submit_result

    def get_batch_transfer_status(self, batch_ids):
        ret = self._real.get_batch_transfer_status(batch_ids)
        self.order.append(("status", ret))
        return ret

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture(scope="module")
def loopback():
    """sglang's real ``MooncakeTransferEngine`` over TCP on 127.0.0.1, writing into its own
    registered buffers (its session is the decode's here): a prefill rank's source KV and state
    and a decode rank's KV and state buffers, as numpy arrays."""
    import os

    import numpy as np

    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

    previous = os.environ.get("MC_FORCE_TCP")
    os.environ["MC_FORCE_TCP"] = "1"
    try:
        engine = MooncakeTransferEngine("127.0.0.1")
    finally:
        if previous is None:
            os.environ.pop("MC_FORCE_TCP")
        else:
            os.environ["MC_FORCE_TCP"] = previous
    rng = np.random.default_rng(23)
    bufs = types.SimpleNamespace(src=rng.integers(0, 256, 8192, dtype=np.uint8),
                                 dst=np.zeros(8192, np.uint8),
                                 state_src=rng.integers(0, 256, 1024, dtype=np.uint8),
                                 state_dst=np.zeros(1024, np.uint8),
                                 unregistered=np.zeros(1024, np.uint8))  # fmt: skip
    registered = [bufs.src, bufs.dst, bufs.state_src, bufs.state_dst]
    assert engine.batch_register([a.ctypes.data for a in registered], [a.nbytes for a in registered]) == 0
    return engine, bufs


class _GpuLikeSums:
    """Sums that, like a GPU call's, are ready only once ``ready`` is set: ``done()`` asks, and
    ``result()`` waits for it (bounded), recording the read in ``order``. The host engine's
    sums are computed at the submit; this stands in for the kernel still running."""

    def __init__(self, sums, nbytes, ready, order):
        self._sums, self._nbytes, self._ready, self._order = sums, nbytes, ready, order

    def done(self):
        return self._ready.is_set()

    def result(self):
        assert self._ready.wait(10), "the sums were never released"
        self._order.append(("read", self._nbytes))
        return self._sums.result()


def _window_manager(engine, bufs, failures, sent, calls, order, window_min_bytes=1024,
                    ready=None):  # fmt: skip
    """A prefill rank's KV manager stand-in on the real engine (its Mooncake calls recorded),
    with the digest on as ``start_send_digest`` sets it for that engine: one decode rank (the
    engine's own session) holding ``bufs.dst`` as KV entry 0 (and ``bufs.unregistered``, which
    Mooncake does not know, as entry 1) and ``bufs.state_dst`` as its state. ``ready``: a
    ``threading.Event`` the engine's sums wait for (:class:`_GpuLikeSums`)."""
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

    class Counting(DigestEngine):
        def submit(self, blocks, keys, wait_events=()):
            calls.append(blocks.total_bytes)
            order.append(("digest", blocks.total_bytes))
            sums = super().submit(blocks, keys, wait_events)
            return sums if ready is None else _GpuLikeSums(sums, blocks.total_bytes, ready, order)

    if not isinstance(engine.engine, _RecordingMooncake):
        engine.engine = _RecordingMooncake(engine.engine, order)
    engine.engine.order, engine.engine.submit_result = order, None
    session = engine.session_id
    regs = {session: types.SimpleNamespace(
        dst_kv_ptrs=[bufs.dst.ctypes.data, bufs.unregistered.ctypes.data],
        dst_state_data_ptrs=[[bufs.state_dst.ctypes.data]])}  # fmt: skip
    digest = kv_digest_send.SendDigest(Counting("cpu"), Sender(1, 0, 2))
    digest.windows = kv_digest_send.transfer_windows(engine)
    digest.window_min_bytes = window_min_bytes
    manager = types.SimpleNamespace(
        engine=engine, decode_kv_args_table=regs, request_status={},
        _dflash_kv_digest=digest,
        _send_multipart_locked=lambda endpoint, frames, is_ipv6=False: sent.append(frames),
        conclude_failure=lambda **kw: failures.append(kw))
    manager.transfer_infos = {}
    return session, regs, manager


def _stock_sync():
    """sglang's own ``batch_transfer_sync`` (its body, under whatever hook this process holds),
    its calls counted."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

    body = getattr(MooncakeTransferEngine.batch_transfer_sync, "__wrapped__",
                   MooncakeTransferEngine.batch_transfer_sync)  # fmt: skip
    calls = []

    def original(self, *args, **kwargs):
        calls.append(args)
        return body(self, *args, **kwargs)

    return original, calls


def test_with_mooncakes_async_api_the_worker_digests_a_last_chunk_inside_its_own_transfers(
    loopback, caplog
):
    """Through sglang's real MooncakeTransferEngine over TCP: a room's last chunk, three target
    KV transfers (two long: submitted asynchronously, the worker digesting what is queued before
    it waits; one short: stock's synchronous call, and one long from an executor thread: stock's
    too), between the first two a long transfer outside any digest scope (as the draft's own
    transfer, with nothing new queued), then its state send. The state's dry run is the work of
    that window, the first from the chunk's second with nothing new to digest; its lists join
    the next window's engine call; every window digests what was queued, the state at the
    status makes no engine call. The digest thread runs no job, every byte arrives, and the
    decode rank's sums are the sent bytes'."""
    import concurrent.futures
    import logging

    import numpy as np

    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv
    from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks, BufferKind, buffer_key
    from sglang_dflash_pp.srt.disaggregation.kv_digest import decode, digest_blocks_host

    engine, b = loopback
    b.dst[:], b.state_dst[:] = 0, 0
    failures, sent, calls, order = [], [], [], []
    session, regs, manager = _window_manager(engine, b, failures, sent, calls, order)
    src, dst, state_src, state_dst = (a.ctypes.data for a in (b.src, b.dst, b.state_src, b.state_dst))
    state_lists = ([state_src, state_src + 512], [state_dst, state_dst + 512], [256, 256])

    def maybe_send_extra(req, states, executor, registration=None):  # sglang's state send
        return kv_digest_send.batch_transfer_sync_around(original, engine, req.mooncake_session_id,
                                                         *state_lists)  # fmt: skip

    manager.maybe_send_extra = maybe_send_extra
    req = types.SimpleNamespace(is_dummy=False, mooncake_session_id=session, room=7,
                                required_dst_info_num=1, endpoint="127.0.0.1", dst_port=1)
    manager.transfer_infos = {7: {session: req}}
    manager.request_status[7] = KVPoll.Transferring
    original, stock_calls = _stock_sync()
    thread = manager._dflash_kv_digest.thread
    submitted = []
    thread.submit = lambda fn, *a: submitted.append(fn)
    # (src offset, dst offset, bytes); the last one from an executor thread
    kv = [(0, 0, 2048), (2048, 2048, 2048), (4096, 4096, 512), (4608, 4608, 2048)]
    unscoped = (6656, 6656, 1024)  # not digested: no scope is open (as the draft's own transfer)
    results = []
    caplog.set_level(logging.INFO, logger=kv_digest_send.__name__)
    mooncake_draft_kv.begin_chunk(manager, types.SimpleNamespace(
        room=7, wait_event=None, is_last_chunk=True, state_indices=[[0]]))  # fmt: skip
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for i, (s, d, n) in enumerate(kv[:3]):
                with kv_digest_send.scope(manager, session, pool):
                    results.append(kv_digest_send.batch_transfer_sync_around(
                        original, engine, session, [src + s], [dst + d], [n]))
                if i == 0:  # no scope open
                    s, d, n = unscoped
                    results.append(kv_digest_send.batch_transfer_sync_around(
                        original, engine, session, [src + s], [dst + d], [n]))
            with kv_digest_send.scope(manager, session, pool) as scoped:
                s, d, n = kv[3]
                results.append(scoped.submit(kv_digest_send.batch_transfer_sync_around, original,
                                             engine, session, [src + s], [dst + d], [n]).result())
        with kv_digest_send.state_scope(manager, req, None):
            results.append(maybe_send_extra(req, [[0]], None))
        kv_digest_send.send_aux_around(lambda *a, **k: order.append("aux"), manager, req)
    finally:
        mooncake_draft_kv.end_chunk()
        del thread.submit
    assert results == [0] * 6 and failures == [] and submitted == []
    assert (b.dst[:7680] == b.src[:7680]).all() and (b.state_dst[:256] == b.state_src[:256]).all()
    assert (b.state_dst[512:768] == b.state_src[512:768]).all()
    # stock's synchronous call: the short transfer, the executor thread's, the state (short)
    assert [a[2][0] - dst for a in stock_calls[:2]] == [4096, 4608] and len(stock_calls) == 3
    # window 1 digests its own 2048 bytes; window 2 (nothing new queued) runs the state's send
    # dry (no engine call, nothing moved); window 3 digests its 2048 bytes and the captured
    # state's 512 in one call; the status digests the rest in one call (the state: known)
    assert order == ["submit", ("digest", 2048), ("status", 0),
                     "submit", ("status", 0),
                     "submit", ("digest", 2048 + 512), ("status", 0),
                     ("digest", 512 + 2048), "aux"]  # fmt: skip
    assert "the transfer worker digests inside its transfers" in caplog.text
    keys = [buffer_key(BufferKind.KV, 0), buffer_key(BufferKind.KV, 1), buffer_key(BufferKind.STATE, 0)]
    want = digest_blocks_host(Blocks.concat(
        [Blocks.of([src + s], [d], n, 0) for s, d, n in kv]
        + [Blocks.of([state_src + o], [o], 256, 2) for o in (0, 512)]), keys)  # fmt: skip
    assert len(sent) == 1
    assert decode(sent[0]).sums == {(int(BufferKind.KV), 0): int(want[0]),
                                    (int(BufferKind.STATE), 0): int(want[2])}  # fmt: skip


def _deferred_room(loopback, room):
    """The real engine's manager stand-in whose sums are not ready until ``ready`` is set
    (:class:`_GpuLikeSums`), and a room of one decode request (the engine's own session) in
    transfer."""
    import threading

    engine, b = loopback
    b.dst[:] = 0
    ready = threading.Event()
    failures, sent, calls, order = [], [], [], []
    session, regs, manager = _window_manager(engine, b, failures, sent, calls, order, ready=ready)
    req = types.SimpleNamespace(is_dummy=False, mooncake_session_id=session, room=room,
                                required_dst_info_num=1, endpoint="127.0.0.1", dst_port=1)
    manager.transfer_infos = {room: {session: req}}
    manager.request_status[room] = KVPoll.Transferring
    return types.SimpleNamespace(engine=engine, bufs=b, ready=ready, failures=failures, sent=sent,
                                 order=order, session=session, manager=manager, req=req,
                                 src=b.src.ctypes.data, dst=b.dst.ctypes.data)  # fmt: skip


def test_with_windows_the_gpus_sums_are_read_at_the_status_never_waited_for_in_a_window(loopback):
    """Through sglang's real MooncakeTransferEngine over TCP: a room's middle chunk and last
    chunk, each in long transfers whose windows digest what was queued, with sums that (like the
    GPU's) are not ready while the windows run. No window waits for them: the middle chunk's
    are parked for later, and the worker goes on; the status reads every chunk's sums (waiting
    for the GPU) before the room's aux goes out, and the decode rank's sums are every sent
    byte's."""
    import threading

    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv
    from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks, BufferKind, buffer_key
    from sglang_dflash_pp.srt.disaggregation.kv_digest import decode, digest_blocks_host

    r = _deferred_room(loopback, 11)
    manager, session, order, b = r.manager, r.session, r.order, r.bufs
    digest = manager._dflash_kv_digest
    original, stock_calls = _stock_sync()
    chunks = [[(0, 0, 2048), (2048, 2048, 2048)], [(4096, 4096, 2048), (6144, 6144, 2048)]]
    timer = threading.Timer(0.3, lambda: (order.append("ready"), r.ready.set()))
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        mooncake_draft_kv.begin_chunk(manager, types.SimpleNamespace(
            room=11, wait_event=None, is_last_chunk=last))  # fmt: skip
        try:
            with kv_digest_send.scope(manager, session, None):
                for s, d, n in chunk:
                    assert kv_digest_send.batch_transfer_sync_around(
                        original, r.engine, session, [r.src + s], [r.dst + d], [n]) == 0
            if last:
                assert not [e for e in order if e[0] == "read"]  # no window waited
                timer.start()
                kv_digest_send.send_aux_around(lambda *a, **k: order.append("aux"), manager, r.req)
        finally:
            mooncake_draft_kv.end_chunk()
        if not last:
            assert len(digest._parked) == 1 and digest._parked[0].unsettled
    timer.join()
    assert r.failures == [] and stock_calls == [] and (b.dst[:8192] == b.src[:8192]).all()
    assert order.index("ready") < order.index("aux")
    reads = [e for e in order if isinstance(e, tuple) and e[0] == "read"]
    assert sorted(reads) == [("read", 2048)] * 4 and order[-1] == "aux"
    assert max(order.index(x) for x in reads) < order.index("aux")
    assert digest._parked == [] and digest._sums == {}
    keys = [buffer_key(BufferKind.KV, 0), buffer_key(BufferKind.KV, 1), buffer_key(BufferKind.STATE, 0)]
    want = digest_blocks_host(Blocks.of([r.src], [0], 8192, 0), keys)
    assert len(r.sent) == 1 and decode(r.sent[0]).sums == {(int(BufferKind.KV), 0): int(want[0])}


def test_with_windows_a_failed_rooms_parked_sums_are_dropped_not_added_later(loopback):
    """A room's middle chunk is parked with its sums still on the GPU; the room then fails
    (sglang marks it Failed) and its next chunk's begin drops what the room had: its parked
    sums too, so reading them later adds nothing (no sums kept for a room that will never send
    its status), while another room's parked sums still are added."""
    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv

    r = _deferred_room(loopback, 22)
    manager, session = r.manager, r.session
    digest = manager._dflash_kv_digest
    original, _ = _stock_sync()
    for room, at in ((21, 0), (22, 4096)):
        manager.request_status[room] = KVPoll.Transferring
        mooncake_draft_kv.begin_chunk(manager, types.SimpleNamespace(
            room=room, wait_event=None, is_last_chunk=False))  # fmt: skip
        try:
            with kv_digest_send.scope(manager, session, None):
                assert kv_digest_send.batch_transfer_sync_around(
                    original, r.engine, session, [r.src + at], [r.dst + at], [2048]) == 0
        finally:
            mooncake_draft_kv.end_chunk()
    assert len(digest._parked) == 2 and digest._sums == {}
    manager.request_status[21] = KVPoll.Failed
    mooncake_draft_kv.begin_chunk(manager, types.SimpleNamespace(room=21, wait_event=None,
                                                                 is_last_chunk=True))  # fmt: skip
    mooncake_draft_kv.end_chunk()
    assert digest.thread.wait(10)  # forget_room ran (a job, after the room's earlier ones)
    r.ready.set()
    digest.settle_parked(block=True)
    assert r.failures == [] and digest._parked == []
    assert list(digest._sums) == [(22, session)]


def test_with_windows_a_digest_the_kernel_refuses_fails_its_room_when_its_sums_are_read(loopback):
    """A window's engine call that the kernel refuses (here: a descriptor of 2050 bytes, not whole
    4-byte words; the host engine raises the kernel's refusal at the result as the GPU's does,
    and here its sums are not ready while the window runs) fails its room with the reason when
    its sums are read, before the room's status; the transfer itself completes, and stock's
    send goes on."""
    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv

    r = _deferred_room(loopback, 12)
    manager, session, b = r.manager, r.session, r.bufs
    original, _ = _stock_sync()
    mooncake_draft_kv.begin_chunk(manager, types.SimpleNamespace(room=12, wait_event=None,
                                                                 is_last_chunk=True))  # fmt: skip
    try:
        with kv_digest_send.scope(manager, session, None):
            ret = kv_digest_send.batch_transfer_sync_around(original, r.engine, session, [r.src],
                                                            [r.dst], [2050])  # fmt: skip
        assert ret == 0 and r.failures == []  # submitted; its sums not read yet
        r.ready.set()
        kv_digest_send.send_aux_around(lambda *a, **k: r.order.append("aux"), manager, r.req)
    finally:
        mooncake_draft_kv.end_chunk()
    assert (b.dst[:2050] == b.src[:2050]).all()
    assert [f["bootstrap_room"] for f in r.failures] == [12]
    assert "4-byte words" in r.failures[0]["failure_reason"] and r.order[-1] == "aux"


@pytest.mark.parametrize("case", ["transfer fails", "submit fails", "digest raises"])
def test_a_transfer_with_the_digest_in_its_window_fails_as_stocks_would(loopback, case):
    """A window transfer whose descriptor Mooncake rejects returns what stock's synchronous call
    returns for the same descriptors (sglang fails the room as it would); one Mooncake would not
    take goes through stock's call; a digest that raises in the window fails the room with its
    reason, and the transfer still completes."""
    import numpy as np

    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv

    engine, b = loopback
    b.dst[:] = 0
    failures, sent, calls, order = [], [], [], []
    session, regs, manager = _window_manager(engine, b, failures, sent, calls, order)
    src, dst, bad = b.src.ctypes.data, b.dst.ctypes.data, b.unregistered.ctypes.data
    original, stock_calls = _stock_sync()
    lists = ([src], [bad if case == "transfer fails" else dst], [2048])
    if case == "submit fails":
        engine.engine.submit_result = 0
    if case == "digest raises":
        manager._dflash_kv_digest.engine.submit = lambda *a, **k: (_ for _ in ()).throw(
            RuntimeError("the digest kernel failed"))
    manager.request_status[9] = KVPoll.Transferring
    mooncake_draft_kv.begin_chunk(manager, types.SimpleNamespace(room=9, wait_event=None,
                                                                 is_last_chunk=False))  # fmt: skip
    try:
        with kv_digest_send.scope(manager, session, None):
            ret = kv_digest_send.batch_transfer_sync_around(original, engine, session, *lists)
    finally:
        mooncake_draft_kv.end_chunk()
        engine.engine.submit_result = None
    if case == "transfer fails":
        assert ret < 0 and ret == original(engine, session, *lists)
        assert order[0] == "submit" and order[-1] == ("status", ret) and failures == []
    elif case == "submit fails":
        assert ret == 0 and len(stock_calls) == 1 and order == ["submit"]
        assert (b.dst[:2048] == b.src[:2048]).all() and failures == []
    else:
        assert ret == 0 and stock_calls == [] and (b.dst[:2048] == b.src[:2048]).all()
        assert [f["bootstrap_room"] for f in failures] == [9]
        assert "the digest kernel failed" in failures[0]["failure_reason"]


def test_an_engine_without_the_async_api_keeps_the_digest_thread():
    """``start_send_digest``'s choice: the worker digests in its transfers only where the
    Mooncake engine has both asynchronous batch calls."""
    full = types.SimpleNamespace(batch_transfer_async_write=lambda *a: 1,
                                 get_batch_transfer_status=lambda ids: 0)  # fmt: skip
    half = types.SimpleNamespace(batch_transfer_async_write=lambda *a: 1)
    assert kv_digest_send.transfer_windows(types.SimpleNamespace(engine=full))
    assert not kv_digest_send.transfer_windows(types.SimpleNamespace(engine=half))
    assert not kv_digest_send.transfer_windows(object())
