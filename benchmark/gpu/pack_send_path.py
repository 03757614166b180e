"""The shipped draft-KV send path's pack time per request on one GPU, against a device-to-device
copy of the same bytes, for the Kimi-K3 example (prefill TP4 -> decode TP32); and the pack the
path ships (CUDA graphs captured at startup) against an eager launch of the same kernel.

What runs: the plugin's own ``mooncake_draft_kv.send_draft_entries`` -- the function the hooked
``MooncakeKVManager.send_kvcache`` calls for the draft entries -- once per decode rank of one
prefill rank (its 8 decode ranks), chunk after chunk, inside the worker-chunk scope the hooked
``transfer_worker`` opens (``begin_chunk`` / ``end_chunk``), with the registration verdicts the
plugin computes for the example (``draft_kv_report.verdict``, i.e. ``peer_verdict``) and what the
registration hook derives from them (``DraftSend.of``), and the staging the prefill builds at
startup (``draft_kv_staging.build_staging``: 4 slots as sglang's default queue count, sized from
the example's chunk, every pack prepared and its kernel compiled before the first request).

What does not run, and why: sglang cannot be installed on the GPU machine, so the manager is a
stand-in holding the attributes of sglang's ``MooncakeKVManager`` that the draft send path reads,
and sglang's own loop over a chunk's decode ranks is this script's loop. ``_transfer_data`` (the
engine call) records the descriptors and, in the checked pass, compares the bytes each one would
send with an independent gather; it moves nothing. The target MLA entries are not part of it.

Timed per request (the example's 4096- and 32768-token prompts, chunks of the example's
``--chunked-prefill-size``), each sample after flushing the L2 cache:

* ``pack``: wall time of every pack step of the request (the rows into the slot's pinned buffer,
  the graph replay, wait for the stream: the body of ``PackSlot.on_stream``), i.e. what the
  transfer worker waits for;
* ``send``: wall time of the whole request through ``send_draft_entries``;
* ``copy``: ``dst.copy_(src)`` of the same number of bytes per chunk, then a synchronize;
* graph vs eager, first chunk: the shipped pack (the CUDA graph of the row upload and the launch
  that the staging captured at startup, replayed) against an eager launch of the same prepared
  Triton kernel, each right after other GPU work and after 5 ms of GPU idleness, wall and GPU
  (event) time: the measurement the choice of graphs rests on.

    PYTHONPATH=python python3 benchmark/gpu/pack_send_path.py --out benchmark/gpu/results/pack_send_path.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import weakref
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import provenance  # noqa: E402

from sglang_dflash_pp.srt.disaggregation import (  # noqa: E402
    draft_kv_chunk_packs,
    draft_kv_pack,
    draft_kv_pack_triton,
    mooncake_draft_kv,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVShape  # noqa: E402
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import prefill_ranks_for  # noqa: E402
from sglang_dflash_pp.srt.disaggregation.draft_kv_source import (  # noqa: E402
    DraftKVSource,
    record_draft_kv_source,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_staging import build_staging  # noqa: E402
from sglang_dflash_pp.tools import examples  # noqa: E402
from sglang_dflash_pp.tools.draft_kv_report import DraftKVTopology, verdict  # noqa: E402

TIMED = [
    "python/sglang_dflash_pp/srt/disaggregation/mooncake_draft_kv.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_chunk_packs.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_pack.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_pack_triton.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_plan.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_staging.py",
]
PREFILL_RANK = 1
QUEUES = 4  # sglang's SGLANG_DISAGGREGATION_QUEUE_SIZE default: one pack slot per queue


class ManagerStandIn:
    """The attributes of sglang's ``MooncakeKVManager`` that the draft send path reads."""

    def __init__(self, entry_ptrs, entry_lens, item_lens, page_size):
        self.kv_args = SimpleNamespace(
            kv_data_ptrs=list(entry_ptrs),
            kv_data_lens=list(entry_lens),
            kv_item_lens=list(item_lens),
            num_draft_entries=len(entry_ptrs),
            page_size=page_size,
        )
        self.transfer_infos, self.decode_kv_args_table, self.request_status = {}, {}, {}
        self.failed_sessions, self.state_layout_rejections = set(), {}
        self.max_transfer_batch_indices = 0
        self.attn_tp_rank, self.pp_rank = PREFILL_RANK, 0
        self.failures = []
        self.check = None  # callable(session, blocks) in the checked pass
        self.descriptors = 0

    def conclude_failure(self, bootstrap_room, failure_reason, targets=None):
        self.failures.append((bootstrap_room, failure_reason))

    def _transfer_data(self, session, blocks):
        self.descriptors += len(blocks)
        if self.check is not None:
            self.check(session, blocks)
        return 0


