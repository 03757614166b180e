"""The shipped draft-KV send path's pack time per request on one GPU, against a device-to-device
copy of the same bytes, for the Kimi-K3 example (prefill TP4 -> decode TP32).

What runs: the plugin's own ``mooncake_draft_kv.send_draft_entries`` -- the function the hooked
``MooncakeKVManager.send_kvcache`` calls for the draft entries -- once per decode rank of one
prefill rank (its 8 decode ranks), chunk after chunk, inside the worker-chunk scope the hooked
``transfer_worker`` opens (``begin_chunk`` / ``end_chunk``), with the registration verdicts the
plugin computes for the example (``draft_kv_report.verdict``, i.e. ``peer_verdict``), the pack
buffer the plugin allocates (``_pack_buffer``, default size, 4 slots as sglang's default queue
count), and draft pools of the example's geometry in GPU memory.

What does not run, and why: sglang cannot be installed on the GPU machine, so the manager is a
stand-in holding the attributes of sglang's ``MooncakeKVManager`` that the draft send path reads
(``kv_args``, ``transfer_infos``, ``decode_kv_args_table``, ``max_transfer_batch_indices``,
``_transfer_data``), and sglang's own loop over a chunk's decode ranks is this script's loop.
``_transfer_data`` (the engine call) records the descriptors and, in the checked pass, compares
the bytes each one would send with an independent gather; it moves nothing. The target MLA
entries are not part of it.

Timed per request (the example's 4096- and 32768-token prompts, chunks of the example's
``--chunked-prefill-size``), each sample after flushing the L2 cache:

* ``pack``: wall time of every pack step of the request (row upload, pack launch, wait for the
  stream: the body of ``PackSlot.on_stream``), i.e. what the transfer worker waits for;
* ``send``: wall time of the whole request through ``send_draft_entries`` (packs, descriptors,
  the recorded transfer calls);
* ``copy``: ``dst.copy_(src)`` of the same number of bytes per chunk, then a synchronize;
* the same for the per-send path (no chunk scope: one pack per decode rank, the behaviour before
  packs were shared);
* kernel alone: the chunk's pack launch and the copy, each replayed from a CUDA graph.

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
from sglang_dflash_pp.tools import examples  # noqa: E402
from sglang_dflash_pp.tools.draft_kv_report import DraftKVTopology, verdict  # noqa: E402

TIMED = [
    "python/sglang_dflash_pp/srt/disaggregation/mooncake_draft_kv.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_chunk_packs.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_pack.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_pack_triton.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_plan.py",
]
PREFILL_RANK = 1
QUEUES = 4  # sglang's SGLANG_DISAGGREGATION_QUEUE_SIZE default: one pack slot per queue


class ManagerStandIn:
    """The attributes of sglang's ``MooncakeKVManager`` that the draft send path reads."""

    def __init__(self, entry_ptrs, item_lens, page_size):
        self.kv_args = SimpleNamespace(
            kv_data_ptrs=list(entry_ptrs),
            kv_item_lens=list(item_lens),
            num_draft_entries=len(entry_ptrs),
            page_size=page_size,
        )
        self.engine = SimpleNamespace(batch_register=lambda ptrs, lens: 0)
        self.transfer_queues = [None] * QUEUES
        self.transfer_infos, self.decode_kv_args_table = {}, {}
        self.failed_sessions, self.state_layout_rejections = set(), {}
        self.max_transfer_batch_indices = 0
        self.check = None  # callable(session, blocks) in the checked pass
        self.descriptors = 0

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
    def on_stream(slot):
        t0 = time.perf_counter()
        with real(slot):
            yield
        samples.append(time.perf_counter() - t0)

    draft_kv_pack.PackSlot.on_stream = on_stream
    try:
        yield
    finally:
        draft_kv_pack.PackSlot.on_stream = real


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="4096,32768")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the same code (no graphs)")
    args = ap.parse_args()

    ex = examples.load("kimi-k3")
    draft = ex.config("draft")
    heads, dim = int(draft["num_key_value_heads"]), int(draft["head_dim"])
    layers, page = int(draft["num_hidden_layers"]), ex.page_size
    p_tp, d_tp = int(ex.prefill_arg("--tp-size")), ex.decode_tp_size
    chunk_tokens = int(ex.prefill_arg("--chunked-prefill-size"))
    shape = DraftKVShape(total_heads=heads, k_head_dim=dim, v_head_dim=dim, dtype_bytes=2)
    topo = DraftKVTopology(shape, layers, page, p_tp, d_tp, pp_size=int(ex.prefill_arg("--pp-size")))
    ranks = [r for r in range(d_tp) if PREFILL_RANK in prefill_ranks_for(r, prefill_tp=p_tp, decode_tp=d_tp)]
    plans = {r: verdict(topo, PREFILL_RANK, r) for r in ranks}
    src_geom = topo.geometry("prefill", PREFILL_RANK)

    prompts = [int(t) for t in args.prompts.split(",")]
    max_pages = max(prompts) // page
    pool_pages = 2 * max_pages + 8
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    h_p = src_geom.heads_per_rank
    bufs = [
        torch.randn(pool_pages * page + page, h_p, dim, device=dev, generator=g).to(torch.bfloat16)
        for _ in range(2 * layers)
    ]
    pool = Pool(bufs[:layers], bufs[layers:])
    ptrs = [b.data_ptr() for b in bufs]
    record_draft_kv_source(DraftKVSource(tuple(ptrs), shape, None, weakref.ref(pool)))
    m = ManagerStandIn(ptrs, topo.item_lens(src_geom), page)
    mooncake_draft_kv._pack_buffer(m, mooncake_draft_kv.draft_kv_source_for(m.kv_args))
    buffer = m._dflash_draft_kv_pack_buffer
    sessions = {r: f"decode-rank-{r}" for r in ranks}
    dst_bases = {r: [(1 + r) * (1 << 40) + q * (1 << 34) for q in range(2 * layers)] for r in ranks}
    for r in ranks:
        m.decode_kv_args_table[sessions[r]] = SimpleNamespace(dflash_draft_kv_plan=plans[r])

    flush = torch.empty((512 << 20) if cuda else 1, dtype=torch.uint8, device=dev)

    def l2_flush():
        flush.fill_(1)
        sync()

    def request_chunks(tokens, first_page):
        pages = tokens // page
        per = chunk_tokens // page
        return [
            (np.arange(first_page + s, first_page + min(s + per, pages), dtype=np.int64),
             np.arange(3 + s, 3 + min(s + per, pages), dtype=np.int64))
            for s in range(0, pages, per)
        ]  # fmt: skip

    def send_request(chunks, shared: bool, room: int):
        for c, (src, dst) in enumerate(chunks):
            chunk = SimpleNamespace(room=(room, c))
            m.transfer_infos[chunk.room] = {sessions[r]: SimpleNamespace(is_dummy=False) for r in ranks}
            if shared:
                mooncake_draft_kv.begin_chunk(m, chunk)
            for r in ranks:
                ret = mooncake_draft_kv.send_draft_entries(m, plans[r], sessions[r], src, dst, dst_bases[r])
                assert ret == 0, ret
            if shared:
                mooncake_draft_kv.end_chunk()
            del m.transfer_infos[chunk.room]

    def checker(chunks_by_session):
        """Compare each descriptor's source bytes (in the pack slot, at send time) with an
        independent gather: the decode rank's head of the pool rows of those pages."""
        slot_all = buffer.tensor
        stats = {"descriptors": 0, "bytes": 0}

        def check(session, blocks):
            r = next(k for k, s in sessions.items() if s == session)
            src_pages, dst_pages = chunks_by_session["current"]
            head = plans[r].pair.heads.start - src_geom.head_start
            for s, d, n in blocks:
                q = max(i for i, b in enumerate(dst_bases[r]) if b <= d)
                item = page * dim * 2
                pos = (d - dst_bases[r][q]) // item - int(dst_pages[0])
                pages = src_pages[pos : pos + n // item]
                rows = torch.from_numpy((pages[:, None] * page + np.arange(page)).reshape(-1)).to(dev)
                want = bufs[q][rows][:, head, :].contiguous().view(torch.uint8).reshape(-1)
                got = slot_all[s - buffer.ptr : s - buffer.ptr + n]
                assert torch.equal(got, want), f"decode rank {r} entry {q}: wrong bytes"
                stats["descriptors"] += 1
                stats["bytes"] += n

        return check, stats

    fused = draft_kv_pack_triton.eligible(
        [draft_kv_pack.as_byte_rows(b) for b in bufs],
        [plans[ranks[0]].pair.src_offset(e.component) for e in plans[ranks[0]].entries],
        [plans[ranks[0]].pair.width(e.component) for e in plans[ranks[0]].entries],
        buffer.tensor,
    )
    results = {}
    for tokens in prompts:
        chunks = request_chunks(tokens, first_page=max_pages + 4)
        packed_bytes = [
            len(src) * page * sum(
                plans[r].pair.width(e.component) for e in plans[r].entries
            ) * len({plans[r].pair.heads for r in ranks})
            for src, _ in chunks
        ]  # fmt: skip
        # Checked pass: every descriptor's bytes, both paths.
        check_state = {}
        check, check_stats = checker(check_state)
        m.check = check
        for shared in (True, False):
            for c, (src, dst) in enumerate(chunks):
                check_state["current"] = (src, dst)
                send_request([(src, dst)], shared, room=-1 - c)
        m.check = None
        expected_bytes = 2 * len(ranks) * 2 * layers * tokens * dim * 2  # both paths, each rank's head
        assert check_stats["bytes"] == expected_bytes, (check_stats, expected_bytes)

        src_copy = torch.empty(sum(packed_bytes), dtype=torch.uint8, device=dev).random_(0, 255)
        dst_copy = torch.empty(max(packed_bytes), dtype=torch.uint8, device=dev)

        def copy_request():
            t, at = 0.0, 0
            for nbytes in packed_bytes:
                t0 = time.perf_counter()
                dst_copy[:nbytes].copy_(src_copy[at : at + nbytes])
                sync()
                t += time.perf_counter() - t0
                at += nbytes
            return t

        samples = {k: [] for k in ("pack_shared", "send_shared", "pack_per_send", "send_per_send", "copy", "sync_only")}
        steps = {"shared": [], "per_send": []}
        for i in range(args.warmup + args.reps):
            keep = i >= args.warmup
            for name, shared in (("shared", True), ("per_send", False)):
                packs = []
                l2_flush()
                with timed_pack_steps(packs):
                    t0 = time.perf_counter()
                    send_request(chunks, shared, room=i)
                    wall = time.perf_counter() - t0
                if keep:
                    samples[f"pack_{name}"].append(sum(packs))
                    samples[f"send_{name}"].append(wall)
                    steps[name].append(len(packs))
            l2_flush()
            t = copy_request()
            if keep:
                samples["copy"].append(t)
                t0 = time.perf_counter()
                sync()
                samples["sync_only"].append(time.perf_counter() - t0)

        # Kernel alone: the shared path's one launch for a full chunk, and the copy, from graphs.
        src0, _ = chunks[0]
        slices = sorted(
            {mooncake_draft_kv._head_slice(m, plans[r]) for r in ranks}, key=lambda s: s.heads.start
        )
        sources = [draft_kv_pack.as_byte_rows(b) for b in bufs]
        flat = [sources[q] for s in slices for q in s.src_entries]
        offs = [o for s in slices for o in s.byte_offsets]
        widths = [w for s in slices for w in s.byte_widths]
        rows = torch.from_numpy(draft_kv_chunk_packs.token_rows(src0, page)).to(dev)
        out = buffer.tensor[: buffer.slot_bytes]
        graph_ms = {}
        for name, fn in () if not cuda else (
            ("pack", lambda: draft_kv_pack.pack_row_slices(flat, rows, offs, widths, out)),
            ("copy", lambda: dst_copy[: packed_bytes[0]].copy_(src_copy[: packed_bytes[0]])),
        ):
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            per = []
            for _ in range(args.reps):
                l2_flush()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                torch.cuda.synchronize()
                per.append(a.elapsed_time(b))
            graph_ms[name] = per

        # What bounds the wall time: the shipped graph of the first chunk's pack, replayed and
        # waited for alone, and the copy, each right after other GPU work ("busy") and after
        # the GPU sat idle for 5 ms (as it does while the host builds the previous decode
        # ranks' descriptors); the per-chunk pack step in the send path starts after such a gap.
        bound = {}
        if cuda:
            n_rows0 = len(src0) * page
            bucket0 = max(draft_kv_pack_triton.GraphedPack.MIN_BUCKET, 1 << (n_rows0 - 1).bit_length())
            slot0, gp = next(
                (sl, g)
                for sl in list(buffer._free.queue)
                for g in sl.graphed.values()
                if g is not None and bucket0 in g._graphs
            )
            graph0 = gp._graphs[bucket0][0]

            def pack_graph():
                t0 = time.perf_counter()
                with torch.cuda.stream(slot0.stream):
                    graph0.replay()
                slot0.stream.synchronize()
                return time.perf_counter() - t0

            def copy_once():
                t0 = time.perf_counter()
                dst_copy[: packed_bytes[0]].copy_(src_copy[: packed_bytes[0]])
                sync()
                return time.perf_counter() - t0

            for name, fn in (("pack_graph_replay", pack_graph), ("copy", copy_once)):
                for when in ("busy", "after_5ms_idle"):
                    per = []
                    for i in range(args.warmup + args.reps):
                        l2_flush()
                        if when != "busy":
                            time.sleep(0.005)
                        t = fn()
                        if i >= args.warmup:
                            per.append(t)
                    bound[f"{name}_{when}_s"] = dict(samples=per, **provenance.summary(per))

        summ = {k: provenance.summary(v) for k, v in samples.items()}
        ratio = lambda a: [c / p for c, p in zip(samples["copy"], samples[a])]  # noqa: E731
        results[str(tokens)] = dict(
            chunks=[len(s) * page for s, _ in chunks],
            bytes_packed_per_chunk_shared=packed_bytes,
            pack_steps_per_request=dict(shared=steps["shared"][0], per_send=steps["per_send"][0]),
            descriptors_checked=check_stats["descriptors"],
            bytes_checked=check_stats["bytes"],
            samples_s=samples,
            summary_s=summ,
            copy_over_pack_shared=dict(
                of_medians=summ["copy"]["median"] / summ["pack_shared"]["median"],
                per_sample=provenance.summary(ratio("pack_shared")),
            ),
            copy_over_pack_per_send=dict(
                of_medians=summ["copy"]["median"] / summ["pack_per_send"]["median"],
                per_sample=provenance.summary(ratio("pack_per_send")),
            ),
            wall_bound_first_chunk=bound,
            kernel_alone_first_chunk_graph_ms=dict(
                samples=graph_ms,
                **{k: provenance.summary(v) for k, v in graph_ms.items()},
            ),
        )
        print(json.dumps({tokens: dict(summary_s=summ, ratio=results[str(tokens)]["copy_over_pack_shared"])}, indent=1), flush=True)

    report = dict(
        provenance=provenance.record(
            repetitions=args.reps,
            warmup=args.warmup,
            timed_sources=TIMED,
            timed=(
                "mooncake_draft_kv.send_draft_entries for prefill rank "
                f"{PREFILL_RANK}'s {len(ranks)} decode ranks per chunk, in the worker-chunk scope "
                "(begin_chunk/end_chunk) the hooked transfer_worker opens; pack steps timed as the "
                "body of PackSlot.on_stream (row upload, launch, stream wait); L2 flushed before "
                "every request and every copy"
            ),
            not_timed=(
                "sglang's MooncakeKVManager and its transfer_worker loop (sglang cannot be installed "
                "on the GPU machine): a stand-in manager holds the attributes the draft send path "
                "reads; _transfer_data records descriptors and moves no bytes; target MLA entries"
            ),
        ),
        geometry=dict(
            example="kimi-k3",
            prefill_tp=p_tp,
            prefill_rank=PREFILL_RANK,
            decode_tp=d_tp,
            decode_ranks=ranks,
            distinct_head_slices=len({plans[r].pair.heads for r in ranks}),
            draft_layers=layers,
            kv_heads=heads,
            head_dim=dim,
            dtype="bfloat16",
            page_size=page,
            chunked_prefill_size=chunk_tokens,
            pack_buffer_bytes=buffer.nbytes,
            pack_slot_bytes=buffer.slot_bytes,
            fused_triton_kernel=bool(fused),
            cuda_graph_packs=sorted(
                bucket
                for slot in list(buffer._free.queue)
                for g in slot.graphed.values()
                if g is not None
                for bucket in g._graphs
            ),
        ),
        results=results,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
