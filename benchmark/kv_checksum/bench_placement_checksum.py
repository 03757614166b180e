"""What the placement-keyed KV checksum costs per 8192-token chunk at the Kimi-K3 geometry.

The shipped ``KvPlacementChecksum.compute`` (PR 09) times the sums of one request's tokens, on
both sides of a transfer:

- a prefill rank of the last PP stage (P = TP4 x PP8): the stage's 3 MLA layers (one 576-element
  bf16 latent per token) and the 6-layer draft's K and V, 2 of its 8 KV heads (head_dim 128);
- a decode rank (D = TP32): all 24 MLA layers and 1 draft head of each draft entry.

Each figure is set against the chunk's time on a 50 GB/s link: what the prefill rank sends for
the chunk (the draft heads to its 8 decode ranks, 201 MB, and the latent of its 3 layers to the
8 decode ranks it serves, 226 MB), and what a decode rank receives (251 MB).

The GPU machine has no sglang. ``--carry DIR`` (here, with the patched sglang installed) copies
what the GPU run needs from the installed package: the series' ``keyed_head_hash.py`` and
``kv_placement_checksum.py``, the wheel's ``gpu_tensor_hash.py``, and ``compute_head_slice_params``
(the one function of ``common/staging_buffer.py`` the checksum calls). ``--gpu`` builds a package
directory of those, with stand-ins for the rest of the checksum's sglang imports: pool classes
that are bare names (the checksum reads only their buffer lists) and ``KvChecksumComputer`` (the
digest this PR extends; not timed here). It checks the sums against the torch reference, then
times ``compute`` (the launch, the device-to-host copy of the sums and the rows built from them)
with CUDA events and the host clock.

    python3 benchmark/kv_checksum/bench_placement_checksum.py --carry .carry/kernels
    python3 benchmark/kv_checksum/bench_placement_checksum.py --gpu --kernel-dir .carry/kernels \
        --reps 50 --warmup 10 --out benchmark/kv_checksum/results/placement_checksum_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
import carried_code  # noqa: E402
import provenance  # noqa: E402

TOKENS = 8192
PAGE = 64
POOL_PAGES = 4096
LATENT = 576  # kv_lora_rank 512 + rope 64
DRAFT_LAYERS, DRAFT_HEADS, HEAD_DIM = 6, 8, 128
MLA_LAYERS, STAGE_MLA_LAYERS = 24, 3
TP_P, TP_D = 4, 32
LINK_GBPS = 50.0
# Carried from the installed, patched sglang (--carry): the code timed.
CARRIED = {
    "gpu_tensor_hash.py": "kernels/ops/memory/gpu_tensor_hash.py",
    "keyed_head_hash.py": "kernels/ops/memory/keyed_head_hash.py",
    "kv_placement_checksum.py": "srt/disaggregation/kv_placement_checksum.py",
}
STAND_INS = {
    "sglang/srt/mem_cache/memory_pool.py": """
class KVCache: pass
class MHATokenToKVPool(KVCache): pass
class MLATokenToKVPool(KVCache): pass
class HybridLinearKVPool(KVCache): pass
""",
    "sglang/srt/disaggregation/checksum.py": """
class KvChecksumComputer:
    def __init__(self, *args, **kwargs): pass
