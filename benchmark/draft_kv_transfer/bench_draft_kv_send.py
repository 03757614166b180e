"""What sending a DFLASH draft KV chunk head by head costs: per-row descriptors, a gather
per decode rank (the pack before one gather per chunk), and one gather per chunk.

Kimi-K3 geometry: one prefill rank at attention TP4 (2 of the draft's 8 KV heads) sends a
chunk of 8192 tokens to its 8 decode ranks at TP32 (1 head each; 4 hold each head); 6 draft
layers (12 entries), head_dim 128, bf16, page 64. Each decode rank gets 8192 x 12 x 256 B =
25.2 MB, 201 MB per chunk from the prefill rank: 4.03 ms at 50 GB/s, the yardstick every
figure is divided by.

``--host`` (a machine with the patched sglang): times the shipped
``MooncakeKVManager.send_kvcache_slice(draft=True)`` for all 8 decode ranks with an engine that
returns at once and the pack's gather (``try_pack_dcp_src``) recorded instead of run: the host
work before a descriptor reaches the transport. Cases: per row (no pack buffer); packed with a
gather per decode rank (no ``packed_slices``, the path before this change); packed with the
chunk's ``packed_slices`` as the transfer worker passes it; and a first send of 65,536 tokens (a
long cached prefix), which the pack buffer (sized as ``_init_draft_kv_pack_buffers_once`` sizes
it) takes in pieces. It records every gather's arguments for ``--gpu``.

``--carry DIR`` (here) copies the gather's code from the installed, patched sglang
(``dcp_pack.py`` with ``try_pack_dcp_src``, and the kernel ``pd_dcp_gather.py``).

``--gpu`` (the GPU machine; no sglang there): imports the carried ``try_pack_dcp_src`` (its two
sglang imports given stand-ins: a ``StagingBuffer`` name and ``device_stream_context``), replays
the recorded gathers of each case on pool-shaped CUDA buffers (pages in a random order), checks
every packed slice against a torch gather, and times each chunk's gathers (upload, kernel,
synchronise, as the send runs them) with the host clock and CUDA events; the profiler then
splits the device time into the kernel and the host-to-device copies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import carried_code  # noqa: E402
import provenance  # noqa: E402

TOKENS, PAGE, LAYERS, HEADS, HEAD_DIM, ELEM = 8192, 64, 6, 8, 128, 2
TP_P, TP_D = 4, 32
ENTRIES = 2 * LAYERS
LINK_GBPS = 50.0
POOL = 1 << 40  # fake pool addresses on the host: entry e at POOL + e * ENTRY_SPAN
ENTRY_SPAN = 1 << 32
PACK = 1 << 46


def link_ms(tokens: int = TOKENS) -> float:
    nbytes = (TP_D // TP_P) * tokens * ENTRIES * (HEADS // TP_D or 1) * HEAD_DIM * ELEM
    return nbytes / (LINK_GBPS * 1e9) * 1e3


# (case, tokens of the send, pack buffer, one packed_slices for the chunk)
HOST_CASES = (
    ("per_row", TOKENS, False, False),
    ("packed_gather_per_decode_rank", TOKENS, True, False),
    ("packed_gather_per_chunk", TOKENS, True, True),
    ("per_row_cached_prefix_65536", 65536, False, False),
    ("packed_cached_prefix_65536", 65536, True, True),
)
GPU_CASES = ("packed_gather_per_decode_rank", "packed_gather_per_chunk")


def host(reps: int, out: str) -> None:
    import concurrent.futures
    from types import SimpleNamespace
    from unittest import mock

    import numpy as np

    import sglang.srt.disaggregation.common.dcp_pack as dcp_pack
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang_dflash_pp.patch_series.series import fingerprint

    src_heads = HEADS // TP_P
    src_row = src_heads * HEAD_DIM * ELEM
    band = [93 + i for i in range(LAYERS)] * 2  # the draft's layer ids, both sides
    kv_args = KVArgs()
    kv_args.engine_rank, kv_args.page_size = 0, PAGE
    kv_args.num_draft_entries, kv_args.draft_total_kv_head_num = ENTRIES, HEADS
    kv_args.kv_data_ptrs = [POOL + e * ENTRY_SPAN for e in range(ENTRIES)]
    kv_args.kv_item_lens = [PAGE * src_row] * ENTRIES
    kv_args.kv_layer_ids = band
    descriptors = []
    engine = SimpleNamespace(
        batch_transfer_sync=lambda s, src, dst, n: descriptors.append(len(src)) or 0
    )
    # The fields the send reads; a real manager starts a transfer engine.
    manager = object.__new__(MooncakeKVManager)
    manager.kv_args, manager.attn_tp_size, manager.engine = kv_args, TP_P, engine
    manager.is_mla_backend, manager.pp_size, manager.max_transfer_batch_indices = False, 1, 0
    manager._transfer_data = lambda s, blocks: descriptors.append(len(blocks)) or 0
    dst_ptrs = [(1 << 44) + e * ENTRY_SPAN for e in range(ENTRIES)]
    dst_item = PAGE * max(1, HEADS // TP_D) * HEAD_DIM * ELEM
    # As _init_draft_kv_pack_buffers_once sizes it: a chunk of whole draft rows.
    pack_size = TOKENS * ENTRIES * src_row
    pack = SimpleNamespace(get_ptr=lambda: PACK, get_size=lambda: pack_size)
    gathers = []

    def recorded_gather(**kwargs):  # the GPU gather is timed by --gpu
        n = len(kwargs["src_token_indices"])
        if n * sum(kwargs["token_item_lens"]) > pack_size:
            return None
        gathers.append({
            "entry_and_offset": [divmod(p - POOL, ENTRY_SPAN) for p in kwargs["kv_data_ptrs"]],
            "pages": n // PAGE,
            "token_item_lens": list(kwargs["token_item_lens"]),
            "src_token_item_lens": list(kwargs["src_token_item_lens"]),
            "max_word_bytes": kwargs.get("max_word_bytes", 1),
        })
        base, ptrs = PACK, []
        for width in kwargs["token_item_lens"]:
            ptrs.append(base)
            base += n * width
        return ptrs, np.arange(n)

    samples = {case: [] for case, *_ in HOST_CASES}
    counts, recorded = {}, {}
    with concurrent.futures.ThreadPoolExecutor(4) as executor, mock.patch.object(
        dcp_pack, "try_pack_dcp_src", recorded_gather
    ):
        for _ in range(reps + 1):
            for case, tokens, packed, per_chunk in HOST_CASES:
                pages = np.arange(tokens // PAGE, dtype=np.int32)
                descriptors.clear()
                gathers.clear()
                packed_slices = {} if per_chunk else None
                start = time.perf_counter()
                for r in range(TP_D // TP_P):
                    ret = manager.send_kvcache_slice(
                        "d", pages, dst_ptrs, pages, r, TP_D, dst_item, executor, band,
                        draft=True, pack_buffer=pack if packed else None,
                        packed_slices=packed_slices,
                    )
                    assert ret == 0
                samples[case].append((time.perf_counter() - start) * 1e3)
                counts[case] = sum(descriptors)
                recorded[case] = list(gathers)
    samples = {case: s[1:] for case, s in samples.items()}  # the first pass warms up
    result = {
        "what": "host work of the shipped send_kvcache_slice(draft=True), 8 decode ranks, "
        "engine returning at once, the gather recorded instead of run",
        "link_ms_at_50GBps": {c: link_ms(t) for c, t, *_ in HOST_CASES},
        "samples_ms": samples,
        "descriptors_per_send": counts,
        "gathers_per_send": {c: len(g) for c, g in recorded.items()},
        "pack_buffer_bytes": pack_size,
        "median_ms": {c: statistics.median(samples[c]) for c, *_ in HOST_CASES},
        "median_share_of_link": {
            c: statistics.median(samples[c]) / link_ms(t) for c, t, *_ in HOST_CASES
        },
        "gathers": {c: recorded[c] for c in GPU_CASES},
        **provenance.record(repetitions=reps, warmup=1, series_patches=fingerprint()),
    }
    _write(out, result)


CARRIED = {
    "dcp_pack.py": "srt/disaggregation/common/dcp_pack.py",
    "pd_dcp_gather.py": "kernels/ops/kvcache/pd_dcp_gather.py",
}
STAND_INS = {  # the two sglang names dcp_pack.py imports besides the kernel
    "sglang/srt/disaggregation/common/staging_buffer.py": "class StagingBuffer: pass\n",
    "sglang/srt/utils/__init__.py": "from torch.cuda import stream as device_stream_context\n",
}


def import_try_pack(kernel_dir: str):
    sys.path.insert(0, carried_code.assemble(kernel_dir, CARRIED, STAND_INS))
    from sglang.srt.disaggregation.common.dcp_pack import try_pack_dcp_src

    return try_pack_dcp_src


def gpu(reps: int, warmup: int, kernel_dir: str, host_result: str, out: str) -> None:
    import torch

    try_pack_dcp_src = import_try_pack(kernel_dir)
    recorded = json.load(open(host_result))["gathers"]
    src_row = HEADS // TP_P * HEAD_DIM * ELEM
    pool_pages = 4 * TOKENS // PAGE
    pools = [
        torch.randint(0, 255, (pool_pages * PAGE, src_row), dtype=torch.uint8, device="cuda")
        for _ in range(ENTRIES)
    ]
    buffer = torch.empty(TOKENS * ENTRIES * src_row, dtype=torch.uint8, device="cuda")
    gather_stream = torch.cuda.Stream()

    class PackBuffer:  # the StagingBuffer interface try_pack_dcp_src reads
        def __init__(self):
            self.buffer = buffer

        def get_ptr(self):
            return buffer.data_ptr()

        def get_size(self):
            return buffer.numel()

        def fits(self, n):
            return n <= buffer.numel()

        def get_gather_stream(self):
            return gather_stream

        def producer_stream(self):
            return torch.cuda.current_stream()

    pack = PackBuffer()
    pages = torch.randperm(pool_pages, device="cuda")[: TOKENS // PAGE]
    rows_gpu = (pages[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)
    rows = rows_gpu.cpu().numpy()
    cases, checks = {}, {}
    def chunk(calls):  # the gathers of one chunk, as the send makes them
        for call in calls:
            packed = try_pack_dcp_src(
                pack_buffer=pack,
                kv_data_ptrs=[pools[e].data_ptr() + o for e, o in call["entry_and_offset"]],
                src_token_indices=rows[: call["pages"] * PAGE],
                token_item_lens=call["token_item_lens"],
                src_token_item_lens=call["src_token_item_lens"],
                max_word_bytes=call["max_word_bytes"],
            )
        return packed

    for case in GPU_CASES:
        calls = recorded[case]
        samples = {"host_us": [], "gpu_us": []}
        for i in range(warmup + reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(gather_stream)
            t0 = time.perf_counter()
            packed = chunk(calls)  # returns after the gather stream synchronised
            host_us = (time.perf_counter() - t0) * 1e6
            end.record(gather_stream)
            end.synchronize()
            if i >= warmup:
                samples["host_us"].append(host_us)
                samples["gpu_us"].append(start.elapsed_time(end) * 1e3)
        # Where the time goes: the kernel and the uploads on the device, by the profiler.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                chunk(calls)
            torch.cuda.synchronize()
        device_us = {"kernel": 0.0, "host_to_device_copies": 0.0}
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None)
            us = e.self_cuda_time_total if us is None else us
            if "copy_mla_rows_into_pack" in e.key:
                device_us["kernel"] += us / reps
            elif "Memcpy HtoD" in e.key:
                device_us["host_to_device_copies"] += us / reps
        # The last call's pack against a torch gather of the same slices.
        ptrs, _ = packed
        call, ok = calls[-1], True
        n = call["pages"] * PAGE
        for ptr, (e, o), width in zip(ptrs, call["entry_and_offset"], call["token_item_lens"]):
            start_byte = ptr - buffer.data_ptr()
            expected = pools[e][rows_gpu[:n], o : o + width].reshape(-1)
            ok = ok and torch.equal(buffer[start_byte : start_byte + n * width], expected)
        checks[f"{case}_packed_bytes_equal_torch_gather"] = bool(ok)
        chunk_ms = statistics.median(samples["host_us"]) / 1e3
        cases[case] = {
            "gathers_per_chunk": len(calls),
            "bytes_gathered_per_chunk": sum(
                c["pages"] * PAGE * sum(c["token_item_lens"]) for c in calls
            ),
            "samples_us": samples,
            "median_host_us_per_chunk": chunk_ms * 1e3,
            "median_gpu_us_per_chunk": statistics.median(samples["gpu_us"]),
            "profiled_device_us_per_chunk": device_us,
            "share_of_link": chunk_ms / link_ms(),
        }
    result = {
        "what": "the shipped try_pack_dcp_src (carried) replaying the gathers the shipped send "
        "makes for one chunk to 8 decode ranks, Kimi-K3 geometry",
        "chunk_link_ms_at_50GBps": link_ms(),
        "cases": cases,
        "checks": checks,
        "device_name": torch.cuda.get_device_name(),
        **provenance.record(repetitions=reps, warmup=warmup),
    }
    _write(out, result)


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)

    def brief(v):
        if isinstance(v, dict):
            return {k: brief(x) for k, x in v.items() if k not in ("samples_ms", "samples_us", "gathers")}
        return v

    print(json.dumps(brief(result), indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--host", action="store_true")
    mode.add_argument("--carry", metavar="DIR", help="copy the gather's code into DIR (here)")
    mode.add_argument("--gpu", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--kernel-dir", help="--gpu: what --carry wrote")
    p.add_argument("--host-result", help="--gpu: the --host result, whose gathers it replays")
    p.add_argument("--out")
    args = p.parse_args()
    if args.carry:
        carried_code.carry(args.carry, CARRIED)
    elif args.host:
        host(args.reps, args.out)
    else:
        gpu(args.reps, args.warmup, args.kernel_dir, args.host_result, args.out)


if __name__ == "__main__":
    main()
