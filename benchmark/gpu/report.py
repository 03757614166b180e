"""Render benchmark/gpu/results/*.json (measured on H200s) as the markdown README links to.

Every figure is the median of the file's raw samples with their min-max; each section names its
file and that file's provenance (date, commit, command, device, versions, repetitions, warm-up).

    python3 benchmark/gpu/report.py > benchmark/gpu/results/README.md
"""

from __future__ import annotations

import json
import os
import statistics

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load(name):
    with open(os.path.join(HERE, name)) as f:
        return json.load(f)


def med(samples, scale=1.0, fmt="{:.1f}"):
    s = [x * scale for x in samples]
    return f"{fmt.format(statistics.median(s))} ({fmt.format(min(s))}-{fmt.format(max(s))})"


def summ(s, scale=1.0, fmt="{:.1f}"):
    return f"{fmt.format(s['median'] * scale)} ({fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)})"


def origin(name, p):
    if "status" in p:
        return [f"`{name}`: {p['status']} ({p['why_not_re_run']}). Known: {p['known']}."]
    v = p["versions"]
    return [
        f"`{name}`: {p['date_utc']}, commit `{p['project']['commit'][:12]}` (tree {p['project']['tree']}), "
        f"`{p.get('environment', '').split(' (')[0]} {p['command']}`, {p['device']}, torch {v['torch']}, "
        f"triton {v['triton']}, NCCL {v['nccl']}, sglang {v['sglang']}; {p['repetitions']} repetitions "
        f"after {p['warmup']} warm-up.",
    ]


def pack_send_path(out):
    r = load("pack_send_path.json")
    g = r["geometry"]
    out += [
        "## The shipped send path's pack, per request (Kimi-K3 TP4 -> TP32)",
        "",
        *origin("pack_send_path.json", r["provenance"]),
        "",
        f"Timed: {r['provenance']['timed']}. Not timed: {r['provenance']['not_timed']}.",
        "",
        f"Prefill rank {g['prefill_rank']} -> decode ranks {g['decode_ranks'][0]}..{g['decode_ranks'][-1]}, "
        f"{g['distinct_head_slices']} distinct head slices; chunks of {g['chunked_prefill_size']} tokens; "
        f"staging {g['pack_buffer_bytes'] / 2**20:.1f} MiB in slots of {g['pack_slot_bytes'] / 2**20:.1f} MiB, "
        f"built at startup in {g['staging_startup_s']:.2f} s: {g['packs_prepared_at_startup']} packs "
        f"prepared, {g['graphs_captured_at_startup']} CUDA graphs captured; fused Triton kernel: "
        f"{g['fused_triton_kernel']}. Wall times in microseconds, median (min-max); ratio = copy / pack, "
        "of the medians.",
        "",
        "| prompt | pack steps | pack | copy of the same bytes | copy / pack | whole send path (8 decode ranks, no transfer) |",
        "|---|---|---|---|---|---|",
    ]
    for tokens, v in r["results"].items():
        s = v["summary_s"]
        out.append(
            f"| {tokens} | {v['pack_steps_per_request']} | {summ(s['pack'], 1e6)} | "
            f"{summ(s['copy'], 1e6)} | {v['copy_over_pack']['of_medians']:.2f} | "
            f"{summ(s['send'], 1e6, '{:.0f}')} |"
        )
    out += [
        "",
        "Graphs or eager launches, first chunk of each prompt: the shipped pack (the graph captured "
        "at startup, replayed) and an eager launch of the same prepared kernel, each right after "
        "other GPU work and after 5 ms of GPU idleness (the pack step follows the host's work on "
        "the previous chunk's descriptors). Microseconds, median (min-max); wall = host time to the "
        "end of the stream wait, GPU = CUDA events on the slot's stream.",
        "",
        "| prompt | graph, busy: wall / GPU | eager, busy: wall / GPU | graph, after 5 ms idle: wall | eager, after 5 ms idle: wall | eager / graph (busy, wall) |",
        "|---|---|---|---|---|---|",
    ]
    for tokens, v in r["results"].items():
        b = v["graph_vs_eager_first_chunk"]
        gb, eb = b["graph_replay_shipped_busy"], b["eager_launch_busy"]
        gi, ei = b["graph_replay_shipped_after_5ms_idle"], b["eager_launch_after_5ms_idle"]
        out.append(
            f"| {tokens} | {summ(gb['wall_s'], 1e6)} / {summ(gb['gpu_s'], 1e6)} | "
            f"{summ(eb['wall_s'], 1e6)} / {summ(eb['gpu_s'], 1e6)} | {summ(gi['wall_s'], 1e6)} | "
            f"{summ(ei['wall_s'], 1e6)} | {eb['wall_s']['median'] / gb['wall_s']['median']:.2f} |"
        )
    out.append("")


