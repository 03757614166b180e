"""The composed KV digest's host work on a Kimi-K3 prefill rank, before and after, in one run, on a
CPU: what the digest's Python costs the transfer worker beside it (the GIL), with the GPU's
part emulated.

Why on a CPU: the H200 figure (``benchmark/gpu/results/kv_digest_cost.json``, commit 2e5d668)
put a last chunk's exposed digest at 13.8% of its link time, and its breakdown put most of it in
host Python: the digest thread's descriptor resolution (16 lists, 1.3 ms), its block building,
its bookkeeping, and the worker waiting for the GIL they hold. Host Python runs on any CPU; this
measures it where no GPU is lent, through the code that ships, so two designs compare in one
run. It is not the H200 figure: this machine's Python is slower, and the GPU's part is a sleep.

What runs (``benchmark/gpu/kv_digest_cost.SendPath``, the GPU benchmark's own send path, at its
geometry: prefill rank 3 of the last PP stage -> decode ranks 24..31, a chunk of 128 pages of 64,
the MLA descriptors sglang 0.5.23 builds, the draft's ``add_draft_blocks``, the last chunk's KDA
state descriptors by sglang's own ``compute_mamba_state_slice_byte_blocks``): per decode rank the
hooks ``kv_digest_send.scope`` + ``batch_transfer_sync_around``, ``add_draft_blocks``, the state
scope, then the room's status wait (``flush``), over a link emulated at 50 GB/s (each transfer a
GIL-releasing ``time.sleep`` of its bytes' time, as Mooncake releases the GIL).

Stand-ins, and why: the prefill pools are CPU tensors; the digest engine's GPU call
(``DigestEngine.digest``) is a GIL-releasing sleep of ``ENGINE_FIXED_S + bytes /
ENGINE_BYTES_PER_S``, the H200's empty call (109 us) and kernel rate (2.05 TB/s) from
``kv_digest_cost.json`` (``direct_call_empty``, ``kernel_alone``); its host part (the table
fill, ~10-90 us on the H200 host) is not in the sleep. The sums are checked with the real CPU
engine instead (numpy over the CPU pools): ``before`` and ``after`` give every decode rank
equal contributions for a middle and a last chunk.

A what-if, not shipped: ``last_chunk_no_status_wait`` is a last chunk whose status does not wait
for the digest thread (its tail digested after; drained untimed), which is what a design that
holds the request's pages until the digest has read them, instead of holding the status, would
save. As it stands that is unsafe (the prefill frees the pages after the status).

``before`` is the project at ``--before`` (default ``00dab23``, descriptor lists resolved one
job per list on the digest thread), checked out into a temporary git worktree, run in a
subprocess; ``after`` the working tree. The two alternate, ``--rounds`` times each.

    .venv/bin/python benchmark/kv_digest/host_work.py [--reps 60 --warmup 10 --rounds 3]

writes ``host_work.json`` next to this file.
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
GPU_BENCH = os.path.join(ROOT, "benchmark", "gpu")
_D = "python/sglang_dflash_pp/srt/disaggregation/"
TIMED = [_D + f for f in ("kv_digest_send.py", "kv_digest.py", "kv_digest_thread.py",
                          "draft_kv_digest.py", "transfer_chunk.py", "mooncake_draft_kv.py")]  # fmt: skip
ENGINE_FIXED_S = 109.3e-6  # kv_digest_cost.json (2e5d668): direct_call_empty wall_s median
ENGINE_BYTES_PER_S = 2047.7e9  # kernel_alone GBps_median
POOL_PAGES = 160  # the chunk's 128 pages in runs of 16 (CPU memory: ~110 MB of pools)


def drive(reps: int, warmup: int, check: bool) -> dict:
    """Run in a subprocess whose ``sys.path`` starts with the project under test."""
    import numpy as np
    import torch

    import kv_digest_cost as bench

    g = bench.geometry()
    pools = bench.make_pools(g, torch.device("cpu"), POOL_PAGES, torch)
    pages = bench.chunk_pages(g, pool_pages=POOL_PAGES)
    slice_fn, slice_src = bench.slice_byte_blocks()
    sp = bench.send_path_of(g, pools, pages, "cpu", slice_fn)
    out = dict(state_slices=slice_src, bytes=dict(middle=sp.bytes(False), last=sp.bytes(True)))
    if check:  # the real CPU engine: the sums each decode rank would be sent
        sums = {}
        for name, last in (("middle", False), ("last", True)):
            room = next(sp.rooms)
            sp.chunk(room, None, last, link_bps=bench.LINK_BPS)
            sp.drain()
            sums[name] = {str(r): sorted([list(k), str(v)] for k, v in c.sums.items())
                          for r, c in sp.pop(room).items()}  # fmt: skip
        out["sums"] = sums
    engine = sp.engine
    calls = []

    def emulated(blocks, keys, wait_events=()):
        """The GPU call's time, the GIL released (the real one waits on its stream)."""
        nbytes = int((blocks.nbytes * blocks.rows).sum())
        calls.append(nbytes)
        time.sleep(ENGINE_FIXED_S + nbytes / ENGINE_BYTES_PER_S)
        return np.zeros(len(keys), dtype=np.uint64)

    engine.digest = emulated  # the code before 2026-12-03 (``--before``) calls the engine so
    if hasattr(type(engine), "submit"):  # since then the send path submits, its sums read later:
        from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import Sums

        # the GPU call's time spent at the submit (the thread's schedule reads each call's sums
        # in the same job)
        engine.submit = lambda blocks, keys, wait_events=(): Sums(emulated(blocks, keys, wait_events))
    thread = sp.manager._dflash_kv_digest.thread
    samples = {}
    kds = sp.kds
    shipped_flush = kds.flush

    def unsafe_flush(manager):
        """The what-if: the status does not wait for the digest (the tail still runs, on the
        thread, and is drained after the sample). Not safe as it stands: the prefill frees the
        request's pages after the status."""
        digest = kds.digest_of(manager)
        if digest is not None:
            digest.thread.submit(getattr(kds, "_digest_and_settle", None) or kds._digest_pending,
                                 kds._pending())  # fmt: skip
        return True

    variants = [(w, on) for w in ("middle", "last") for on in (True, False)] + [("last", "no_wait")]
    for i in range(warmup + reps):
        for k in range(len(variants)):
            what, on = variants[(i + k) % len(variants)]
            bench.TRANSFERS = []
            calls.clear()
            busy0 = thread.busy_s
            room = next(sp.rooms)
            t0 = time.perf_counter()
            kds.flush = unsafe_flush if on == "no_wait" else shipped_flush
            try:
                t_flush = sp.chunk(room, None, what == "last", link_bps=bench.LINK_BPS,
                                   digest=bool(on))  # fmt: skip
            finally:
                kds.flush = shipped_flush
            t1 = time.perf_counter()
            moved, bench.TRANSFERS = bench.TRANSFERS, None
            lag = sp.drain()
            if on:
                sp.pop(room)
            if i < warmup:
                continue
            in_transfers = sum(b - a for _, a, b in moved)
            name = {True: "on", False: "off", "no_wait": "on_no_status_wait"}[on]
            s = samples.setdefault(f"{what}_chunk_digest_{name}", {})
            for key, v in dict(
                wall_s=t1 - t0, status_wait_s=t1 - t_flush,
                worker_outside_transfers_s=(t_flush - t0) - in_transfers,
                transfers_late_s=sum((b - a) - want for want, a, b in moved),
                thread_busy_s=thread.busy_s - busy0, thread_lag_s=lag,
                engine_calls=len(calls), engine_bytes=sum(calls),
            ).items():  # fmt: skip
                s.setdefault(key, []).append(v)
    out["samples"] = samples
    out["failures"] = [str(f) for f in sp.failures]
    return out


