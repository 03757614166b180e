"""Draft KV transfer over Mooncake TCP on 127.0.0.1: packed page runs vs per-token descriptors.

Geometry of the target deployment: prefill TP4 -> decode TP32, a 6-layer DFlash draft with
8 KV heads x 128 (bf16), page size 64, one 4096-token prompt. Prefill rank 1 (heads 2..3) sends
to its 8 decode ranks (8..15, one head each), in one run:

* packed: the plan's pack (``draft_kv_pack.pack_row_slices``) gathers each decode rank's head
  slice into a registered staging buffer, then one descriptor per destination page run and
  entry (``packed_descriptors``);
* per-token: one descriptor per token row and entry, pool to pool (``per_token_descriptors``),
  in batches of at most 1024 (the TCP transport refuses larger batches).

The decode process checks every byte of its 8 pools after every repetition and resets them.
Only our pure modules, torch, numpy and ``mooncake.engine`` are imported (no sglang), so the
same script runs on a GPU machine without sglang.

    python benchmark/draft_kv_transfer/bench_draft_kv_transfer.py [--reps-packed 5 --reps-per-token 3]

writes ``results.json`` and ``results.md`` next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
    DraftKVGeometry,
    DraftKVShape,
    KVComponent,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import as_byte_rows, pack_row_slices
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import (
    Descriptors,
    pack_source_rows,
    packed_descriptors,
    per_token_descriptors,
    plan_pair,
)

HEADS, HEAD_DIM, LAYERS, PAGE, TOKENS = 8, 128, 6, 64, 4096
PREFILL_TP, PREFILL_RANK, DECODE_TP = 4, 1, 32
DECODE_RANKS = list(range(8, 16))
N_PAGES = TOKENS // PAGE
POOL_PAGES = 2 * N_PAGES + 8
SRC_PAGES = list(range(70, 70 + N_PAGES))  # contiguous, as a fresh allocation gives
DST_PAGES = list(range(5, 5 + N_PAGES))
MAX_BATCH = 1024
SENTINEL = 0x5A
SHAPE = DraftKVShape(HEADS, HEAD_DIM, HEAD_DIM, 2)
ENTRIES = [KVComponent.K] * LAYERS + [KVComponent.V] * LAYERS
ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "2"}


def global_kv(entry: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(entry)
    return torch.randn(POOL_PAGES * PAGE, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)


def geometry(side: str, tp: int, rank: int) -> DraftKVGeometry:
    return DraftKVGeometry.for_rank(SHAPE, side=side, tp_size=tp, tp_rank=rank, page_size=PAGE)


def reply(obj) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def decode_main() -> None:
    from mooncake.engine import TransferEngine

    torch.set_num_threads(1)

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    pools, expected = {}, {}
    for r in DECODE_RANKS:
        g = geometry("decode", DECODE_TP, r)
        fused = [
            np.full(2 * POOL_PAGES * g.page_bytes(KVComponent.K), SENTINEL, np.uint8)
            for _ in range(LAYERS)
        ]
        assert (
            engine.batch_register_memory([a.ctypes.data for a in fused], [a.size for a in fused])
            == 0
        )
        pools[r] = fused
        want = []
        for layer in range(LAYERS):
            w = np.full(fused[layer].size, SENTINEL, np.uint8).reshape(2, POOL_PAGES * PAGE, -1)
            for half in (0, 1):
                rows = global_kv(half * LAYERS + layer)[
                    :, g.owned_heads.start : g.owned_heads.stop
                ].contiguous()
                src = np.asarray(SRC_PAGES)[:, None] * PAGE + np.arange(PAGE)
                dst = np.asarray(DST_PAGES)[:, None] * PAGE + np.arange(PAGE)
                w[half][dst.reshape(-1)] = as_byte_rows(rows).numpy()[src.reshape(-1)]
            want.append(w.reshape(-1))
        expected[r] = want
    ptrs = {
        str(r): [a.ctypes.data for a in pools[r]] + [a.ctypes.data + a.size // 2 for a in pools[r]]
        for r in DECODE_RANKS
    }
    reply({"session": f"127.0.0.1:{engine.get_rpc_port()}", "ptrs": ptrs})
    for line in sys.stdin:
        if json.loads(line)["cmd"] == "exit":
            return
        bad = [
            f"decode rank {r} layer {layer}"
            for r in DECODE_RANKS
            for layer in range(LAYERS)
            if not np.array_equal(pools[r][layer], expected[r][layer])
        ]
        for r in DECODE_RANKS:
            for a in pools[r]:
                a.fill(SENTINEL)
        reply({"bad": bad})


class DecodePeer:
    def __init__(self):
        env = dict(os.environ, **ENV)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--decode"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )

    def read(self, timeout=300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"decode peer exited ({self.proc.poll()})")
                if line.startswith("@@"):
                    return json.loads(line[2:])
        raise TimeoutError("decode peer gave no answer")

    def verify(self) -> list:
        self.proc.stdin.write('{"cmd": "verify"}\n')
        self.proc.stdin.flush()
        return self.read()["bad"]

    def close(self) -> None:
        try:
            self.proc.stdin.write('{"cmd": "exit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)
        except Exception:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def transfer(engine, session: str, d: Descriptors) -> int:
    calls = 0
    for batch in d.batches(MAX_BATCH):
        rc = engine.batch_transfer_sync_write(
            session, batch.src.tolist(), batch.dst.tolist(), batch.length.tolist()
        )
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
        calls += 1
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps-packed", type=int, default=5)
    parser.add_argument("--reps-per-token", type=int, default=3)
    parser.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    args = parser.parse_args()
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    # One intra-op thread: on a small shared CPU box OpenMP's spin-waits, not the copy, dominate
    # a 2-thread torch gather (92 ms vs 7 ms per 12 MiB here). The production pack runs on GPU.
    torch.set_num_threads(1)
    from mooncake.engine import TransferEngine

    src_geom = geometry("prefill", PREFILL_TP, PREFILL_RANK)
    pool = [
        global_kv(q)[:, src_geom.owned_heads.start : src_geom.owned_heads.stop].contiguous()
        for q in range(2 * LAYERS)
    ]
    rows = [as_byte_rows(t) for t in pool]
    slot_bytes = (
        12 * TOKENS * src_geom.head_bytes(KVComponent.K)
    )  # one decode rank's slice of every entry
    slot = torch.empty(slot_bytes, dtype=torch.uint8)

    decode = DecodePeer()
    try:
        hello = decode.read()
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        regions = [t.data_ptr() for t in pool] + [slot.data_ptr()]
        sizes = [t.numel() * 2 for t in pool] + [slot.numel()]
        assert engine.batch_register_memory(regions, sizes) == 0
        session = hello["session"]
        plans = {r: plan_pair(src_geom, geometry("decode", DECODE_TP, r)) for r in DECODE_RANKS}
        dst_ptrs = {r: hello["ptrs"][str(r)] for r in DECODE_RANKS}

        def send_packed():
            stats = {"descriptors": 0, "calls": 0, "bytes": 0, "pack_s": 0.0}
            for r in DECODE_RANKS:
                plan = plans[r]
                t0 = time.perf_counter()
                token_rows = torch.from_numpy(pack_source_rows(plan, SRC_PAGES))
                slabs = pack_row_slices(
                    rows,
                    token_rows,
                    [plan.src_offset(c) for c in ENTRIES],
                    [plan.width(c) for c in ENTRIES],
                    slot,
                )
                stats["pack_s"] += time.perf_counter() - t0
                d = Descriptors.concat(
                    [
                        packed_descriptors(plan, c, slot.data_ptr() + at, dst_ptrs[r][q], DST_PAGES)
                        for q, (c, at) in enumerate(zip(ENTRIES, slabs))
                    ]
                )
                stats["calls"] += transfer(engine, session, d)
                stats["descriptors"] += d.count
                stats["bytes"] += d.total_bytes
            return stats

        def send_per_token():
            stats = {"descriptors": 0, "calls": 0, "bytes": 0, "pack_s": 0.0}
            for r in DECODE_RANKS:
                d = Descriptors.concat(
                    [
                        per_token_descriptors(
                            plans[r], c, pool[q].data_ptr(), dst_ptrs[r][q], SRC_PAGES, DST_PAGES
                        )
                        for q, c in enumerate(ENTRIES)
                    ]
                )
                stats["calls"] += transfer(engine, session, d)
                stats["descriptors"] += d.count
                stats["bytes"] += d.total_bytes
            return stats

        results = {}
        for name, fn, reps in (
            ("packed", send_packed, args.reps_packed),
            ("per_token", send_per_token, args.reps_per_token),
        ):
            fn()  # warm-up (connections, page faults); checked like every repetition
            assert decode.verify() == [], f"{name}: wrong bytes on the decode"
            walls, packs, stats = [], [], None
            for _ in range(reps):
                t0 = time.perf_counter()
                stats = fn()
                walls.append(time.perf_counter() - t0)
                packs.append(stats.pop("pack_s"))
                bad = decode.verify()
                assert bad == [], f"{name}: wrong bytes on the decode: {bad[:3]}"
            results[name] = dict(
                stats,
                wall_s_median=statistics.median(walls),
                wall_s_all=walls,
                pack_s_median=statistics.median(packs),
                descriptors_per_decode_rank=stats["descriptors"] // len(DECODE_RANKS),
                bytes_per_decode_rank=stats["bytes"] // len(DECODE_RANKS),
                reps=reps,
            )
    finally:
        decode.close()

    minimum = 2 * LAYERS * TOKENS * HEAD_DIM * 2  # one head of every entry
    packed, per_token = results["packed"], results["per_token"]
    report = {
        "geometry": dict(
            prefill_tp=PREFILL_TP,
            prefill_rank=PREFILL_RANK,
            decode_tp=DECODE_TP,
            decode_ranks=DECODE_RANKS,
            draft_layers=LAYERS,
            kv_heads=HEADS,
            head_dim=HEAD_DIM,
            dtype="bfloat16",
            page_size=PAGE,
            prompt_tokens=TOKENS,
            pages="contiguous on both sides",
        ),
        "transport": "Mooncake TransferEngine TCP, 127.0.0.1, two processes, CPU buffers",
        "pack": "draft_kv_pack.pack_row_slices on CPU (torch index_select, 1 intra-op thread)",
        "machine": dict(
            python=platform.python_version(), cpus=os.cpu_count(), platform=platform.platform()
        ),
        "physical_minimum_bytes_per_decode_rank": minimum,
        "results": results,
        "ratios": dict(
            per_token_over_packed_descriptors=per_token["descriptors"] / packed["descriptors"],
            per_token_over_packed_wall=per_token["wall_s_median"] / packed["wall_s_median"],
        ),
    }
    assert packed["bytes_per_decode_rank"] == per_token["bytes_per_decode_rank"] == minimum
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    table = [
        "| variant | descriptors per decode rank | transfer calls (8 ranks) | bytes per decode rank | wall, 8 decode ranks (median) | of which packing (median) |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("packed", "per_token"):
        r = results[name]
        table.append(
            f"| {name.replace('_', '-')} | {r['descriptors_per_decode_rank']:,} | {r['calls']:,} | "
            f"{r['bytes_per_decode_rank']:,} | {r['wall_s_median'] * 1e3:,.1f} ms (n={r['reps']}) | "
            + (f"{r['pack_s_median'] * 1e3:,.1f} ms |" if r["pack_s_median"] else "none |")
        )
    ratios = report["ratios"]
    md = "\n".join(
        [
            "# Draft KV transfer: packed page runs vs per-token descriptors",
            "",
            f"Prefill TP{PREFILL_TP} rank {PREFILL_RANK} -> its 8 decode ranks at TP{DECODE_TP}; draft {LAYERS} "
            f"layers x {HEADS} KV heads x {HEAD_DIM}, bf16, page {PAGE}, one {TOKENS}-token prompt, pages "
            "contiguous. Mooncake TCP on 127.0.0.1 between two processes (CPU buffers). Every decode byte "
            "checked after every repetition; both variants move the physical minimum "
            f"({minimum:,} B per decode rank).",
            "",
            *table,
            "",
            f"Per-token / packed, same run: {ratios['per_token_over_packed_descriptors']:,.0f}x descriptors, "
            f"{ratios['per_token_over_packed_wall']:,.1f}x wall time.",
            "",
            "Loopback TCP on a small shared CPU machine: the descriptor counts are exact for this "
            "geometry (packed = 12 entries x 1 page run), the times only show that per-descriptor "
            "cost dominates on this transport; RDMA between GPUs has lower per-descriptor cost and "
            "a GPU pack. Wall time covers packing, descriptor generation and the synchronous "
            "transfers to all 8 decode ranks.",
            "",
            f"Machine: {os.cpu_count()} CPUs, {platform.platform()}. Command: "
            "`python benchmark/draft_kv_transfer/bench_draft_kv_transfer.py`.",
            "",
        ]
    )
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    if sys.argv[1:] == ["--decode"]:
        decode_main()
    else:
        main()
