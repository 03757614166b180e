"""Stock 0.5.23: ``SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM=1`` breaks a speculative PP prefill (PD).

With the variable set, a PP rank skips the output relay of a "pure" middle prefill chunk
(``managers/scheduler_pp_mixin.py:48-57``, ``_pp_can_skip_output_comm``: EXTEND, one request,
not the last chunk, no logprobs) and synthesises the result locally
(``_pp_make_skip_output_result``, ``scheduler_pp_mixin.py:946-967``). That result carries no
``next_draft_input``. The non-skipped path rebinds ``batch.spec_info`` to the relayed draft input
(``_pp_prep_batch_result``, ``scheduler_pp_mixin.py:1059-1084``, DSPARK there); the skipped one
leaves ``batch.spec_info`` holding the draft input the forward set (``scheduler.py:4752``). The PD
prefill result processor then asserts ``batch.spec_info is result.next_draft_input``
(``disaggregation/prefill.py:939``) and the scheduler dies on the first long prompt.
Stock accepts this configuration with DSPARK (PP + spec is EAGLE or DSPARK in 0.5.23);
sglang-dflash-pp's DFLASH PP prefill uses the same ``DFlashDraftInputV2``.

What runs: the real ``_pp_can_skip_output_comm``, ``SchedulerPPMixin._pp_make_skip_output_result``
and ``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill`` on a ``Scheduler``
built with ``object.__new__`` (device, device module, result processor class), a real
``ScheduleBatch`` shell holding one real ``Req`` and a real ``DFlashDraftInputV2`` from DSPARK's
``make_next_draft_input``.

Run: ``python repro.py`` (stock sglang 0.5.23; no plugin is loaded, see ../stock_sglang.py).
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stock_sglang  # noqa: E402

stock_sglang.stock_only()
os.environ["SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM"] = "1"

import torch  # noqa: E402

MIXIN = "sglang.srt.managers.scheduler_pp_mixin"
TARGETS = [
    f"{MIXIN}._pp_can_skip_output_comm",
    f"{MIXIN}.SchedulerPPMixin._pp_make_skip_output_result",
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
    ".process_batch_result_disagg_prefill",
]


def middle_chunk_batch():
    """A DSPARK prefill batch of one request whose prompt has more chunks to come."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.dspark_components.dspark_draft import make_next_draft_input
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    req = Req(rid="r0", origin_input_text="", origin_input_ids=list(range(32)),
              sampling_params=SamplingParams())
    batch = object.__new__(ScheduleBatch)
    batch.reqs = [req]
    batch.forward_mode = ForwardMode.EXTEND
    batch.contains_last_prefill_chunk = False
    batch.return_logprob = False
    batch.spec_algorithm = SpeculativeAlgorithm.DSPARK
    # What the forward bound (scheduler.py:4752) and the PP relay rebuilds (pp_mixin:1076-1084).
    batch.spec_info = make_next_draft_input(
        bonus_tokens=torch.tensor([7]), new_seq_lens=torch.tensor([16])
    )
    return batch


def scheduler_shell():
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    s = object.__new__(Scheduler)
    s.device, s.device_module = "cpu", torch.cpu
    s.batch_result_processor = SchedulerBatchResultProcessor  # only a classmethod runs before line 939
    return s


def pd_prefill_outcome(scheduler, batch, result) -> str:
    """Whether ``process_batch_result_disagg_prefill`` gets past its draft-input assertion."""
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    try:
        SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill(
            scheduler, batch, result
        )
    except AssertionError as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{frame.filename.split('site-packages/sglang/')[-1]}:{frame.lineno}"
        return f"AssertionError at {where}: {frame.line}"
    except Exception:
        pass  # past the assertion, into what the shell does not carry
    return "passes the draft-input assertion"


def main() -> None:
    from sglang.srt.managers import scheduler_pp_mixin

    mode = stock_sglang.begin(TARGETS)
    batch = middle_chunk_batch()
    scheduler = scheduler_shell()
    skipped = scheduler_pp_mixin._pp_can_skip_output_comm(batch)
    _, result, _ = scheduler_pp_mixin.SchedulerPPMixin._pp_make_skip_output_result(
        scheduler, batch, None
    )
    # Control: the same result carrying the batch's draft input gets past line 939 (the shell is
    # enough to reach it), which is also the in-tree fix's behaviour.
    _, carried, _ = scheduler_pp_mixin.SchedulerPPMixin._pp_make_skip_output_result(
        scheduler, batch, None
    )
    carried.next_draft_input = batch.spec_info
    observed = {
        "control_result_carrying_batch_spec_info": pd_prefill_outcome(scheduler, batch, carried),
        "middle_chunk_output_comm_skipped": skipped,
        "skip_result_next_draft_input": type(result.next_draft_input).__name__,
        "pd_prefill_result": pd_prefill_outcome(scheduler, batch, result),
    }
    expected = {
        "control_result_carrying_batch_spec_info": "passes the draft-input assertion",
        "middle_chunk_output_comm_skipped": True,
        "skip_result_next_draft_input": type(batch.spec_info).__name__,
        "pd_prefill_result": "passes the draft-input assertion",
    }
    print(f"batch.spec_info: {type(batch.spec_info).__name__}")
    stock_sglang.compare(
        mode, TARGETS, "pp-skip-output-comm-speculative", observed, expected,
    )


if __name__ == "__main__":
    main()
