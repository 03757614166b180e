"""The result a PP stage synthesises for a skipped output relay keeps the batch's draft
input, which the PD prefill's result processing asserts it was given."""

import unittest

import torch

from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components.batch_result_processor import (
    SchedulerBatchResultProcessor,
)
from sglang.srt.managers.scheduler_pp_mixin import SchedulerPPMixin
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.dspark_components.dspark_draft import make_next_draft_input
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")


def _middle_chunk_batch(spec_info) -> ScheduleBatch:
    # The fields the skip path and the assertion read; a real batch needs a scheduler.
    req = Req(
        rid="r0",
        origin_input_text="",
        origin_input_ids=list(range(32)),
        sampling_params=SamplingParams(),
    )
    batch = object.__new__(ScheduleBatch)
    batch.reqs = [req]
    batch.forward_mode = ForwardMode.EXTEND
    batch.contains_last_prefill_chunk = False
    batch.return_logprob = False
    batch.spec_algorithm = SpeculativeAlgorithm.DSPARK
    batch.spec_info = spec_info
    return batch


def _scheduler() -> Scheduler:
    scheduler = object.__new__(Scheduler)
    scheduler.device, scheduler.device_module = "cpu", torch.cpu
    scheduler.batch_result_processor = SchedulerBatchResultProcessor
    return scheduler


class TestSkipOutputResult(unittest.TestCase):
    def test_result_carries_the_batch_draft_input(self):
        draft_input = make_next_draft_input(
            bonus_tokens=torch.tensor([7]), new_seq_lens=torch.tensor([16])
        )
        batch = _middle_chunk_batch(draft_input)
        scheduler = _scheduler()
        _, result, _ = SchedulerPPMixin._pp_make_skip_output_result(
            scheduler, batch, None
        )
        self.assertIs(result.next_draft_input, draft_input)
        try:
            SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill(
                scheduler, batch, result
            )
        except AssertionError as e:
            self.fail(f"the PD prefill refused the synthesised result: {e!r}")
        except Exception:
            pass  # past the assertion, into state this shell does not carry

    def test_non_speculative_batch_carries_none(self):
        batch = _middle_chunk_batch(None)
        _, result, _ = SchedulerPPMixin._pp_make_skip_output_result(
            _scheduler(), batch, None
        )
        self.assertIsNone(result.next_draft_input)


if __name__ == "__main__":
    unittest.main()
