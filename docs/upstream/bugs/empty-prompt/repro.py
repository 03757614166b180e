"""Stock 0.5.23: a prompt that tokenizes to 0 tokens is admitted, crashes the forward, and a PD
decode that admitted it cannot release it.

``{"text": ""}`` with a tokenizer that adds no BOS (Qwen's, this repository's test models)
gives 0 input ids. Stock refuses an empty ``input_ids`` field (``io_struct.py:490-499``) and an
empty session request (``session/session_controller.py:295-299``), but no check looks at the
tokenized prompt: ``TokenizerManager._validate_one_request`` (``tokenizer_manager.py:1307-1350``)
and the scheduler's ``validate_input_length`` (``managers/utils.py:259-289``) only bound it from
above. The request is scheduled as a 0-token extend and the target's first attention layer raises
(``layers/rotary_embedding/base.py:347`` on CPU). A PD decode that received the same request from
the router holds a request-pool row with 0 KV tokens, which ``release_kv_cache``'s first assertion
(``mem_cache/common.py:403``) rejects on every release path; the row leaks and the strict idle
check stops the decode.

What runs, each the real stock code:

1. ``GenerateReqInput.normalize_batch_and_arguments`` for ``text=""`` and (control) for
   ``input_ids=[]``;
2. ``TokenizerManager._validate_one_request`` on a shell (``object.__new__`` with the five fields
   it reads) for the 0 ids ``""`` tokenizes to, and (control) for an over-long prompt;
3. ``Scheduler.handle_generate_request`` on a ``Scheduler`` built with ``object.__new__`` (a
   non-PD DFLASH server's fields; the components the admission path calls after its checks, the
   grammar queue, tree cache and KV budget, are stand-ins) for a real ``TokenizedGenerateReqInput``
   of 0 tokens: does it reach the waiting queue;
4. the target's RoPE (``get_rope`` with Llama's arguments, called as ``LlamaAttention`` calls it)
   on 0 tokens, and (control) on 1 token;
5. ``release_kv_cache`` for a real ``Req`` of 0 tokens holding a row of a real ``ReqToTokenPool``
   (the state the decode's preallocation leaves it in).

Run: ``python repro.py`` (stock sglang 0.5.23; no plugin is loaded, see ../stock_sglang.py).
"""

from __future__ import annotations

import os
import sys
import traceback
import types
from array import array
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stock_sglang  # noqa: E402

stock_sglang.stock_only()

import torch  # noqa: E402

TARGETS = [
    "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments",
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
    "sglang.srt.managers.scheduler.Scheduler.handle_generate_request",
    "sglang.srt.managers.scheduler.validate_dflash_request",
    "sglang.srt.managers.utils.validate_input_length",
    "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_native",
    "sglang.srt.mem_cache.common.release_kv_cache",
]
CONTEXT = 4096
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16  # this repository's tiny Llama target


def raised_at(e: BaseException) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    where = frame.filename.split("site-packages/sglang/")[-1]
    message = (str(e).splitlines() or [""])[0][:160]
    return f"{type(e).__name__} at {where}:{frame.lineno}" + (f": {message}" if message else "")


def outcome(fn) -> str:
    try:
        fn()
        return "accepted"
    except Exception as e:  # the outcome being reproduced
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def http_normalization(**body) -> str:
    from sglang.srt.managers.io_struct import GenerateReqInput

    return outcome(lambda: GenerateReqInput(sampling_params={"max_new_tokens": 4}, **body)
                   .normalize_batch_and_arguments())


def tokenizer_manager_check(num_tokens: int) -> str:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    tm = object.__new__(TokenizerManager)
    tm.context_len, tm.num_reserved_tokens = CONTEXT, 0
    tm.allow_auto_truncate, tm.validate_total_tokens, tm.is_generation = False, True, True
    tm.model_config = SimpleNamespace(joint_head_config=None, pointer_head=None)
    obj = GenerateReqInput(text="x", sampling_params={"max_new_tokens": 4})
    obj.normalize_batch_and_arguments()
    return outcome(lambda: tm._validate_one_request(obj, list(range(num_tokens))))


