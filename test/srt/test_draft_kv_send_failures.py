"""A local failure in the draft-KV send fails one request, never the decode; transport failures
keep sglang's rules; a refused decode fails its requests at bootstrap.

Through sglang 0.5.23's real, hooked ``MooncakeKVManager`` methods on the manager shell of
test_draft_kv_mooncake.py (prefill TP4 rank 1 -> decode TP32 ranks 8 and 12, the packed regime;
``conclude_failure`` recorded). What stock does with a send's return code is its own code
(``transfer_worker``: a non-zero return blacklists the session in ``failed_sessions``), so the
property checked is the session's state after the worker loop, next to the room's verdict.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_draft_kv_mooncake as harness  # noqa: E402
from test_draft_kv_mooncake import pools  # noqa: E402,F401  (fixture)

DECODE_RANKS = (8, 12)


def registered(pools, **kw):
    m, _ = harness.setup_prefill(pools, 4, 1, **kw)
    return m, harness.register_decode_ranks(m, DECODE_RANKS)


def draft_writes(m, session):
    return [
        b for s, blocks, _ in m._transfer_data.calls if s == session
        for b in blocks if b[1] < harness.TARGET_BASE
    ]  # fmt: skip


def assert_room_served(m, regs, room, src, dst):
    for reg in regs:
        writes = [
            w for s, blocks, snaps in m._transfer_data.calls if s == reg.mooncake_session_id
            for w in zip(blocks, snaps)
        ]  # fmt: skip
        images = harness.decode_images_from(writes, reg, 32)
        harness.assert_decode_holds_its_heads(images, 32, reg.dst_tp_rank, src, dst)


def test_a_pack_that_raises_fails_that_room_and_the_decode_stays_healthy(pools, monkeypatch):
    from sglang_dflash_pp.srt.disaggregation import draft_kv_chunk_packs

    m, regs = registered(pools)
    real = draft_kv_chunk_packs.pack_slices
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(draft_kv_chunk_packs, "pack_slices", failing_once)
    src, dst = harness.SRC_PAGES, harness.DST_PAGES
    harness.run_rooms(m, regs, {7: (src, dst)})
    ((room, reason),) = m.failures
    assert room == 7 and "CUDA out of memory (injected)" in reason and "d:8" in reason
    assert "prefill rank 1" in reason
    assert m.failed_sessions == set() and dict(m.session_failures) == {}
    assert all(draft_writes(m, reg.mooncake_session_id) == [] for reg in regs)  # the room's
    # other decode rank was not sent to: the room had failed
    assert harness.staging_of(m).buffer.free_slots() == len(m.transfer_queues)

    # The next request to the same decode is served, every byte in place.
    m.failures.clear()
    m._transfer_data.calls.clear()
    harness.run_rooms(m, regs, {8: (src, dst)})
    assert m.failures == [] and m.failed_sessions == set()
    assert_room_served(m, regs, 8, src, dst)


def test_a_page_id_outside_the_pool_fails_that_room_only(pools):
    """A bad page id would fault the pack kernel (sticky: the stage dies): refused on the host."""
    m, regs = registered(pools)
    harness.run_rooms(m, regs, {7: ([5, 6, 99], [2, 3, 4])})
    ((room, reason),) = m.failures
    assert room == 7 and "outside the pool" in reason
    assert m.failed_sessions == set()


def test_a_transport_failure_keeps_stock_behaviour_and_quarantines_the_slot(pools):
    m, regs = registered(pools)
    recorder = m._transfer_data

    def refuse_draft(session, blocks):
        recorder(session, blocks)
        return -1 if any(d < harness.TARGET_BASE for _, d, _ in blocks) else 0

    m._transfer_data = refuse_draft
    buf = harness.staging_of(m).buffer
    harness.run_rooms(m, regs, {7: (harness.SRC_PAGES, harness.DST_PAGES)})
    # sglang's own reaction to a failed transfer: the session is taken for dead, the room fails.
    assert m.failed_sessions == {"d:8"}
    assert [room for room, _ in m.failures] == [7] and "Failed to send kv chunk" in m.failures[0][1]
    # The engine may still be reading the slot: it is out of use, the others are not.
    assert buf.free_slots() == len(m.transfer_queues) - 1


def test_a_verdict_that_could_not_be_decided_is_not_cached_as_a_refusal(pools, monkeypatch):
    """A failure of our own check at registration (here an injected bug) must not refuse the
    decode until it restarts: the registration is accepted with the verdict pending, decided at
    the next send (then exact bytes); a check that fails again fails only that request."""
    from sglang_dflash_pp.srt.disaggregation import draft_kv_registration

    real = draft_kv_registration.peer_verdict
    broken = {"on": True}

    def flaky(*args, **kwargs):
        if broken["on"]:
            raise RuntimeError("a bug in the verdict (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(draft_kv_registration, "peer_verdict", flaky)
    m, regs = registered(pools)  # accepted, the verdicts pending
    assert m.state_layout_rejections == {}

    src, dst = harness.SRC_PAGES, harness.DST_PAGES
    harness.run_rooms(m, regs, {7: (src, dst)})  # still broken: that request fails
    ((room, reason),) = m.failures
    assert room == 7 and "failed again" in reason and "injected" in reason
    assert m.failed_sessions == set() and m.state_layout_rejections == {}

    broken["on"] = False
    m.failures.clear()
    m._transfer_data.calls.clear()
    harness.run_rooms(m, regs, {8: (src, dst)})  # decided now: served exactly
    assert m.failures == []
    assert_room_served(m, regs, 8, src, dst)


def test_a_refused_decode_fails_its_requests_at_bootstrap(pools):
    """Only the last PP stage holds the draft and can refuse a decode; the room fails when its
    bootstrap completes, so the PP bootstrap poll (reduced over the stages) stops every stage
    before stage 0 prefills it."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    m, _ = harness.setup_prefill(pools, 4, 1)
    bad = harness.decode_registration("d:bad", tp_size=32, tp_rank=12, item_lens=[])
    reason = m._publish_peer_registration("d:bad", bad)
    assert reason is not None
    good = harness.decode_registration("d:good", tp_size=32, tp_rank=12)
    assert m._publish_peer_registration("d:good", good) is None
    for room, session in ((1, "d:bad"), (2, "d:good")):
        m.request_status[room] = KVPoll.Bootstrapping
        m.transfer_infos[room] = {session: object()}
        MooncakeKVManager.update_status(m, room, KVPoll.WaitingForInput)
    assert m.request_status == {1: KVPoll.Failed, 2: KVPoll.WaitingForInput}
    assert m.failures == [(1, reason)]


