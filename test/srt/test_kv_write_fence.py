"""The fence between a PP stage's forward and the transfer that reads its KV (``kv_write_fence``),
on sglang 0.5.23's real ``MooncakeKVSender.send`` and ``MooncakeKVManager.transfer_worker``.

The CUDA event itself cannot exist on this machine: events here are stand-ins that record when
they are synchronised. What is checked is the plumbing the H200 run
(``benchmark/gpu/results/send_path_gpu.json``, race case) relies on: the event the worker attaches
to a request's sender becomes every later chunk's ``wait_event``, stock's own early-send event is
kept, sglang's worker synchronises it before the chunk's first send, and the send path sees it
for the pack's side stream.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_draft_kv_mooncake as harness  # noqa: E402
from test_draft_kv_mooncake import pools  # noqa: E402,F401  (fixture)

from sglang_dflash_pp.srt.disaggregation import kv_write_fence  # noqa: E402


class Event:
    """Stand-in for a torch.cuda.Event: records when it is synchronised."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(("synchronize", self.name))


def sender_shell(queued):
    """A ``MooncakeKVSender`` with what ``CommonKVSender.send`` reads; its manager records the
    chunk it would queue."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    s = object.__new__(MooncakeKVSender)
    s.conclude_state = None
    s.bootstrap_room = 7
    s.aux_index = 0
    s._early_send_wait_event = None
    s._transfer_start_time = None
    s.trace_ctx = SimpleNamespace(
        copy_for_thread=lambda: None,
        trace_slice_start=lambda *a, **k: None,
        trace_slice_end=lambda *a, **k: None,
    )
    s._prepare_send_indices = lambda kv, st: (kv, slice(0, len(kv)), False, False)
    s._record_transfer_indices = lambda *a: None
    s.kv_mgr = SimpleNamespace(
        prepare_send_state_indices=lambda st: st,
        add_transfer_request=lambda room, kv, sl, last, **kw: queued.append(kw["wait_event"]),
    )
    return s


def test_record_kv_written_is_a_no_op_without_streams():
    req = SimpleNamespace(disagg_kv_sender=SimpleNamespace())
    assert kv_write_fence.record_kv_written([req], "cpu") is None
    assert not hasattr(req.disagg_kv_sender, kv_write_fence.WRITTEN_ATTR)


def test_record_kv_written_attaches_one_event_to_every_request(monkeypatch):
    """On CUDA: one event, recorded on the current stream, on every request's sender."""
    recorded = []

    class FakeEvent:
        def record(self, stream):
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "forward-stream")
    reqs = [SimpleNamespace(disagg_kv_sender=SimpleNamespace()) for _ in range(3)]
    reqs.append(SimpleNamespace())  # a request without a sender (not PD) is left alone
    event = kv_write_fence.record_kv_written(reqs, "cuda:0")
    assert recorded == ["forward-stream"]
    assert [getattr(r.disagg_kv_sender, kv_write_fence.WRITTEN_ATTR) for r in reqs[:3]] == [event] * 3


def test_every_send_of_a_request_carries_its_latest_kv_written_event(sglang_with_plugin):
    queued, log = [], []
    sender = sender_shell(queued)
    kv = np.arange(4, dtype=np.int32)
    sender.send(kv)  # no DFLASH PP worker recorded anything: stock, no wait
    first = Event(log, "forward of chunk 1")
    setattr(sender, kv_write_fence.WRITTEN_ATTR, first)
    sender.send(kv)  # a middle chunk
    second = Event(log, "forward of chunk 2")
    setattr(sender, kv_write_fence.WRITTEN_ATTR, second)
    sender.send(kv)
    sender.send(kv)  # a second segment of the same chunk: the same forward
    assert queued == [None, first, second, second]


def test_stock_early_send_event_is_kept_and_both_are_waited_on(sglang_with_plugin):
    queued, log = [], []
    sender = sender_shell(queued)
    sender._early_send_wait_event = Event(log, "early")
    setattr(sender, kv_write_fence.WRITTEN_ATTR, Event(log, "written"))
    sender.send(np.arange(2, dtype=np.int32))
    (wait,) = queued
    wait.synchronize()
    assert log == [("synchronize", "early"), ("synchronize", "written")]
    assert [e.name for e in kv_write_fence.cuda_event_of(wait)] == ["early", "written"]


def test_the_transfer_worker_waits_before_the_first_send_and_the_pack_sees_the_event(
    pools, monkeypatch
):
    """Through sglang's real worker loop: the chunk's wait_event is synchronised before the
    chunk's first send, and the send path has it (for the pack's side stream) although sglang
    drops it from the chunk."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.utils import FastQueue, TransferKVChunk
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, TransferInfo

    from sglang_dflash_pp.srt.disaggregation import draft_kv_chunk_packs

    m, _ = harness.setup_prefill(pools, 4, 1)
    regs = [harness.decode_registration(f"d:{r}", tp_size=32, tp_rank=r) for r in (8, 12)]
    for reg in regs:
        reg.dst_kv_ptrs = [p + reg.dst_tp_rank * 50_000_000 for p in reg.dst_kv_ptrs]
        assert m._publish_peer_registration(reg.mooncake_session_id, reg) is None
    harness.with_pack_regions(m)
    log = []
    real_transfer, real_pack = m._transfer_data, draft_kv_chunk_packs.pack_slices
    m._transfer_data = lambda s, b: log.append(("transfer", s)) or real_transfer(s, b)

    def pack(slot, at, slices, prepared, rows, written=()):
        log.append(("pack after", tuple(e.name for e in written)))
        return real_pack(slot, at, slices, prepared, rows, written)

    monkeypatch.setattr(draft_kv_chunk_packs, "pack_slices", pack)
    room, src, dst = 9, harness.SRC_PAGES, harness.DST_PAGES
    m.request_status[room] = KVPoll.WaitingForInput
    m.transfer_infos[room] = {
        reg.mooncake_session_id: TransferInfo(
            room=room, endpoint="127.0.0.1", dst_port=1, mooncake_session_id=reg.mooncake_session_id,
            dst_kv_indices=np.asarray(dst, np.int32), dst_aux_index=0, dst_state_indices=[],
            required_dst_info_num=2, is_dummy=False, dst_device_kv_indices=None,
        )  # fmt: skip
        for reg in regs
    }
    queue = FastQueue()
    queue.put(TransferKVChunk(
        room=room, prefill_kv_indices=np.asarray(src, np.int32), index_slice=slice(0, len(src)),
        is_last_chunk=False, prefill_aux_index=None, state_indices=None,
        wait_event=Event(log, "forward"),
    ))  # fmt: skip
    queue.put(None)
    MooncakeKVManager.transfer_worker(m, queue, None)
    assert log[0] == ("synchronize", "forward")  # before the target's and the draft's sends
    assert [e for e in log if e[0] == "pack after"] == [("pack after", ("forward",))]
    assert [e for e in log if e[0] == "transfer"] and m.failures == []
