"""A PP prefill stage's forward event reaches the KV senders of the batch's requests,
and the next send of each hands it to the transfer worker as the chunk's wait_event."""

import unittest
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch

from sglang.srt.disaggregation.common.conn import CommonKVSender
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_pp_mixin import SchedulerPPMixin
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")


class _RecordingManager:
    """The KV manager calls `send` makes, recorded (no transfer engine)."""

    kv_shard_size = 1
    enable_all_cp_ranks_for_transfer = False
    is_dummy_cp_rank = False

    def __init__(self):
        self.requests = []

    def prepare_send_state_indices(self, state_indices):
        return state_indices

    def add_transfer_request(self, room, kv_indices, index_slice, is_last, **kwargs):
        self.requests.append(kwargs)


def _sender() -> CommonKVSender:
    # __init__ bootstraps against a decode; these are the fields send() reads.
    sender = object.__new__(CommonKVSender)
    sender.kv_mgr = _RecordingManager()
    sender.bootstrap_room = 7
    sender.aux_index = 0
    sender.conclude_state = None
    sender.curr_idx = 0
    sender.num_kv_indices = 8
    sender._transfer_start_time = None
    sender._transfer_num_kv_indices = 0
    sender._transfer_num_state_indices = 0
    sender._early_send_wait_event = None
    sender.kv_written_event = None
    sender.trace_ctx = SimpleNamespace(copy_for_thread=lambda: None)
    return sender


def _req(sender) -> Req:
    req = Req(
        rid="r0",
        origin_input_text="",
        origin_input_ids=list(range(16)),
        sampling_params=SamplingParams(),
    )
    req.disagg_kv_sender = sender
    return req


def _launch(scheduler_reqs):
    """The real `_pp_launch_batch` of a non-last stage, its forward a stand-in."""
    batch = object.__new__(ScheduleBatch)
    batch.reqs = scheduler_reqs
    batch.spec_algorithm = SpeculativeAlgorithm.NONE
    scheduler = object.__new__(Scheduler)
    scheduler.forward_stream_ctx = nullcontext()
    scheduler.device_module = torch.cpu
    scheduler.pp_group = SimpleNamespace(is_last_rank=False)
    scheduler._pp_wait_forward_dependencies = lambda: None
    scheduler.run_batch = lambda batch, proxy: SimpleNamespace(
        can_run_cuda_graph=False, spec_verify_out_cache_loc=None, fpm_timing=None
    )
    metadata = [None]
    _, event = SchedulerPPMixin._pp_launch_batch(
        scheduler, 0, batch, None, metadata, None
    )
    return event


class TestKVWrittenEvent(unittest.TestCase):
    def test_forward_event_becomes_the_chunks_wait_event(self):
        sender = _sender()
        event = _launch([_req(sender)])
        self.assertIs(sender.kv_written_event, event)
        sender.send(np.arange(4, dtype=np.int32))
        self.assertIs(sender.kv_mgr.requests[-1]["wait_event"], event)

    def test_without_a_pp_forward_nothing_waits(self):
        sender = _sender()
        sender.send(np.arange(4, dtype=np.int32))
        self.assertIsNone(sender.kv_mgr.requests[-1]["wait_event"])

    def test_early_send_event_keeps_precedence(self):
        sender = _sender()
        sender.kv_written_event = object()
        early = object()
        sender._early_send_wait_event = early
        sender.send(np.arange(4, dtype=np.int32))
        self.assertIs(sender.kv_mgr.requests[-1]["wait_event"], early)


if __name__ == "__main__":
    unittest.main()