""",
}


def carry(directory: str) -> None:
    """Copy what ``--gpu`` needs from the installed sglang into ``directory``."""
    import ast
    import importlib.util

    carried_code.carry(directory, CARRIED)
    package = os.path.dirname(importlib.util.find_spec("sglang").origin)
    path = os.path.join(package, "srt/disaggregation/common/staging_buffer.py")
    source = open(path).read()
    (node,) = [n for n in ast.parse(source).body
               if isinstance(n, ast.FunctionDef) and n.name == "compute_head_slice_params"]
    with open(os.path.join(directory, "staging_buffer.py"), "w") as f:
        f.write("from typing import Tuple\n\n\n" + ast.get_source_segment(source, node) + "\n")


def link_ms(nbytes: int) -> float:
    return nbytes / (LINK_GBPS * 1e9) * 1e3


def build_package(kernel_dir: str) -> str:
    carried = {**CARRIED, "staging_buffer.py": "srt/disaggregation/common/staging_buffer.py"}
    return carried_code.assemble(kernel_dir, carried, STAND_INS)


def side(mla_layers: int, draft_heads: int, tp: int):
    """The pools of one rank, filled with random words, and a request's slots."""
    import torch

    from sglang.srt.disaggregation import kv_placement_checksum as ck
    from sglang.srt.mem_cache import memory_pool as mp

    slots = POOL_PAGES * PAGE
    mla = mp.MLATokenToKVPool()
    mla.start_layer = 0
    mla.kv_buffer = [
        torch.randn(slots, 1, LATENT, device="cuda", dtype=torch.bfloat16)
        for _ in range(mla_layers)
    ]
    draft = mp.MHATokenToKVPool()
    draft.start_layer, draft.layer_num, draft.kv_cache_layout = 0, DRAFT_LAYERS, "nhd"
    shape = (slots, draft_heads, HEAD_DIM)
    draft.k_buffer = [torch.randn(shape, device="cuda", dtype=torch.bfloat16)
                      for _ in range(DRAFT_LAYERS)]  # fmt: skip
    draft.v_buffer = [torch.randn(shape, device="cuda", dtype=torch.bfloat16)
                      for _ in range(DRAFT_LAYERS)]  # fmt: skip
    checksum = ck.KvPlacementChecksum(
        [(ck.TARGET_KV, mla, 1), (ck.DRAFT_KV, draft, DRAFT_HEADS)], 1, tp
    )
    pages = torch.randperm(POOL_PAGES, device="cuda")[: TOKENS // PAGE]
    locs = (pages[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)
    locs = locs.to(torch.int32)  # as req_to_token holds them
    nbytes = TOKENS * (mla_layers * LATENT * 2 + 2 * DRAFT_LAYERS * draft_heads * HEAD_DIM * 2)
    return checksum, locs, nbytes


def compiled_variants() -> int:
    from sglang.kernels.ops.memory.keyed_head_hash import _keyed_head_sums_kernel as k

    return sum(len(cache[0]) for cache in k.device_caches.values())


def after_startup(checksum, locs) -> dict:
    """Requests unlike the startup launch: 1 to 8192 tokens, first positions 0 to 12345,
    slot lists starting 4 bytes past an aligned address."""
    import torch

    spare = torch.cat([locs[:1], locs])  # spare[1:] is 4 bytes off alignment
    torch.cuda.synchronize()
    variants, before = compiled_variants(), torch.cuda.memory_stats()
    cases = [(1, 0), (7, 1), (16, 16), (17, 12345), (4096, 3), (8191, 1), (8192, 0)]
    for tokens, first_pos in cases:
        checksum.compute(spare[1 : 1 + tokens], first_pos)
        checksum.compute(locs[:tokens], first_pos)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    return {
        "requests": 2 * len(cases),
        "cases_tokens_first_pos": cases,
        "kernel_variants_before": variants,
        "kernel_variants_compiled_after_startup": compiled_variants() - variants,
        "device_allocations_after_startup": after["allocation.all.allocated"]
        - before["allocation.all.allocated"],
        "device_segments_allocated_after_startup": after["segment.all.allocated"]
        - before["segment.all.allocated"],
    }


def gpu(reps: int, warmup: int, kernel_dir: str, out: str) -> None:
    sys.path.insert(0, build_package(kernel_dir))
    import torch

    from sglang.kernels.ops.memory.keyed_head_hash import (
        keyed_head_sums,
        keyed_head_sums_reference,
    )

    sides = {
        "prefill_last_stage_rank": (
            side(STAGE_MLA_LAYERS, DRAFT_HEADS // TP_P, TP_P),
            TOKENS * (2 * DRAFT_LAYERS * HEAD_DIM * 2) * TP_D // TP_P  # draft, 8 ranks
            + TOKENS * STAGE_MLA_LAYERS * LATENT * 2 * TP_D // TP_P,  # latent, 8 ranks
        ),
        "decode_rank": (
            side(MLA_LAYERS, DRAFT_HEADS // TP_D or 1, TP_D),
            TOKENS * (MLA_LAYERS * LATENT * 2 + 2 * DRAFT_LAYERS * HEAD_DIM * 2),
        ),
    }
    result = {"sides": {}}
    for name, ((checksum, locs, digested), linked) in sides.items():
        startup = after_startup(checksum, locs)  # before the tile sweep compiles others
        reference = keyed_head_sums_reference(checksum.buffers, locs, 100)
        rows = checksum.compute(locs, 100)
        equal = rows[:, 4].tolist() == [
            int(reference[i, h]) for i, b in enumerate(checksum.buffers)
            for h in range(b.data.shape[1])
        ]  # fmt: skip
        if not equal:
            raise SystemExit(f"{name}: the sums differ from the torch reference")
        samples = {"gpu_us": [], "host_us": []}
        for i in range(warmup + reps):
            # GPU: what compute launches (zero the sums, the kernel, the modulo).
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            keyed_head_sums(checksum.buffers, locs, 100, checksum.table, checksum.sums)
            end.record()
            torch.cuda.synchronize()
            # Host: all of compute, which ends with the sums' copy to the host.
            t0 = time.perf_counter()
            checksum.compute(locs, 100)
            host_us = (time.perf_counter() - t0) * 1e6
            if i >= warmup:
                samples["gpu_us"].append(start.elapsed_time(end) * 1e3)
                samples["host_us"].append(host_us)
        # The kernel's tile, for choosing keyed_head_sums' defaults (GPU time only).
        tiles = {}
        for tokens, words in ((16, 32), (32, 32), (64, 32), (32, 64), (16, 64)):
            times = []
            for i in range(warmup + reps // 5):
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                keyed_head_sums(
                    checksum.buffers, locs, 100, checksum.table, checksum.sums, tokens, words
                )
                end.record()
                torch.cuda.synchronize()
                if i >= warmup:
                    times.append(start.elapsed_time(end) * 1e3)
            tiles[f"tokens{tokens}_words{words}"] = provenance.summary(times)
        host_ms = statistics.median(samples["host_us"]) / 1e3
        result["sides"][name] = {
            "sums_equal_torch_reference": equal,
            "buffers": len(checksum.buffers),
            "bytes_digested": digested,
            "link_bytes": linked,
            "link_ms_at_50GBps": link_ms(linked),
            "gpu_us": provenance.summary(samples["gpu_us"]),
            "host_us": provenance.summary(samples["host_us"]),
            "digest_GBps": digested / (statistics.median(samples["gpu_us"]) * 1e3),
            "share_of_link": host_ms / link_ms(linked),
            "gpu_us_by_tile": tiles,
            "samples_us": samples,
            "after_startup": startup,
        }
    result.update(
        what="KvPlacementChecksum.compute as shipped, one 8192-token chunk, Kimi-K3 geometry",
        device_name=torch.cuda.get_device_name(),
        **provenance.record(
            repetitions=reps, warmup=warmup,
            timed_sources=[os.path.join(kernel_dir, n) for n in CARRIED]),
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    brief = {k: {m: v for m, v in s.items() if m != "samples_us"}
             for k, s in result["sides"].items()}  # fmt: skip
    print(json.dumps(brief, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--carry", metavar="DIR", help="copy the timed code into DIR (here)")
    mode.add_argument("--gpu", action="store_true")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--kernel-dir", help="--gpu: what --carry wrote")
    p.add_argument("--out")
    args = p.parse_args()
    if args.carry:
        carry(args.carry)
    else:
        gpu(args.reps, args.warmup, args.kernel_dir, args.out)


if __name__ == "__main__":
    main()