class Pool:
    """The two buffer lists of sglang's MHATokenToKVPool that ``DraftKVSource`` reads."""

    def __init__(self, k, v):
        self.k_buffer, self.v_buffer = k, v


@contextlib.contextmanager
def timed_pack_steps(samples: list):
    """Time the body of every ``PackSlot.on_stream`` (row upload, pack launch, stream wait)."""
    real = draft_kv_pack.PackSlot.on_stream

    @contextlib.contextmanager
    def on_stream(slot, written=()):
        t0 = time.perf_counter()
        with real(slot, written):
            yield
        samples.append(time.perf_counter() - t0)

    draft_kv_pack.PackSlot.on_stream = on_stream
    try:
        yield
    finally:
        draft_kv_pack.PackSlot.on_stream = real


def setup(device: str, max_pages: int, p_tp=None, d_tp=None, prefill_rank=PREFILL_RANK):
    """The example's prefill rank 1 (or another TP pair of the same draft): its pools on
    ``device``, the staging its startup builds, the stand-in manager with every decode rank's
    registration (verdict and ``DraftSend``)."""
    ex = examples.load("kimi-k3")
    draft = ex.config("draft")
    heads, dim = int(draft["num_key_value_heads"]), int(draft["head_dim"])
    layers, page = int(draft["num_hidden_layers"]), ex.page_size
    p_tp = p_tp or int(ex.prefill_arg("--tp-size"))
    d_tp = d_tp or ex.decode_tp_size
    chunk_tokens = int(ex.prefill_arg("--chunked-prefill-size"))
    shape = DraftKVShape(total_heads=heads, k_head_dim=dim, v_head_dim=dim, dtype_bytes=2)
    topo = DraftKVTopology(shape, layers, page, p_tp, d_tp, pp_size=int(ex.prefill_arg("--pp-size")))
    ranks = [r for r in range(d_tp) if prefill_rank in prefill_ranks_for(r, prefill_tp=p_tp, decode_tp=d_tp)]
    src_geom = topo.geometry("prefill", prefill_rank)
    pool_pages = 2 * max_pages + 8
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    bufs = [
        torch.randn(pool_pages * page + page, src_geom.heads_per_rank, dim, device=dev,
                    generator=g).to(torch.bfloat16)
        for _ in range(2 * layers)
    ]  # fmt: skip
    pool = Pool(bufs[:layers], bufs[layers:])
    ptrs = [b.data_ptr() for b in bufs]
    source = DraftKVSource(tuple(ptrs), shape, None, weakref.ref(pool))
    t0 = time.perf_counter()
    staging = build_staging(source, src_geom, chunk_tokens=chunk_tokens, num_slots=QUEUES)
    startup_s = time.perf_counter() - t0
    record_draft_kv_source(DraftKVSource(tuple(ptrs), shape, None, weakref.ref(pool), staging))
    m = ManagerStandIn(ptrs, [b.numel() * 2 for b in bufs], topo.item_lens(src_geom), page)
    m.attn_tp_rank = prefill_rank
    sessions = {r: f"decode-rank-{r}" for r in ranks}
    dst_bases = {r: [(1 + r) * (1 << 40) + q * (1 << 34) for q in range(2 * layers)] for r in ranks}
    sends = {}
    for r in ranks:
        plan = verdict(topo, prefill_rank, r)
        sends[r] = mooncake_draft_kv.DraftSend.of(m, plan, dst_bases[r])
        m.decode_kv_args_table[sessions[r]] = SimpleNamespace(_dflash_draft_kv_send=sends[r])
    return SimpleNamespace(
        ex=ex, topo=topo, ranks=ranks, src_geom=src_geom, bufs=bufs, pool=pool, staging=staging,
        startup_s=startup_s, m=m, sessions=sessions, dst_bases=dst_bases, sends=sends, page=page,
        dim=dim, layers=layers, chunk_tokens=chunk_tokens, dev=dev, heads=heads, p_tp=p_tp,
        d_tp=d_tp,
    )  # fmt: skip


def send_chunk(s, src, dst, room, wait_event=None, host_sync=True):
    """One chunk to every decode rank, as sglang's worker loop sends it: the hooked queue's
    ``get`` opens the chunk scope (``begin_chunk``), then sglang synchronises the chunk's
    ``wait_event`` on the host (``mooncake/conn.py`` ~2537; ``host_sync=False`` leaves only the
    pack's own stream wait), then sends to each decode rank."""
    m = s.m
    chunk = SimpleNamespace(room=room, wait_event=wait_event)
    m.request_status[room] = 3  # KVPoll.Transferring
    m.transfer_infos[room] = {s.sessions[r]: SimpleNamespace(is_dummy=False) for r in s.ranks}
    mooncake_draft_kv.begin_chunk(m, chunk)
    if host_sync and chunk.wait_event is not None:
        chunk.wait_event.synchronize()
    try:
        for r in s.ranks:
            ret = mooncake_draft_kv.send_draft_entries(m, s.sends[r], s.sessions[r], src, dst)
            assert ret == 0 and not m.failures, (ret, m.failures)
    finally:
        mooncake_draft_kv.end_chunk()
        del m.transfer_infos[room]
        del m.request_status[room]


