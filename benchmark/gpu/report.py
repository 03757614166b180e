"""Render benchmark/gpu/results/*.json (measured on H200s) as the markdown table README links to.

    python3 benchmark/gpu/report.py > benchmark/gpu/results/README.md
"""

from __future__ import annotations

import json
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load(name):
    with open(os.path.join(HERE, name)) as f:
        return json.load(f)


def main():
    pp = load("partial_projection.json")
    pack = load("pack_bandwidth.json")
    nccl = load("nccl_carry.json")
    out = [
        "# H200 measurements",
        "",
        "Raw results: `partial_projection.json`, `pack_bandwidth.json`, `nccl_carry.json` (scripts in",
        "`benchmark/gpu/`). Each table is one run.",
        "",
        f"## Partial projection, H = 7168, 6 features on PP8 stages 1,3,4,5,6,7 ({pp['device']}, torch {pp['torch']})",
        "",
        "Relative Frobenius error against an fp64 reference, as a ratio to the stock single GEMM's error,",
        "for the normalised context and one draft layer's K (K-norm + RoPE) and V; then the time of",
        "the six per-stage projections summed over the single fused GEMM.",
        "",
        "| data | T | bf16 carry | fp32 carry, bf16 partials | **fp32 carry, fp32 partials (ours)** | time: ours / single | time: bf16 GEMMs only / single |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in pp["runs"]:
        v = r["variants"]
        cell = lambda n: "ctx {ctx:.2f}x, K {k:.2f}x, V {v:.2f}x".format(**v[n]["ratio_to_stock"])  # noqa: E731
        out.append(
            f"| {r['data']} | {r['T']} | {cell('pp_bf16_carry')} | {cell('pp_fp32_carry_bf16_partials')} | "
            f"{cell('pp_fp32_carry')} | {r['time_ratio_fp32_partials_vs_single']:.3f} | "
            f"{r['time_ratio_bf16_gemms_vs_single']:.3f} |"
        )
    bw = pack["bandwidth_GBps_read_plus_write"]
    ratio = pack["ratio_to_copy"]
    out += [
        "",
        f"## Pack-on-source, TP4 -> TP32 draft geometry, {pack['tokens']} tokens, {pack['entries']} entries ({pack['device']})",
        "",
        f"{pack['bytes_packed'] / 2**20:.0f} MiB packed (both head groups); bandwidth counts read + write.",
        f"Packed bytes equal between the Triton kernel and the torch fallback: {pack['packed_equal_torch_vs_fused']}"
        f" (one launch: {pack['packed_equal_torch_vs_fused_one_launch']}), and against an independent gather:"
        f" {pack['packed_equal_reference']}.",
        "",
        "| implementation | GB/s | / device-to-device copy |",
        "|---|---|---|",
        f"| device-to-device copy (eager) | {bw['d2d_copy']:.0f} | 1.00 |",
        f"| torch fallback, one index_select per entry, per head group | {bw['torch_fallback_per_group']:.0f} | {ratio['torch_fallback_per_group']:.2f} |",
        f"| Triton, one launch per head group (eager) | {bw['triton_per_group']:.0f} | {ratio['triton_per_group']:.2f} |",
        f"| Triton, one launch for both groups (eager) | {bw['triton_one_launch']:.0f} | {ratio['triton_one_launch']:.2f} |",
        f"| Triton kernel alone (CUDA graph) vs copy (CUDA graph) | {bw['triton_one_launch_graph']:.0f} | {ratio['triton_one_launch_graph_vs_copy_graph']:.2f} |",
        "",
        f"## NCCL send/recv between two H200s of one host, T = {nccl['T']} (NCCL {nccl['nccl']})",
        "",
        "| payload | B/token | ms | GB/s | time / fp32 partial |",
        "|---|---|---|---|---|",
    ]
    for name, r in nccl["payloads"].items():
        out.append(
            f"| {name} | {r['bytes_per_token']:,} | {r['ms']:.3f} | {r['GBps']:.0f} | {r['time_over_partial_fp32']:.2f} |"
        )
    print("\n".join(out))


if __name__ == "__main__":
    main()