def send_path_fence(out):
    r = load("send_path_fence.json")
    out += [
        "## The send path's GPU-only properties: the KV-write fence, nothing made while serving, OOM",
        "",
        *origin("send_path_fence.json", r["provenance"]),
        "",
        f"Stand-ins: {r['provenance']['stand_ins']}. Scenarios in `benchmark/gpu/send_path_fence.py`.",
        "",
        "Race (a 128-page chunk whose forward writes its draft KV after ~100 ms on another stream; "
        "the chunk sent at once):",
        "",
        "| case | chunk carried an event | bytes sent | stale bytes | stale fraction |",
        "|---|---|---|---|---|",
    ]
    for case, v in r["race"].items():
        out.append(
            f"| {case} | {v['chunk_carried_an_event']} | {v['bytes']:,} | {v['stale']:,} | "
            f"{v['stale_fraction']:.3f} |"
        )
    out += [
        "",
        "Chunk sizes 1..129 pages through the send path, after startup:",
        "",
        "| geometry | head slices per chunk | packs / graphs made at startup (s) | CUDA allocations | kernel compiles | graph captures |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in r["nothing_allocated_or_compiled_after_startup"].items():
        out.append(
            f"| {name} | {v['distinct_head_slices']} | {v['packs_prepared_at_startup']} / "
            f"{v['graphs_captured_at_startup']} ({v['staging_startup_s']:.2f}) | "
            f"{v['cuda_allocations_during']} | {v['kernel_variants_compiled_during']} | "
            f"{v['graph_captures_during']} |"
        )
    out += [
        "",
        "OOM probe (half the free memory cached by the allocator, then 80% of it allocated while "
        "another thread runs):",
        "",
        "| other thread | allocations ok | out of memory |",
        "|---|---|---|",
    ]
    for case, v in r["oom_probe"].items():
        out.append(f"| {case} | {v['allocations_ok']} | {v['out_of_memory']} |")
    out += [
        "",
        "The counterfactual row did not fail here: this probe's cached block is released by the "
        "allocator's first retry (release of available cached blocks), which runs during a "
        "capture; the full cache release a held capture disables was not needed. The shipped path "
        "captures nothing after startup either way (the table above).",
        "",
    ]


def pack_bandwidth(out):
    pack = load("pack_bandwidth.json")
    smp = pack["samples_ms"]
    n = pack["bytes_packed"]
    gbps = lambda label: med([2 * n / (t * 1e-3) / 1e9 for t in smp[label]], fmt="{:.0f}")  # noqa: E731
    ratio = lambda a, b: statistics.median(smp[a]) / statistics.median(smp[b])  # noqa: E731
    out += [
        f"## The pack functions alone, {pack['tokens']} tokens, {pack['entries']} entries",
        "",
        *origin("pack_bandwidth.json", pack["provenance"]),
        "",
        f"{n / 2**20:.0f} MiB packed (both head groups), calls back to back without waiting (not the "
        "send path); GB/s count read + write, median (min-max) of the samples; ratio = copy / pack of "
        f"the median times. Packed bytes equal between the Triton kernel and the torch fallback: "
        f"{pack['packed_equal_torch_vs_fused']} (one launch: {pack['packed_equal_torch_vs_fused_one_launch']}), "
        f"and against an independent gather: {pack['packed_equal_reference']}.",
        "",
        "| implementation | GB/s | copy / pack |",
        "|---|---|---|",
        f"| device-to-device copy (eager) | {gbps('d2d_copy')} | 1.00 |",
        f"| torch fallback, one index_select per entry, per head group | {gbps('torch_fallback_per_group')} | {ratio('d2d_copy', 'torch_fallback_per_group'):.2f} |",
        f"| Triton, one eager launch per head group | {gbps('triton_per_group')} | {ratio('d2d_copy', 'triton_per_group'):.2f} |",
        f"| Triton, one eager launch for both groups | {gbps('triton_one_launch')} | {ratio('d2d_copy', 'triton_one_launch'):.2f} |",
        f"| Triton kernel alone (CUDA graph) vs copy (CUDA graph) | {gbps('triton_one_launch_graph')} | {ratio('d2d_copy_graph', 'triton_one_launch_graph'):.2f} |",
        "",
    ]


def partial_projection(out):
    pp = load("partial_projection.json")
    out += [
        "## Partial projection, H = 7168, 6 features on PP8 stages 1,3,4,5,6,7",
        "",
        *origin("partial_projection.json", pp["provenance"]),
        "",
        "Relative Frobenius error against an fp64 reference, as a ratio to the stock single GEMM's "
        "error (deterministic: one value), for the normalised context and one draft layer's K "
        "(K-norm + RoPE) and V; then the time of the six per-stage projections summed over the "
        "single fused GEMM: median (min-max) of the sample-wise ratios.",
        "",
        "| data | T | bf16 carry | fp32 carry, bf16 partials | **fp32 carry, fp32 partials (ours)** | time: ours / single | time: bf16 GEMMs only / single |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in pp["runs"]:
        v = r["variants"]
        s = r["samples_ms"]
        cell = lambda n: "ctx {ctx:.2f}x, K {k:.2f}x, V {v:.2f}x".format(**v[n]["ratio_to_stock"])  # noqa: E731

        def ratio(prefix):
            stages = [k for k in s if k.startswith(prefix + "[")]
            per = [sum(s[k][i] for k in stages) / s["single_gemm"][i] for i in range(len(s["single_gemm"]))]
            return med(per, fmt="{:.3f}")

        out.append(
            f"| {r['data']} | {r['T']} | {cell('pp_bf16_carry')} | {cell('pp_fp32_carry_bf16_partials')} | "
            f"{cell('pp_fp32_carry')} | {ratio('per_stage_fp32_partials')} | {ratio('per_stage_bf16_gemm')} |"
        )
    out.append("")


def nccl_carry(out):
    nccl = load("nccl_carry.json")
    out += [
        f"## NCCL send/recv between two H200s of one host, T = {nccl['T']} (NCCL {nccl['nccl']})",
        "",
        *origin("nccl_carry.json", nccl["provenance"]),
        "",
        "| payload | B/token | ms (median) | GB/s | time / fp32 partial |",
        "|---|---|---|---|---|",
    ]
    for name, r in nccl["payloads"].items():
        out.append(
            f"| {name} | {r['bytes_per_token']:,} | {r['ms']:.3f} | {r['GBps']:.0f} | {r['time_over_partial_fp32']:.2f} |"
        )
    out.append("")


def kv_digest_cost(out):
    import kv_digest_cost as script  # the section is rendered next to the code that measured it

    out += script.section(load("kv_digest_cost.json"))
    import kv_digest_timeline as timeline

    out += [""] + timeline.section(load("kv_digest_timeline.json"), origin, summ)
    if os.path.exists(os.path.join(HERE, "kv_digest_timeline_spin.json")):
        out += [""] + timeline.section(load("kv_digest_timeline_spin.json"), origin, summ,
                                       "kv_digest_timeline_spin.json")


def main():
    out = [
        "# H200 measurements",
        "",
        "Raw results with provenance and raw samples: `pack_send_path.json`, `send_path_fence.json`,",
        "`pack_bandwidth.json`, `partial_projection.json`, `nccl_carry.json`, `kv_digest_cost.json`,",
        "`kv_digest_timeline.json`",
        "(scripts in `benchmark/gpu/`; this page is",
        "`python3 benchmark/gpu/report.py`).",
        "",
    ]
    pack_send_path(out)
    send_path_fence(out)
    pack_bandwidth(out)
    partial_projection(out)
    nccl_carry(out)
    kv_digest_cost(out)
    print("\n".join(out))


if __name__ == "__main__":
    main()
