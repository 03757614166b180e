"""Stock 0.5.23: DFLASH on ``--device cpu`` (the CUDA wheel) stops at CUDA-only spots.

Each spot is called directly, with CPU tensors, the way the DFLASH path calls it; the script
prints what stock returns or raises next to what a CPU run needs. No server, no model.

1. ``arg_groups/speculative_hook._handle_dflash``: the in-tree platform check admits DFLASH on
   cuda/npu/xpu only, so ``--device cpu`` is refused at startup.
2. ``speculative/draft_worker_common.resolve_draft_worker_attention_backend``: a CPU draft
   attention backend (``torch_native``) is not in the draft choices; it falls back to flashinfer.
3. ``kernels/ops/speculative/cache_locs.assign_extend_cache_locs_func``: with the CUDA wheel
   ``_is_cpu`` is False (it follows SGLANG_USE_CPU_ENGINE), no branch matches CPU tensors and the
   function returns ``None``; the DFLASH verify then fails far from the cause.
4. ``mem_cache/allocation.assign_req_to_token_pool_func`` (called from ``dflash_info_v2``): the
   non-``_is_cpu`` branch launches a Triton kernel, which needs a GPU driver.
5. ``speculative/dflash_worker_v2.py:2481``: ``batch.seq_lens.record_stream(
   torch.get_device_module(device).current_stream())`` raises for a CPU tensor.

Run: ``python repro.py`` (stock sglang 0.5.23; no plugin is loaded, see ../stock_sglang.py).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stock_sglang  # noqa: E402

stock_sglang.stock_only()

import torch  # noqa: E402

TARGETS = [
    "sglang.srt.arg_groups.speculative_hook._handle_dflash",
    "sglang.srt.speculative.draft_worker_common.resolve_draft_worker_attention_backend",
    "sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_func",
    "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func",
]

# Two requests in pool rows 2 and 0; request 0 covers slots [3, 5), request 1 slots [1, 3).
REQ_POOL_INDICES = [2, 0]
START, END = [3, 1], [5, 3]
NEW_LOCS = [100, 101, 102, 103]


def req_to_token() -> torch.Tensor:
    return torch.arange(40, dtype=torch.int32).reshape(4, 10)


def outcome(fn):
    """('ok', value) or ('raises', 'Type: message')."""
    try:
        return "ok", fn()
    except Exception as e:  # the outcome being reproduced
        return "raises", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def platform_check():
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash
    from sglang.srt.server_args import ServerArgs

    # The platform check is the handler's first statement; nothing else is read before it.
    kind, value = outcome(
        lambda: _handle_dflash(ServerArgs(model_path="/nonexistent", device="cpu",
                                          speculative_algorithm="DFLASH"))
    )
    return kind == "raises" and "not supported by" in value, value


def draft_backend():
    from sglang.srt.speculative.draft_worker_common import resolve_draft_worker_attention_backend

    return resolve_draft_worker_attention_backend(algo_label="DFLASH")


def extend_cache_locs():
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func

    out = assign_extend_cache_locs_func(
        torch.tensor(REQ_POOL_INDICES), req_to_token(), torch.tensor(START), torch.tensor(END),
        len(REQ_POOL_INDICES), 2, "cpu",
    )
    return None if out is None else [int(x) for x in out]


def req_to_token_rows():
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool_func

    table = req_to_token()
    kind, value = outcome(lambda: assign_req_to_token_pool_func(
        torch.tensor(REQ_POOL_INDICES), table, torch.tensor(START), torch.tensor(END),
        torch.tensor(NEW_LOCS), len(REQ_POOL_INDICES),
    ))
    if kind == "raises":
        return value
    return [[int(x) for x in table[r, s:e]] for r, s, e in zip(REQ_POOL_INDICES, START, END)]


def record_stream_on_cpu():
    seq_lens = torch.tensor([5, 3])
    kind, value = outcome(
        lambda: seq_lens.record_stream(torch.get_device_module("cpu").current_stream())
    )
    return "ok" if kind == "ok" else value


def oracle():
    """What each spot has to give a CPU run, computed here from the functions' contracts."""
    table = req_to_token()
    locs = [int(x) for r, s, e in zip(REQ_POOL_INDICES, START, END) for x in table[r, s:e]]
    rows, taken = [], 0
    for s, e in zip(START, END):
        rows.append(NEW_LOCS[taken : taken + e - s])
        taken += e - s
    return {
        "1_platform_refuses_dflash_on_cpu": False,
        "2_draft_attention_backend": "torch_native",
        "3_assign_extend_cache_locs": locs,
        "4_assign_req_to_token_pool_rows": rows,
        "5_record_stream_on_cpu_tensor": "ok",
    }


def main() -> None:
    from sglang.srt.runtime_context import get_context

    mode = stock_sglang.begin(TARGETS)
    refused, message = platform_check()
    get_context().override_server_args(
        device="cpu", speculative_algorithm="DFLASH",
        speculative_draft_attention_backend="torch_native",
    ).install()
    observed = {
        "1_platform_refuses_dflash_on_cpu": refused,
        "2_draft_attention_backend": draft_backend(),
        "3_assign_extend_cache_locs": extend_cache_locs(),
        "4_assign_req_to_token_pool_rows": req_to_token_rows(),
        "5_record_stream_on_cpu_tensor": record_stream_on_cpu(),
    }
    expected = oracle()
    print(f"_handle_dflash on device cpu: {message}")
    stock_sglang.compare(
        mode, TARGETS, "dflash-cpu-only-spots", observed, expected,
        spots_wrong=sorted(k for k in observed if observed[k] != expected[k]),
    )


if __name__ == "__main__":
    main()