def test_bootstrap_status_is_stock_without_a_dflash_draft(pools):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    pool = pools(4, 1)
    kv_args = harness.prefill_kv_args(pool, tp_rank=1, with_draft=False)
    m = harness.prefill_manager(kv_args, tp_size=4, tp_rank=1)
    m.state_layout_rejections["d:x"] = "a stock state layout mismatch"
    m.request_status[1] = KVPoll.Bootstrapping
    m.transfer_infos[1] = {"d:x": object()}
    MooncakeKVManager.update_status(m, 1, KVPoll.WaitingForInput)
    assert m.request_status[1] == KVPoll.WaitingForInput and m.failures == []


def test_the_pack_buffer_follows_the_managers_registrations(pools):
    """Registered with sglang's own buffers at the manager's start, deregistered with them
    (``teardown``, ``release_memory_occupation``), registered again on resume."""
    m, _ = harness.setup_prefill(pools, 4, 1)
    buf = harness.staging_of(m).buffer
    region = (buf.ptr, buf.nbytes)
    assert m.engine.registered.count(region) == 1
    m.register_buffer_to_engine()  # sglang registers its buffers again: ours stays registered once
    assert m.engine.registered.count(region) == 1
    m.deregister_buffer_to_engine()
    assert region not in m.engine.registered
    m.register_buffer_to_engine()
    assert m.engine.registered.count(region) == 1