def scheduler_admits(num_tokens: int) -> bool:
    """Whether ``handle_generate_request`` puts the request in the waiting queue."""
    from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    s = object.__new__(Scheduler)
    s.enable_session_radix_cache = False
    s.model_config = SimpleNamespace(hf_eos_token_id=None, vocab_size=512, num_key_value_heads=2)
    s.disaggregation_mode, s.transfer_backend = DisaggregationMode.NULL, TransferBackend.MOONCAKE
    s.metrics_reporter = SimpleNamespace(enable_metrics=False)
    s.kv_events_publisher = SimpleNamespace(enable_kv_cache_events=False)
    s.dllm_config = s.tokenizer = None
    s.spec_algorithm, s.enable_overlap = SpeculativeAlgorithm.DFLASH, False
    s.max_new_tokens_limit = None
    s.max_req_len = s.max_total_num_tokens = CONTEXT
    s.max_req_input_len = CONTEXT - 1
    s.kv_shard_widening, s.page_size, s.sliding_window_size, s.chunked_prefill_size = 1, 1, None, 64
    s.enable_priority_scheduling = s.abort_on_priority_when_disabled = False
    s.enable_hicache_storage = s.enable_lmcache = False
    s.max_queued_requests, s.processed_tokens_counter, s.waiting_queue = None, 0, []
    # Stand-ins for components the admission path calls after its checks.
    s.token_to_kv_pool_allocator = SimpleNamespace(max_new_tokens_for_memory=lambda n, m, **k: m)
    s.tree_cache = SimpleNamespace(cache_controller=None, finish=lambda *a: None)
    s.grammar_manager = SimpleNamespace(process_req_with_grammar=lambda req: False)
    s.output_streamer = SimpleNamespace(stream_output=lambda *a, **k: None)
    recv = TokenizedGenerateReqInput(
        input_text="", input_ids=array("q", range(num_tokens)), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=4),
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None,
        stream=False, rid=f"r{num_tokens}",
    )  # fmt: skip
    with get_parallel().override(pp_size=1, pp_rank=0, tp_rank=0):
        s.handle_generate_request(recv)
    return [len(r.origin_input_ids) for r in s.waiting_queue] == [num_tokens]


def rope_forward(num_tokens: int) -> str:
    """The target's first attention op, as ``LlamaAttention.forward_prepare_native`` calls it."""
    # The CUDA wheel's constructor binds vLLM's kernel as a fallback on a CPU-only box; it is
    # never called on the native path (a --device cpu server runs with a stub package, the same).
    vllm = types.ModuleType("vllm")
    vllm._custom_ops = types.ModuleType("vllm._custom_ops")
    vllm._custom_ops.rotary_embedding = lambda *a, **k: None
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", vllm._custom_ops)
    from sglang.srt.layers.rotary_embedding import get_rope

    rope = get_rope(HEAD_DIM, rotary_dim=HEAD_DIM, max_position=CONTEXT, base=10000,
                    is_neox_style=True, dtype=torch.float32)  # fmt: skip
    positions = torch.arange(num_tokens)
    q = torch.randn(num_tokens, HEADS * HEAD_DIM)
    k = torch.randn(num_tokens, KV_HEADS * HEAD_DIM)
    try:
        q, k = rope(positions, q, k)
        return f"ok: q {list(q.shape)}, k {list(k.shape)}"
    except Exception as e:  # the outcome being reproduced
        return raised_at(e)


def decode_release_of_0_token_request() -> str:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    req = Req(rid="d0", origin_input_text="", origin_input_ids=[], sampling_params=SamplingParams())
    pool.alloc([req])  # DecodePreallocQueue._pre_alloc: a row, then fill_len = 0 KV tokens
    state = f"holds_kv={req.kv.holds_kv}, is_kv_released={req.kv.is_kv_released}"
    try:
        release_kv_cache(req, SimpleNamespace(), checkpoint=False)
        return f"released ({state})"
    except AssertionError as e:
        return f"{raised_at(e)} ({state})"


def main() -> None:
    from sglang.srt.runtime_context import get_context

    mode = stock_sglang.begin(TARGETS)
    # A non-PD DFLASH server's published configuration, which the admission path reads.
    get_context().override_server_args(device="cpu", speculative_algorithm="DFLASH").install()
    observed = {
        "1_http_text_empty": http_normalization(text=""),
        "1_http_input_ids_empty_control": http_normalization(input_ids=[]),
        "2_tokenizer_manager_0_tokens": tokenizer_manager_check(0),
        "2_tokenizer_manager_over_long_control": tokenizer_manager_check(CONTEXT + 1),
        "3_scheduler_queues_0_token_request": scheduler_admits(0),
        "3_scheduler_queues_1_token_request_control": scheduler_admits(1),
        "4_rope_forward_0_tokens": rope_forward(0),
        "4_rope_forward_1_token_control": rope_forward(1),
        "5_decode_release_0_token_request": decode_release_of_0_token_request(),
    }
    expected = {
        **observed,
        # A prompt that tokenizes to nothing is refused like an empty input_ids field: a 400 at
        # the first check that sees the tokenized prompt, on every server, before any queue.
        "2_tokenizer_manager_0_tokens": "refused (400): the prompt is empty",
        "3_scheduler_queues_0_token_request": False,
        "4_rope_forward_0_tokens": "never reached: refused at admission",
        "5_decode_release_0_token_request": "never reached: refused at admission",
    }
    stock_sglang.compare(
        mode, TARGETS, "empty-prompt", observed, expected,
        broken=sorted(k for k in observed if observed[k] != expected[k]),
    )


if __name__ == "__main__":
    main()