def request_chunks(s, tokens, first_page):
    pages = tokens // s.page
    per = s.chunk_tokens // s.page
    return [
        (np.arange(first_page + i, first_page + min(i + per, pages), dtype=np.int64),
         np.arange(3 + i, 3 + min(i + per, pages), dtype=np.int64))
        for i in range(0, pages, per)
    ]  # fmt: skip


def checker(s, current):
    """Compare each descriptor's source bytes (in the pack slot, at send time) with an
    independent gather: the decode rank's head of the pool rows of those pages."""
    slot_all = s.staging.buffer.tensor
    base = s.staging.buffer.ptr
    stats = {"descriptors": 0, "bytes": 0}

    def check(session, blocks):
        r = next(k for k, v in s.sessions.items() if v == session)
        src_pages, dst_pages = current["chunk"]
        head = s.sends[r].plan.pair.heads.start - s.src_geom.head_start
        for src, d, n in blocks:
            q = max(i for i, b in enumerate(s.dst_bases[r]) if b <= d)
            item = s.page * s.dim * 2
            pos = (d - s.dst_bases[r][q]) // item - int(dst_pages[0])
            pages = src_pages[pos : pos + n // item]
            rows = torch.from_numpy((pages[:, None] * s.page + np.arange(s.page)).reshape(-1)).to(s.dev)
            want = s.bufs[q][rows][:, head, :].contiguous().view(torch.uint8).reshape(-1)
            got = slot_all[src - base : src - base + n]
            assert torch.equal(got, want), f"decode rank {r} entry {q}: wrong bytes"
            stats["descriptors"] += 1
            stats["bytes"] += n

    return check, stats


def eager_vs_graph(s, src_pages, reps, warmup, flush):
    """The shipped pack of the chunk's whole partition (the graph ``PreparedPacks.warm`` captured
    at startup, replayed through ``pack_slices``) against an eager launch of the same prepared
    kernel (the row upload from the slot's pinned buffer, then ``FusedPack.__call__``): wall
    (host) and GPU time, each right after other GPU work and after 5 ms of GPU idleness."""
    staging, slot = s.staging, s.staging.buffer.take()
    try:
        partition = next(iter(staging.prepared.partitions.values()))
        pack = staging.prepared.pack(partition)
        rows = draft_kv_chunk_packs.token_rows(src_pages, s.page)

        def shipped():
            draft_kv_chunk_packs.pack_slices(slot, 0, partition, staging.prepared, rows)

        def eager():
            with slot.on_stream():
                pack(slot.rows(rows), slot.buffer, 0)

        out = {}
        for name, fn in (("graph_replay_shipped", shipped), ("eager_launch", eager)):
            for when in ("busy", "after_5ms_idle"):
                wall, gpu = [], []
                for i in range(warmup + reps):
                    flush()
                    if when != "busy":
                        time.sleep(0.005)
                    a = torch.cuda.Event(enable_timing=True)
                    b = torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter()
                    a.record(slot.stream)
                    fn()
                    t = time.perf_counter() - t0
                    b.record(slot.stream)
                    b.synchronize()
                    if i >= warmup:
                        wall.append(t)
                        gpu.append(a.elapsed_time(b) / 1e3)
                out[f"{name}_{when}"] = dict(
                    wall_s=dict(samples=wall, **provenance.summary(wall)),
                    gpu_s=dict(samples=gpu, **provenance.summary(gpu)),
                )
        return out
    finally:
        staging.buffer.give_back(slot)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="4096,32768")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the same code")
    args = ap.parse_args()

    prompts = [int(t) for t in args.prompts.split(",")]
    s = setup(args.device, max(prompts) // 64)
    cuda = s.dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    flush_buf = torch.empty((512 << 20) if cuda else 1, dtype=torch.uint8, device=s.dev)

    def l2_flush():
        flush_buf.fill_(1)
        sync()

    fused = isinstance(
        s.staging.prepared.pack(next(iter(s.staging.prepared.partitions.values()))),
        draft_kv_pack_triton.FusedPack,
    )
    results = {}
    for tokens in prompts:
        chunks = request_chunks(s, tokens, first_page=tokens // s.page + 4)
        distinct = len({s.sends[r].head_slice for r in s.ranks})
        packed_bytes = [
            len(src) * s.page * s.sends[s.ranks[0]].head_slice.bytes_per_row() * distinct
            for src, _ in chunks
        ]
        current = {}
        check, check_stats = checker(s, current)
        s.m.check = check
        for c, (src, dst) in enumerate(chunks):
            current["chunk"] = (src, dst)
            send_chunk(s, src, dst, room=-1 - c)
        s.m.check = None
        expected_bytes = len(s.ranks) * 2 * s.layers * tokens * s.dim * 2  # each rank's head
        assert check_stats["bytes"] == expected_bytes, (check_stats, expected_bytes)

        src_copy = torch.empty(sum(packed_bytes), dtype=torch.uint8, device=s.dev).random_(0, 255)
        dst_copy = torch.empty(max(packed_bytes), dtype=torch.uint8, device=s.dev)

        def copy_request():
            t, at = 0.0, 0
            for nbytes in packed_bytes:
                t0 = time.perf_counter()
                dst_copy[:nbytes].copy_(src_copy[at : at + nbytes])
                sync()
                t += time.perf_counter() - t0
                at += nbytes
            return t

        samples = {k: [] for k in ("pack", "send", "copy")}
        steps = []
        for i in range(args.warmup + args.reps):
            keep = i >= args.warmup
            packs = []
            l2_flush()
            with timed_pack_steps(packs):
                t0 = time.perf_counter()
                for c, (src, dst) in enumerate(chunks):
                    send_chunk(s, src, dst, room=(i, c))
                wall = time.perf_counter() - t0
            l2_flush()
            t = copy_request()
            if keep:
                samples["pack"].append(sum(packs))
                samples["send"].append(wall)
                samples["copy"].append(t)
                steps.append(len(packs))
        summ = {k: provenance.summary(v) for k, v in samples.items()}
        results[str(tokens)] = dict(
            chunks=[len(src) * s.page for src, _ in chunks],
            bytes_packed_per_chunk=packed_bytes,
            pack_steps_per_request=steps[0],
            descriptors_checked=check_stats["descriptors"],
            bytes_checked=check_stats["bytes"],
            samples_s=samples,
            summary_s=summ,
            copy_over_pack=dict(
                of_medians=summ["copy"]["median"] / summ["pack"]["median"],
                per_sample=provenance.summary(
                    [c / p for c, p in zip(samples["copy"], samples["pack"])]
                ),
            ),
            graph_vs_eager_first_chunk=(
                eager_vs_graph(s, chunks[0][0], args.reps, args.warmup, l2_flush) if cuda else None
            ),
        )
        print(json.dumps({tokens: dict(summary_s=summ, copy_over_pack=results[str(tokens)]["copy_over_pack"])}, indent=1), flush=True)

    report = dict(
        provenance=provenance.record(
            repetitions=args.reps,
            warmup=args.warmup,
            timed_sources=TIMED,
            timed=(
                "mooncake_draft_kv.send_draft_entries for prefill rank "
                f"{PREFILL_RANK}'s {len(s.ranks)} decode ranks per chunk, in the worker-chunk "
                "scope (begin_chunk/end_chunk) the hooked transfer_worker opens; pack steps timed "
                "as the body of PackSlot.on_stream (rows, graph replay, stream wait); L2 "
                "flushed before every request and every copy"
            ),
            not_timed=(
                "sglang's MooncakeKVManager and its transfer_worker loop (sglang cannot be "
                "installed on the GPU machine): a stand-in manager holds the attributes the draft "
                "send path reads; _transfer_data records descriptors and moves no bytes; target "
                "MLA entries. The eager variant is this script's launch of the shipped prepared "
                "kernel (the shipped path replays graphs)"
            ),
        ),
        geometry=dict(
            example="kimi-k3", prefill_tp=s.p_tp, prefill_rank=PREFILL_RANK, decode_tp=s.d_tp,
            decode_ranks=s.ranks, distinct_head_slices=len({s.sends[r].head_slice for r in s.ranks}),
            draft_layers=s.layers, kv_heads=s.heads, head_dim=s.dim, dtype="bfloat16",
            page_size=s.page, chunked_prefill_size=s.chunk_tokens,
            pack_buffer_bytes=s.staging.buffer.nbytes, pack_slot_bytes=s.staging.buffer.slot_bytes,
            fused_triton_kernel=fused, packs_prepared_at_startup=s.staging.warmed,
            graphs_captured_at_startup=s.staging.graphs,
            staging_startup_s=s.startup_s,
        ),  # fmt: skip
        results=results,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