def _run(root: str, reps: int, warmup: int, check: bool) -> dict:
    import before_after  # benchmark/, on the path (main)

    return before_after.run_driver(root, HERE, f"host_work.drive({reps}, {warmup}, {check})",
                                   extra_paths=(GPU_BENCH, os.path.dirname(GPU_BENCH)),
                                   timeout=3600)  # fmt: skip


def main() -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    import before_after
    import provenance

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", default="00dab23")
    parser.add_argument("--out", default=os.path.join(HERE, "host_work.json"))
    args = parser.parse_args()
    runs = {"before": [], "after": []}
    with before_after.worktree_at(args.before, "kv-digest-host-before-") as worktree:
        roots = {"before": worktree, "after": ROOT}
        for rnd in range(args.rounds):
            for name, root in roots.items():
                runs[name].append(_run(root, args.reps, args.warmup, check=rnd == 0))
                s = runs[name][-1]["samples"]
                print(name, rnd, {w: round(statistics.median(s[f"{w}_chunk_digest_on"]["wall_s"])
                                           - statistics.median(s[f"{w}_chunk_digest_off"]["wall_s"]), 6)
                                  for w in ("middle", "last")}, flush=True)  # fmt: skip
    same = runs["before"][0]["sums"] == runs["after"][0]["sums"]
    assert same, "the contributions differ between before and after"
    assert not any(r["failures"] for rs in runs.values() for r in rs), "a room failed"
    sys.path.insert(0, GPU_BENCH)
    from kv_digest_cost import LINK_BPS  # the GPU benchmark's link rate

    merged = {}
    for name, rs in runs.items():
        m = merged[name] = {}
        for r in rs:
            for variant, cols in r["samples"].items():
                for key, v in cols.items():
                    m.setdefault(variant, {}).setdefault(key, []).extend(v)
    link = {w: runs["after"][0]["bytes"][w] / LINK_BPS for w in ("middle", "last")}
    figures = {}
    for name, m in merged.items():
        # the shipped middle and last chunk, and the what-if: a last chunk whose status does
        # not wait for the digest (``unsafe_flush``)
        for w, variant, figure in (("middle", "on", "middle_chunk"), ("last", "on", "last_chunk"),
                                   ("last", "on_no_status_wait", "last_chunk_no_status_wait")):
            key, off_key = f"{w}_chunk_digest_{variant}", f"{w}_chunk_digest_off"
            on, off = m[key], m[off_key]
            exposed = statistics.median(on["wall_s"]) - statistics.median(off["wall_s"])
            per_round = [statistics.median(r["samples"][key]["wall_s"])
                         - statistics.median(r["samples"][off_key]["wall_s"])
                         for r in runs[name]]  # fmt: skip
            figures[f"{name}_{figure}"] = dict(
                exposed_s=exposed, over_link_time=exposed / link[w], link_s=link[w],
                exposed_per_round_s=per_round,
                median_on={k: statistics.median(v) for k, v in on.items()},
                median_off={k: statistics.median(v) for k, v in off.items()},
            )  # fmt: skip
    result = dict(
        provenance=provenance.record(
            repetitions=args.reps * args.rounds, warmup=args.warmup, timed_sources=TIMED,
            before_commit=args.before, rounds=args.rounds,
            stand_ins=("CPU pools; DigestEngine.digest emulated as a GIL-releasing sleep of "
                       f"{ENGINE_FIXED_S * 1e6:.1f} us + bytes / {ENGINE_BYTES_PER_S / 1e12:.2f} TB/s "
                       "(kv_digest_cost.json, 2e5d668: direct_call_empty, kernel_alone); Mooncake's "
                       "transfer a GIL-releasing sleep of bytes / 50 GB/s"),
        ),  # fmt: skip
        state_slices=runs["after"][0]["state_slices"],
        sums_equal_before_and_after=same,
        figures=figures,
        samples=merged,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for k, v in figures.items():
        print(k, f"exposed {v['exposed_s'] * 1e6:.0f} us = {100 * v['over_link_time']:.1f}% of "
                 f"{v['link_s'] * 1e3:.2f} ms; thread busy {v['median_on']['thread_busy_s'] * 1e6:.0f} us; "
                 f"status wait {v['median_on']['status_wait_s'] * 1e6:.0f} us")  # fmt: skip


if __name__ == "__main__":
    main()
