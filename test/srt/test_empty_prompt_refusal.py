"""A DFLASH PP prefill refuses a 0-token prompt at admission, and only a DFLASH PP prefill does.

The real ``Scheduler.handle_generate_request`` runs on a ``Scheduler`` built with
``object.__new__`` carrying the fields its admission path reads, with a real
``TokenizedGenerateReqInput`` and the real ``PrefillBootstrapQueue.add`` (its intake refusal,
``is_unadmitted_reject`` -> ``retire_unadmitted_request``). Stand-ins are limited to what runs
after the checks and is not under test: the grammar queue, the tree cache's ``finish``, the KV
budget, the output streamer (it records what the client would be sent) and the bootstrap queue's
``create_sender`` (it records a request that would be bootstrapped). The role comes from the
published runtime context, as in a server process.
"""

from __future__ import annotations

from array import array
from http import HTTPStatus
from types import SimpleNamespace

import pytest

from sglang_dflash_pp import hooks
from sglang_dflash_pp.srt.managers import empty_prompt_refusal
from sglang_dflash_pp.srt.managers.empty_prompt_refusal import EMPTY_PROMPT_ERROR

PP_PREFILL = dict(speculative_algorithm="DFLASH", disaggregation_mode="prefill", pp_size=2)


class Recorder:
    def __init__(self):
        self.streamed, self.senders, self.cache_outcomes = [], [], []


def scheduler_shell(*, disaggregation_mode: str, algorithm: str, recorder: Recorder):
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    s = object.__new__(Scheduler)
    s.enable_session_radix_cache = False
    s.model_config = SimpleNamespace(hf_eos_token_id=None, vocab_size=512, num_key_value_heads=2)
    s.disaggregation_mode = {"prefill": DisaggregationMode.PREFILL,
                             "null": DisaggregationMode.NULL}[disaggregation_mode]  # fmt: skip
    s.transfer_backend = TransferBackend.MOONCAKE
    s.metrics_reporter = SimpleNamespace(enable_metrics=False)
    s.kv_events_publisher = SimpleNamespace(enable_kv_cache_events=False)
    s.dllm_config = s.tokenizer = None
    s.spec_algorithm = SpeculativeAlgorithm.from_string(algorithm)
    s.enable_overlap = False
    s.max_new_tokens_limit = None
    s.max_req_len = s.max_total_num_tokens = 4096
    s.max_req_input_len = 4095
    s.kv_shard_widening, s.page_size, s.sliding_window_size, s.chunked_prefill_size = 1, 1, None, 64
    s.enable_priority_scheduling = s.abort_on_priority_when_disabled = False
    s.enable_hicache_storage = s.enable_lmcache = False
    s.max_queued_requests, s.processed_tokens_counter, s.waiting_queue = None, 0, []
    s.token_to_kv_pool_allocator = SimpleNamespace(max_new_tokens_for_memory=lambda n, m, **k: m)
    s.tree_cache = SimpleNamespace(
        cache_controller=None, finish=lambda handle, outcome: recorder.cache_outcomes.append(outcome)
    )
    s.grammar_manager = SimpleNamespace(process_req_with_grammar=lambda req: False)
    s.beam_coordinator = SimpleNamespace(retire_group=lambda req: None)
    s.output_streamer = SimpleNamespace(
        stream_output=lambda reqs, *a, **k: recorder.streamed.extend(reqs)
    )
    queue = object.__new__(PrefillBootstrapQueue)
    queue.scheduler, queue.queue = s, []
    queue.create_sender = lambda req, num_kv_heads: recorder.senders.append(req) or True
    s.disagg_prefill_bootstrap_queue = queue
    return s


def generate_request(num_tokens: int, rid: str = "r0", **fields):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    return TokenizedGenerateReqInput(
        input_text="", input_ids=array("q", range(num_tokens)), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=4),
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None,
        stream=False, rid=rid, bootstrap_host="127.0.0.1", bootstrap_port=8998,
        bootstrap_room=7, **fields,
    )  # fmt: skip


