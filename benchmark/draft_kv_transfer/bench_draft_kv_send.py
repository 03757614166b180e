"""What sending a DFLASH draft KV chunk head by head costs, per-row descriptors against the pack.

Kimi-K3 geometry: one prefill rank at attention TP4 (2 of the draft's 8 KV heads) sends a
chunk of 8192 tokens to its 8 decode ranks at TP32 (1 head each); 6 draft layers (12 entries),
head_dim 128, bf16, page 64. Each decode rank gets 8192 x 12 x 256 B = 25.2 MB, 201 MB per
chunk from the prefill rank: 4.03 ms at 50 GB/s, the yardstick every figure is divided by.

``--host`` (a machine with the patched sglang): times the shipped
``MooncakeKVManager.send_kvcache_slice(draft=True)`` for all 8 decode ranks with an engine that
returns at once: the host work before a descriptor reaches the transport, per row (no pack
buffer) and packed (the pack's gather replaced by a no-op: its GPU time comes from ``--gpu``),
for an 8192-token chunk and for a first send of 65,536 tokens (a long cached prefix sent with
the request's first chunk), which the pack buffer (sized for a chunk, as
``_init_draft_kv_pack_buffers_once`` sizes it) takes in pieces. It also records the exact
arguments the shipped code gives the gather.

``--gpu`` (the H200; no sglang there): replays those arguments into the pack kernel sglang
ships (``sglang/kernels/ops/kvcache/pd_dcp_gather.py``, carried from the installed wheel as
``--kernel-dir``) on real pool-shaped CUDA buffers, checks the packed bytes against a torch
gather, and times the launch as ``try_pack_dcp_src`` makes it (metadata upload, kernel, stream
synchronise) with CUDA events and the host clock.
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
import provenance  # noqa: E402

TOKENS, PAGE, LAYERS, HEADS, HEAD_DIM, ELEM = 8192, 64, 6, 8, 128, 2
TP_P, TP_D = 4, 32
LINK_GBPS = 50.0


def chunk_bytes(tokens: int = TOKENS) -> int:
    return (TP_D // TP_P) * tokens * 2 * LAYERS * (HEADS // TP_D or 1) * HEAD_DIM * ELEM


def link_ms(tokens: int = TOKENS) -> float:
    return chunk_bytes(tokens) / (LINK_GBPS * 1e9) * 1e3


# (case, tokens of the send, whether a pack buffer is there)
HOST_CASES = (
    ("per_row", TOKENS, False),
    ("packed", TOKENS, True),
    ("per_row_cached_prefix_65536", 65536, False),
    ("packed_cached_prefix_65536", 65536, True),
)


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
    item = PAGE * src_heads * HEAD_DIM * ELEM
    band = [93 + i for i in range(LAYERS)] * 2  # the draft's layer ids, both sides
    kv_args = KVArgs()
    kv_args.engine_rank, kv_args.page_size = 0, PAGE
    kv_args.num_draft_entries, kv_args.draft_total_kv_head_num = 2 * LAYERS, HEADS
    kv_args.kv_data_ptrs = [(1 << 40) + e * (1 << 32) for e in range(2 * LAYERS)]
    kv_args.kv_item_lens = [item] * (2 * LAYERS)
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
    dst_ptrs = [(1 << 44) + e * (1 << 32) for e in range(2 * LAYERS)]
    dst_item = PAGE * max(1, HEADS // TP_D) * HEAD_DIM * ELEM
    # As _init_draft_kv_pack_buffers_once sizes it: half a chunk of whole draft rows.
    pack_size = TOKENS // 2 * 2 * LAYERS * src_heads * HEAD_DIM * ELEM
    pack = SimpleNamespace(get_ptr=lambda: 1 << 46, get_size=lambda: pack_size)
    gathers = []

    def no_gather(**kwargs):  # the GPU gather is timed by --gpu
        gathers.append(kwargs)
        n = len(kwargs["src_token_indices"])
        base, ptrs = pack.get_ptr(), []
        for width in kwargs["token_item_lens"]:
            ptrs.append(base)
            base += n * width
        return ptrs, np.arange(n)

    samples = {case: [] for case, _, _ in HOST_CASES}
    counts = {}
    with concurrent.futures.ThreadPoolExecutor(4) as executor, mock.patch.object(
        dcp_pack, "try_pack_dcp_src", no_gather
    ):
        for _ in range(reps + 1):
            for case, tokens, packed in HOST_CASES:
                pages = np.arange(tokens // PAGE, dtype=np.int32)
                descriptors.clear()
                start = time.perf_counter()
                for r in range(TP_D // TP_P):
                    ret = manager.send_kvcache_slice(
                        "d", pages, dst_ptrs, pages, r, TP_D, dst_item, executor, band,
                        draft=True, pack_buffer=pack if packed else None,
                    )
                    assert ret == 0
                samples[case].append((time.perf_counter() - start) * 1e3)
                counts[case] = sum(descriptors)
    samples = {case: s[1:] for case, s in samples.items()}  # the first pass warms up
    first = gathers[0]
    result = {
        "what": "host work of the shipped send_kvcache_slice(draft=True), 8 decode ranks, "
        "engine returning at once",
        "link_ms_at_50GBps": {c: link_ms(t) for c, t, _ in HOST_CASES},
        "samples_ms": samples,
        "descriptors_per_send": counts,
        "pack_buffer_bytes": pack_size,
        "median_ms": {c: statistics.median(samples[c]) for c, _, _ in HOST_CASES},
        "median_share_of_link": {
            c: statistics.median(samples[c]) / link_ms(t) for c, t, _ in HOST_CASES
        },
        "gather_arguments": {
            "ptr_offsets": [p - kv_args.kv_data_ptrs[i] for i, p in enumerate(first["kv_data_ptrs"])],
            "rows": [int(x) for x in first["src_token_indices"][:4]] + ["..."],
            "num_rows": int(len(first["src_token_indices"])),
            "token_item_lens": list(first["token_item_lens"]),
            "src_token_item_lens": list(first["src_token_item_lens"]),
        },
        **provenance.record(repetitions=reps, warmup=1, series_patches=fingerprint()),
    }
    _write(out, result)


def gpu(reps: int, warmup: int, kernel_dir: str, out: str) -> None:
    import torch

    sys.path.insert(0, kernel_dir)
    from pd_dcp_gather import copy_mla_rows_into_pack  # the wheel's file, carried

    src_heads = HEADS // TP_P
    row = src_heads * HEAD_DIM * ELEM  # bytes of a prefill token row
    width = row // src_heads  # one head: what a TP32 decode rank takes
    pool_rows = 2 * TOKENS
    pools = [
        torch.randint(0, 255, (pool_rows, row), dtype=torch.uint8, device="cuda")
        for _ in range(2 * LAYERS)
    ]
    rows = torch.randperm(pool_rows, device="cuda")[:TOKENS].sort().values
    pack = torch.empty(2 * LAYERS * TOKENS * width, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    checks, variants = {}, {}
    # "bytes" is how the shipped send calls the kernel (try_pack_dcp_src: a uint8 pack);
    # "int32" and "int64" give it the same copy in 4- and 8-byte words, for comparison.
    for name, word in (("bytes", 1), ("int32", 4), ("int64", 8)):
        view = pack.view({1: torch.uint8, 4: torch.int32, 8: torch.int64}[word])
        samples = {"gpu_us": [], "host_us": []}
        for r in range(TP_D // TP_P):
            head = r // (TP_D // HEADS)  # 4 decode ranks hold each head
            ptrs = [p.data_ptr() + head * width for p in pools]
            pack.zero_()
            for i in range(warmup + reps):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    start.record()
                    copy_mla_rows_into_pack(
                        ptrs, rows, view, [width // word] * len(ptrs), [row // word] * len(ptrs)
                    )
                    end.record()
                stream.synchronize()
                host_us = (time.perf_counter() - t0) * 1e6
                if i >= warmup:
                    samples["gpu_us"].append(start.elapsed_time(end) * 1e3)
                    samples["host_us"].append(host_us)
            expected = torch.cat(
                [p[rows, head * width : (head + 1) * width].reshape(-1) for p in pools]
            )
            checks[f"{name}_decode_rank_{r}_bytes_equal"] = bool(torch.equal(pack, expected))
        per_send_ms = statistics.median(samples["host_us"]) / 1e3
        variants[name] = {
            "samples_us": samples,
            "median_gpu_us": statistics.median(samples["gpu_us"]),
            "median_host_us_per_send": per_send_ms * 1e3,
            # a gather per decode rank (the shipped send), or one per distinct head slice
            "share_of_link_8_gathers": 8 * per_send_ms / link_ms(),
            "share_of_link_2_gathers": 2 * per_send_ms / link_ms(),
        }
    result = {
        "what": "the pack kernel sglang ships, with the shipped send's arguments, Kimi-K3 "
        "geometry: 8 decode ranks per prefill rank, 2 distinct head slices",
        "chunk_link_ms_at_50GBps": link_ms(),
        "pack_bytes_per_send": pack.numel(),
        "variants": variants,
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
            return {k: brief(x) for k, x in v.items() if "samples" not in k}
        return v

    print(json.dumps(brief(result), indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--host", action="store_true")
    mode.add_argument("--gpu", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--kernel-dir", help="--gpu: directory holding the wheel's pd_dcp_gather.py")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.host:
        host(args.reps, args.out)
    else:
        gpu(args.reps, args.warmup, args.kernel_dir, args.out)


if __name__ == "__main__":
    main()
