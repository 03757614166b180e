"""What the placement-keyed KV checksum costs per 8192-token chunk at the Kimi-K3 geometry.

The shipped ``KvPlacementChecksum.compute`` (PR 09) times the sums of one request's tokens, on
both sides of a transfer:

- a prefill rank of the last PP stage (P = TP4 x PP8): the stage's 3 MLA layers (one 576-element
  bf16 latent per token) and the 6-layer draft's K and V, 2 of its 8 KV heads (head_dim 128);
- a decode rank (D = TP32): all 24 MLA layers and 1 draft head of each draft entry.

Each figure is set against the chunk's time on a 50 GB/s link: what the prefill rank sends for
the chunk (the draft heads to its 8 decode ranks, 201 MB, and the latent of its 3 layers to the
8 decode ranks it serves, 226 MB), and what a decode rank receives (251 MB).

The GPU machine has no sglang. ``--gpu`` builds a package directory holding the shipped
``keyed_head_hash.py`` and ``kv_placement_checksum.py`` from this tree, the wheel's
``gpu_tensor_hash.py`` (their one sglang import, carried in ``--kernel-dir``), and a stand-in
``sglang.srt.mem_cache.memory_pool`` whose pool classes are bare names: the checksum reads only
their buffer lists. It checks the sums against the torch reference, then times ``compute`` (the
launch, the device-to-host copy of the sums and the rows built from them) with CUDA events and
the host clock.

    python3 benchmark/kv_checksum/bench_placement_checksum.py --gpu --kernel-dir .carry/kernels \
        --reps 50 --warmup 10 --out benchmark/kv_checksum/results/placement_checksum_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
import provenance  # noqa: E402

TOKENS = 8192
PAGE = 64
POOL_PAGES = 4096
LATENT = 576  # kv_lora_rank 512 + rope 64
DRAFT_LAYERS, DRAFT_HEADS, HEAD_DIM = 6, 8, 128
MLA_LAYERS, STAGE_MLA_LAYERS = 24, 3
TP_P, TP_D = 4, 32
LINK_GBPS = 50.0
SHIPPED = (
    "python/sglang/kernels/ops/memory/keyed_head_hash.py",
    "python/sglang/srt/disaggregation/kv_placement_checksum.py",
)
POOL_STAND_IN = '''
class KVCache: pass
class MHATokenToKVPool(KVCache): pass
class MLATokenToKVPool(KVCache): pass
class HybridLinearKVPool(KVCache): pass
'''


def link_ms(nbytes: int) -> float:
    return nbytes / (LINK_GBPS * 1e9) * 1e3


def build_package(kernel_dir: str) -> str:
    root = tempfile.mkdtemp(prefix="checksum_pkg_")
    files = {
        "sglang/kernels/ops/memory/gpu_tensor_hash.py": os.path.join(
            kernel_dir, "gpu_tensor_hash.py"
        ),
        "sglang/kernels/ops/memory/keyed_head_hash.py": os.path.join(ROOT, SHIPPED[0]),
        "sglang/srt/disaggregation/kv_placement_checksum.py": os.path.join(ROOT, SHIPPED[1]),
    }
    for rel, src in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        shutil.copyfile(src, os.path.join(root, rel))
    os.makedirs(os.path.join(root, "sglang/srt/mem_cache"))
    with open(os.path.join(root, "sglang/srt/mem_cache/memory_pool.py"), "w") as f:
        f.write(POOL_STAND_IN)
    for folder, _, names in os.walk(os.path.join(root, "sglang")):
        if "__init__.py" not in names:
            open(os.path.join(folder, "__init__.py"), "w").close()
    return root


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
        **provenance.record(repetitions=reps, warmup=warmup, timed_sources=SHIPPED),
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    brief = {k: {m: v for m, v in s.items() if m != "samples_us"}
             for k, s in result["sides"].items()}  # fmt: skip
    print(json.dumps(brief, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", required=True)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--kernel-dir", required=True, help="holds the wheel's gpu_tensor_hash.py")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    gpu(args.reps, args.warmup, args.kernel_dir, args.out)


if __name__ == "__main__":
    main()
