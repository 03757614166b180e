"""Pack-on-source bandwidth for the draft-KV transfer at the Kimi-K3 TP4 -> TP32 geometry.

A P rank (TP4) holds 2 of the draft's 8 KV heads (128 dims, bf16): 512 B per token row in each of
the 12 entries (6 layers x K, V). Each D rank (TP32) wants one head: a 256 B strided slice of every
row. Packing both head groups of 8192 tokens (128 pages of 64) gathers 12 x 8192 x 512 B = 48 MiB.
Measured in one run: the device-to-device copy of the same bytes (the ceiling), the torch fallback
(``pack_row_slices``, one ``index_select`` per entry) and the fused Triton kernel; the packed bytes
of the two implementations are compared for equality. Needs torch and triton only:

    PYTHONPATH=python python3 benchmark/gpu/pack_bandwidth.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from cuda_timing import samples_ms

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import provenance  # noqa: E402

from sglang_dflash_pp.srt.disaggregation import draft_kv_pack_triton as fused
from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import (
    as_byte_rows,
    pack_row_slices_index_select as pack_row_slices,
)

ENTRIES, P_HEADS, HEAD_DIM, PAGE = 12, 2, 128, 64
POOL_PAGES = 2048


ITERS, WARMUP = 100, 20
SAMPLES: dict = {}  # label -> raw samples (ms)


_PACKS: dict = {}


def fused_pack(sources, rows, offsets, widths, out, *, block_words=4096, num_warps=4):
    """The shipped ``FusedPack`` (its table built once per sources/offsets, as the send path
    prepares it at startup), one eager launch into ``out``."""
    key = (tuple(s.data_ptr() for s in sources), tuple(offsets), block_words, num_warps)
    pack = _PACKS.get(key)
    if pack is None:
        pack = _PACKS[key] = fused.FusedPack(sources, offsets, widths, out.device)
        pack.NUM_WARPS = num_warps
        pack.block_rows = max(1, block_words // pack.block_cols)
    return pack(rows, out)


def bench(fn, label):
    SAMPLES[label] = samples_ms(fn, iters=ITERS, warmup=WARMUP)
    return statistics.median(SAMPLES[label])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    pools = [
        torch.randn(POOL_PAGES * PAGE, P_HEADS, HEAD_DIM, device=dev).to(torch.bfloat16)
        for _ in range(ENTRIES)
    ]
    sources = [as_byte_rows(p) for p in pools]
    row_bytes = sources[0].shape[1]
    slice_bytes = row_bytes // P_HEADS
    pages = torch.randperm(POOL_PAGES, device=dev)[: args.tokens // PAGE].sort().values
    rows = (pages[:, None] * PAGE + torch.arange(PAGE, device=dev)[None, :]).reshape(-1)
    n = rows.numel()
    total = 2 * ENTRIES * n * slice_bytes  # both head groups

    # Each head group is one pack call over all 12 entries (what one transfer does).
    groups = [[g * slice_bytes] * ENTRIES for g in range(P_HEADS)]
    widths = [slice_bytes] * ENTRIES
    out_torch = torch.empty(total, dtype=torch.uint8, device=dev)
    out_fused = torch.empty(total, dtype=torch.uint8, device=dev)
    half = total // 2

    def run_torch():
        for g, offs in enumerate(groups):
            pack_row_slices(sources, rows, offs, widths, out_torch[g * half : (g + 1) * half])

    def run_fused():
        for g, offs in enumerate(groups):
            fused_pack(sources, rows, offs, widths, out_fused[g * half : (g + 1) * half])

    # Both head groups in one launch: the 24 (entry, group) slices as one table.
    all_sources = sources * P_HEADS
    all_offsets = [o for offs in groups for o in offs]
    out_one = torch.empty(total, dtype=torch.uint8, device=dev)

    def run_fused_one_launch():
        fused_pack(all_sources, rows, all_offsets, [slice_bytes] * len(all_sources), out_one)

    assert all(fused.eligible(sources, offs, widths, out_fused) for offs in groups)
    run_torch()
    run_fused()
    run_fused_one_launch()
    torch.cuda.synchronize()
    # Slab order differs (group-major vs entry-major within the one launch): compare per slab.
    equal = bool(torch.equal(out_torch, out_fused))
    slab = n * slice_bytes
    equal_one = all(
        torch.equal(out_one[(g * ENTRIES + e) * slab : (g * ENTRIES + e + 1) * slab], out_torch[g * half + e * slab : g * half + (e + 1) * slab])
        for g in range(P_HEADS)
        for e in range(ENTRIES)
    )
    # Independent reference for one slab: head 1 of entry 3.
    ref = pools[3][rows][:, 1, :].contiguous().view(torch.uint8).reshape(-1)
    slab = out_fused[half + 3 * n * slice_bytes : half + 4 * n * slice_bytes]
    equal_ref = bool(torch.equal(ref, slab))

    src_flat = torch.empty(total, dtype=torch.uint8, device=dev)
    dst_flat = torch.empty(total, dtype=torch.uint8, device=dev)
    t_copy = bench(lambda: dst_flat.copy_(src_flat), "d2d_copy")
    t_torch = bench(run_torch, "torch_fallback_per_group")
    t_fused = bench(run_fused, "triton_per_group")
    t_one = bench(run_fused_one_launch, "triton_one_launch")
    # The kernel alone: the one-launch pack replayed from a CUDA graph (no Python, no launch gap).
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_fused_one_launch()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        run_fused_one_launch()
    t_graph = bench(graph.replay, "triton_one_launch_graph")
    sweep = {}
    for block_words in (1024, 2048, 4096, 8192, 16384):
        for num_warps in (4, 8, 16):
            def one(bw=block_words, nw=num_warps):
                fused_pack(
                    all_sources, rows, all_offsets, [slice_bytes] * len(all_sources), out_one,
                    block_words=bw, num_warps=nw,
                )
            one()
            g2 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g2):
                one()
            label = f"block_words={block_words},num_warps={num_warps}"
            sweep[label] = bench(g2.replay, f"graph:{label}")
    copy_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(copy_graph):
        dst_flat.copy_(src_flat)
    t_copy_graph = bench(copy_graph.replay, "d2d_copy_graph")
    gbps = lambda t: 2 * total / (t * 1e-3) / 1e9  # noqa: E731  read + write
    result = {
        "provenance": provenance.record(
            repetitions=ITERS,
            warmup=WARMUP,
            timed_sources=[
                "python/sglang_dflash_pp/srt/disaggregation/draft_kv_pack.py",
                "python/sglang_dflash_pp/srt/disaggregation/draft_kv_pack_triton.py",
            ],
            timed=(
                "the pack functions alone on one 8192-token chunk, back to back without a stream "
                "wait, CUDA events (time_ms are medians of samples_ms); not the send path, which "
                "benchmark/gpu/pack_send_path.py times"
            ),
        ),
        "samples_ms": SAMPLES,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": n,
        "entries": ENTRIES,
        "bytes_packed": total,
        "packed_equal_torch_vs_fused": equal,
        "packed_equal_torch_vs_fused_one_launch": bool(equal_one),
        "packed_equal_reference": equal_ref,
        "time_ms": {
            "d2d_copy": t_copy,
            "d2d_copy_graph": t_copy_graph,
            "torch_fallback_per_group": t_torch,
            "triton_per_group": t_fused,
            "triton_one_launch": t_one,
            "triton_one_launch_graph": t_graph,
        },
        "bandwidth_GBps_read_plus_write": {
            "d2d_copy": gbps(t_copy),
            "d2d_copy_graph": gbps(t_copy_graph),
            "torch_fallback_per_group": gbps(t_torch),
            "triton_per_group": gbps(t_fused),
            "triton_one_launch": gbps(t_one),
            "triton_one_launch_graph": gbps(t_graph),
        },
        "graph_time_ms_by_config": sweep,
        "ratio_to_copy": {
            "torch_fallback_per_group": t_copy / t_torch,
            "triton_per_group": t_copy / t_fused,
            "triton_one_launch": t_copy / t_one,
            "triton_one_launch_graph_vs_copy_graph": t_copy_graph / t_graph,
            "triton_best_config_graph_vs_copy_graph": t_copy_graph / min(sweep.values()),
        },
    }
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