def admit(recv, *, speculative_algorithm="DFLASH", disaggregation_mode="prefill", pp_size=2,
          pp_rank=0):
    """Run the real admission of ``recv`` on a scheduler of that configuration."""
    from sglang.srt.runtime_context import get_context, get_parallel

    recorder = Recorder()
    s = scheduler_shell(disaggregation_mode=disaggregation_mode,
                        algorithm=speculative_algorithm, recorder=recorder)  # fmt: skip
    override = get_context().override_server_args(
        speculative_algorithm=None if speculative_algorithm == "NONE" else speculative_algorithm,
        disaggregation_mode=disaggregation_mode,
    )
    override.install()
    try:
        # A PP group of that size, as a server has one (other modules may have built real
        # world-size-1 groups in this process; the topology check compares against them).
        group = SimpleNamespace(world_size=pp_size, rank_in_group=pp_rank,
                                is_first_rank=pp_rank == 0, is_last_rank=pp_rank == pp_size - 1)
        with get_parallel().override(pp_size=pp_size, pp_rank=pp_rank, tp_rank=0, pp_group=group):
            s.handle_generate_request(recv)
    finally:
        override.restore()
    return s, recorder


def test_the_hook_is_registered_and_applied_on_the_scheduler_binding(sglang_with_plugin):
    from sglang.srt.managers import scheduler

    (hook,) = empty_prompt_refusal.HOOKS
    assert hook in hooks.registered_hooks() and hooks.is_applied(hook)
    assert hook.hook_type == "after"
    assert scheduler.validate_dflash_request.__wrapped__ is not scheduler.validate_dflash_request


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_every_pp_stage_refuses_an_empty_prompt_before_anything_is_held(sglang_with_plugin,
                                                                        pp_rank):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

    s, rec = admit(generate_request(0), **PP_PREFILL, pp_rank=pp_rank)
    assert rec.senders == [] and s.disagg_prefill_bootstrap_queue.queue == []
    assert s.waiting_queue == []
    (req,) = rec.streamed  # what the client is sent: the refusal, once
    assert isinstance(req.finished_reason, FINISH_ABORT)
    assert req.finished_reason.to_json() == {
        "type": "abort", "message": EMPTY_PROMPT_ERROR,
        "status_code": HTTPStatus.BAD_REQUEST, "err_type": "BadRequestError",
    }  # fmt: skip
    assert not req.kv.holds_kv and req.metadata_buffer_index == -1
    assert rec.cache_outcomes == [CacheRequestOutcome.ABORT]


def test_a_prompt_with_tokens_is_admitted_on_a_dflash_pp_prefill(sglang_with_plugin):
    s, rec = admit(generate_request(1), **PP_PREFILL)
    assert rec.streamed == []
    assert [len(r.origin_input_ids) for r in rec.senders] == [1]
    assert s.disagg_prefill_bootstrap_queue.queue == rec.senders


@pytest.mark.parametrize(
    "config",
    [
        dict(speculative_algorithm="DFLASH", disaggregation_mode="prefill", pp_size=1),
        dict(speculative_algorithm="DFLASH", disaggregation_mode="null", pp_size=1),
        dict(speculative_algorithm="NONE", disaggregation_mode="prefill", pp_size=2),
        dict(speculative_algorithm="EAGLE", disaggregation_mode="prefill", pp_size=2),
    ],
    ids=["dflash-pp1-prefill", "dflash-non-pd", "no-spec-pp2-prefill", "eagle-pp2-prefill"],
)
def test_other_configurations_admit_it_as_stock_does(sglang_with_plugin, config):
    """Stock admits the 0-token prompt (the bug the report describes); so does every
    configuration but a DFLASH PP prefill, with the plugin loaded."""
    s, rec = admit(generate_request(0), **config)
    assert rec.streamed == []
    queued = rec.senders if config["disaggregation_mode"] == "prefill" else s.waiting_queue
    assert [len(r.origin_input_ids) for r in queued] == [0]


def test_stock_verdict_is_kept_and_the_role_is_read_only_for_an_empty_prompt(
    sglang_with_plugin, monkeypatch
):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    def req(ids, **kw):
        return Req(rid="r", origin_input_text="", origin_input_ids=ids,
                   sampling_params=SamplingParams(), **kw)  # fmt: skip

    asked = []
    monkeypatch.setattr(empty_prompt_refusal, "serving_dflash_pp_prefill",
                        lambda: asked.append(1) or True)  # fmt: skip
    stock = "DFLASH speculative decoding does not support return_hidden_states yet."
    assert empty_prompt_refusal.refuse_empty_prompt(stock, req([])) == stock
    assert empty_prompt_refusal.refuse_empty_prompt(None, req([3, 4])) is None
    assert asked == []
    assert empty_prompt_refusal.refuse_empty_prompt(None, req([])) == EMPTY_PROMPT_ERROR
    assert asked == [1]
