"""GPU-only properties of the shipped draft-KV send path on one GPU: the KV-write fence, nothing
allocated or compiled while serving, and no OOM beside a forward's allocations.

Through the plugin's own code: the staging the prefill builds at startup
(``draft_kv_staging.build_staging``), ``kv_write_fence.record_kv_written`` and the
``MooncakeKVSender.send`` hook's choice of ``wait_event`` (``kv_write_fence.send_around``), and
``mooncake_draft_kv.send_draft_entries`` per decode rank in the worker-chunk scope
(``begin_chunk`` / ``end_chunk``), on the stand-in manager of ``pack_send_path.py`` (sglang cannot
be installed on the GPU machine). torch streams stand in for sglang's: a ``forward`` stream that
writes the chunk's draft KV, and the transfer thread's host synchronisation of the chunk's
``wait_event`` (sglang's ``transfer_worker``, one line here).

1. **Race.** The forward stream spins ~100 ms, then writes 7 into the chunk's rows of every draft
   entry (0 before). The chunk is sent at once, as sglang sends a middle chunk right after its
   forward was launched; the bytes each descriptor would send are read from the slot. Cases: no
   fence (stock: the chunk carries no event from the forward; its ``indices_event`` is on the
   schedule stream, which under ``--pp-async-batch-depth >= 1`` or ``SGLANG_PP_COMM_OVERLAP=1``
   has not waited on the forward); the fence with sglang's host wait; the fence with the pack's
   side-stream wait alone (no host wait).
2. **Nothing allocated, compiled or captured after startup.** Chunk sizes 1..129 pages, two
   geometries (TP4 -> TP32: 2 head slices per chunk; TP1 -> TP8: 8 slices, a new slab offset for
   nearly every chunk size), through the send path: the CUDA caching allocator's allocation
   count, the pack kernel's compiled-variant count and the ``CUDAGraph.capture_begin`` calls
   during the sweep.
3. **OOM probe.** A thread drives the send path over new chunk sizes while this thread, with half
   the free memory cached by the allocator, allocates 80% of it (a forward's activation peak): the
   allocator must free its cache and retry. Then the same allocation while another thread holds a
   CUDA graph capture open (what the previous send path did on first use of a pack bucket; the
   review that found it saw a 67 GiB allocation fail during a held capture and succeed after).

    PYTHONPATH=python python3 benchmark/gpu/send_path_fence.py --out benchmark/gpu/results/send_path_fence.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import provenance  # noqa: E402
import pack_send_path as psp  # noqa: E402

from sglang_dflash_pp.srt.disaggregation import draft_kv_pack_triton, kv_write_fence  # noqa: E402

TIMED = psp.TIMED + ["python/sglang_dflash_pp/srt/disaggregation/kv_write_fence.py"]
SPIN_CYCLES = 200_000_000  # ~100 ms at the H200's ~1.98 GHz


def compiled_variants() -> int:
    """Compiled specialisations of the pack kernel, over every device (Triton 3.x layout)."""
    fn = draft_kv_pack_triton._pack_rows_kernel
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in getattr(fn, "cache", {}).values())


def allocations() -> int:
    return int(torch.cuda.memory_stats().get("allocation.all.allocated", 0))


def sender_wait_event(written_reqs):
    """The ``wait_event`` the hooked ``MooncakeKVSender.send`` puts on the chunk (the stock send
    body, which hands it to ``add_transfer_request``, is what the lambda stands for)."""
    sender = written_reqs[0].disagg_kv_sender
    return kv_write_fence.send_around(lambda self: self._early_send_wait_event, sender)


def race(s, cases):
    pages = 128
    src = np.arange(4, 4 + pages, dtype=np.int64)
    dst = np.arange(3, 3 + pages, dtype=np.int64)
    rows = torch.from_numpy((src[:, None] * s.page + np.arange(s.page)).reshape(-1)).to(s.dev)
    forward = torch.cuda.Stream(s.dev)
    out = {}
    for case in cases:
        for b in s.bufs:
            b[rows] = 0
        torch.cuda.synchronize()
        seen = {"bytes": 0, "stale": 0}
        slot_all, base = s.staging.buffer.tensor, s.staging.buffer.ptr

        def check(session, blocks):
            for sp, _, n in blocks:
                got = slot_all[sp - base : sp - base + n].view(torch.bfloat16)
                seen["bytes"] += n
                seen["stale"] += int((got != 7).sum().item()) * 2

        s.m.check = check
        reqs = [SimpleNamespace(disagg_kv_sender=SimpleNamespace(_early_send_wait_event=None))]
        with torch.cuda.stream(forward):
            torch.cuda._sleep(SPIN_CYCLES)
            for b in s.bufs:
                b.index_fill_(0, rows, 7)
            if case != "no fence":
                kv_write_fence.record_kv_written(reqs, s.dev)
        wait_event = sender_wait_event(reqs)
        t0 = time.perf_counter()
        psp.send_chunk(s, src, dst, room=("race", case), wait_event=wait_event,
                       host_sync=case == "fence, sglang's host wait")  # fmt: skip
        send_s = time.perf_counter() - t0
        s.m.check = None
        forward.synchronize()
        out[case] = dict(seen, stale_fraction=seen["stale"] / max(1, seen["bytes"]), send_s=send_s,
                         chunk_carried_an_event=wait_event is not None)  # fmt: skip
        print("race", case, out[case], flush=True)
    return out


def sweep(s, sizes, room):
    for n in sizes:
        src = np.arange(2, 2 + n, dtype=np.int64)
        dst = np.arange(1 + n % 5, 1 + n % 5 + n, dtype=np.int64)
        psp.send_chunk(s, src, dst, room=(room, n))


def no_alloc_no_compile(geometries):
    out = {}
    for name, s in geometries.items():
        sizes = list(range(1, 130, 4)) + [129]
        torch.cuda.synchronize()
        captures = []
        real_begin = torch.cuda.CUDAGraph.capture_begin

        def counting_begin(self, *a, **k):
            captures.append(1)
            return real_begin(self, *a, **k)

        a0, c0 = allocations(), compiled_variants()
        torch.cuda.CUDAGraph.capture_begin = counting_begin
        try:
            sweep(s, sizes, room=name)
        finally:
            torch.cuda.CUDAGraph.capture_begin = real_begin
        torch.cuda.synchronize()
        a1, c1 = allocations(), compiled_variants()
        slices = len({s.sends[r].head_slice for r in s.ranks})
        out[name] = dict(
            chunk_pages=sizes, distinct_head_slices=slices, packs_prepared_at_startup=s.staging.warmed,
            graphs_captured_at_startup=s.staging.graphs, staging_startup_s=s.startup_s,
            cuda_allocations_during=a1 - a0, kernel_variants_compiled_during=c1 - c0,
            graph_captures_during=len(captures), kernel_variants_total=c1,
        )  # fmt: skip
        print("no alloc / no compile", name, out[name], flush=True)
    return out


def oom_probe(s, reps: int):
    free, _ = torch.cuda.mem_get_info()
    cached = int(free * 0.45)
    peak = int(free * 0.80)
    results = {}

    def attempt(label, background):
        ok = fail = 0
        errors = []
        for _ in range(reps):
            block = torch.empty(cached, dtype=torch.uint8, device=s.dev)
            del block  # now cached by the allocator, not returned to the driver
            stop, started = threading.Event(), threading.Event()
            t = threading.Thread(target=background, args=(stop, started))
            t.start()
            assert started.wait(10)
            try:
                x = torch.empty(peak, dtype=torch.uint8, device=s.dev)
                x.fill_(1)
                del x
                ok += 1
            except torch.OutOfMemoryError as e:
                fail += 1
                errors.append(str(e).splitlines()[0][:200])
            finally:
                stop.set()
                t.join()
            torch.cuda.synchronize()
        results[label] = dict(allocations_ok=ok, out_of_memory=fail, first_errors=errors[:2],
                              cached_bytes=cached, peak_bytes=peak, free_bytes_at_start=free)  # fmt: skip
        print("oom probe", label, results[label], flush=True)

    def send_path(stop, started):
        n = 1
        sweep(s, [n], room="oom")
        started.set()
        while not stop.is_set():
            sweep(s, [n], room="oom")
            n = n % 129 + 7

    def held_capture(stop, started):
        side = torch.cuda.Stream(s.dev)
        x = torch.zeros(1024, device=s.dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                x.add_(1)
                started.set()  # the allocation below happens while this capture is open
                stop.wait(5.0)
            finally:
                graph.capture_end()

    attempt("send path running (shipped)", send_path)
    attempt("a CUDA graph capture held open on another thread (counterfactual)", held_capture)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--oom-reps", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    k3 = psp.setup("cuda", 200)
    wide = psp.setup("cuda", 200, p_tp=1, d_tp=8, prefill_rank=0)
    race_out = race(k3, ["no fence", "fence, sglang's host wait", "fence, pack stream wait only"])
    alloc_out = no_alloc_no_compile({"TP4 rank 1 -> TP32": k3, "TP1 -> TP8": wide})
    oom_out = oom_probe(k3, args.oom_reps)
    report = dict(
        provenance=provenance.record(
            repetitions=args.oom_reps, warmup=0, timed_sources=TIMED,
            stand_ins=(
                "sglang's MooncakeKVManager (pack_send_path.ManagerStandIn) and transfer_worker "
                "loop (pack_send_path.send_chunk: the chunk scope, sglang's host wait of the "
                "chunk's wait_event, the sends); torch streams for sglang's forward stream; the "
                "sender whose send hook picks the wait_event"
            ),
        ),  # fmt: skip
        race=race_out,
        nothing_allocated_or_compiled_after_startup=alloc_out,
        oom_probe=oom_out,
        wall_s=time.perf_counter() - t0,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
