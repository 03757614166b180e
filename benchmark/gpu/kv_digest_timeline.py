"""When, inside a Kimi-K3 last chunk's sends, the worker waits for the GIL the digest thread holds:
a timeline of the shipped send path over the emulated link (``kv_digest_cost``'s ``SendPath``:
the same geometry, hooks, digest thread and Triton engine).

``kv_digest_cost.json`` splits a last chunk's exposed time into the worker's time outside its
transfers, its transfers returning late and its wait at the status, and finds most of it is the
GIL. This script says which of the thread's work it collides with. Per sample (a last chunk,
digest on, then the same sends with it off), with ``time.perf_counter``:

* each transfer of the worker: its start, the time it asked for (bytes / 50 GB/s, a
  ``time.sleep`` that releases the GIL, as Mooncake's transfer does) and when it returned, the
  GIL taken back (``kv_digest_cost._over_link``'s record);
* each job of the digest thread (``DigestThread._timed``: its kind, start, end) and each engine
  call (``DigestEngine.submit``: the host time to queue the kernel; its sums are read later);
* the status's wait (``flush``);
* with Mooncake's asynchronous batch API (the shipped schedule), each window the worker digests
  in (``kv_digest_send._digest_window``), with its resolving of the queued sends
  (``_signed_parts``) and its engine calls: a window that outlasts the time its transfer had
  left returns that transfer late.

A transfer is *late* by (return - start - asked); it ended *in a job* when a digest job was
running when its time was up. The worker's stretches outside transfers are split by whether a
job ran during them. Summaries are medians over the samples; the first samples' timelines are
kept whole.

    PYTHONPATH=python:benchmark python3 benchmark/gpu/kv_digest_timeline.py --out benchmark/gpu/results/kv_digest_timeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kv_digest_cost as cost  # noqa: E402

KEPT_TIMELINES = 5


def _spans_at(spans, t):
    return [s for s in spans if s[1] <= t < s[2]]


def _overlap(spans, a, b):
    return sum(max(0.0, min(b, e) - max(a, s)) for _, s, e in spans)


def one_chunk(sp, room, event, on, last=True):
    """One chunk over the link (a room's last, or a middle one): its transfers, the thread's
    jobs, the worker's windows, the resolving of queued sends and the engine calls, the flush;
    times relative to the chunk's start."""
    thread = sp.manager._dflash_kv_digest.thread
    engine = sp.engine
    kds = sp.kds
    jobs, calls, windows, resolves = [], [], [], []
    real_timed, real_submit = thread._timed, engine.submit
    real_window, real_signed = kds._digest_window, kds._signed_parts

    def window(*a):
        t0 = time.perf_counter()
        try:
            return real_window(*a)
        finally:
            windows.append(("window", t0, time.perf_counter()))

    def signed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_signed(*a, **k)
        finally:
            resolves.append(("resolve", t0, time.perf_counter()))

    def timed(fn, *a):
        t0 = time.perf_counter()
        try:
            real_timed(fn, *a)
        finally:
            jobs.append((getattr(fn, "__name__", "?"), t0, time.perf_counter()))

    def submit(blocks, keys, wait_events=()):
        t0 = time.perf_counter()
        try:
            return real_submit(blocks, keys, wait_events=wait_events)
        finally:
            calls.append(("engine", t0, time.perf_counter()))

    thread._timed, engine.submit = timed, submit
    kds._digest_window, kds._signed_parts = window, signed
    cost.TRANSFERS = []
    try:
        t0 = time.perf_counter()
        t_flush = sp.chunk(room, event, last, link_bps=cost.LINK_BPS, digest=on)
        t1 = time.perf_counter()
        moved = cost.TRANSFERS
        cost.TRANSFERS = None
        sp.drain()  # the jobs the chunk left are on its timeline too
    finally:
        cost.TRANSFERS = None
        thread._timed = real_timed
        del engine.submit
        kds._digest_window, kds._signed_parts = real_window, real_signed
    if on:
        sp.pop(room)
    rel = lambda spans: [(n, a - t0, b - t0) for n, a, b in spans]  # noqa: E731
    return dict(wall=t1 - t0, flush_at=t_flush - t0, transfers=[(w, a - t0, b - t0) for w, a, b in moved],
                jobs=rel(jobs), engine_calls=rel(calls), windows=rel(windows),
                resolves=rel(resolves))  # fmt: skip


def submit_steps(sp, rooms, kv_written, args):
    """Where an engine call's host time goes inside a last chunk's windows, a separate pass (the
    marks record CUDA events: not in the timelines above): ``DeviceDigest``'s marks, host clock,
    each step's time from the mark before it, per submit; medians over the pass's submits."""
    import provenance

    dig = sp.engine._gpu
    steps = {}
    for i in range(args.warmup + args.reps // 2):
        dig.trace = []
        try:
            one_chunk(sp, next(rooms), kv_written(), True, True)
        finally:
            trace, dig.trace = dig.trace, None
        if i < args.warmup:
            continue
        prev = None
        for label, t, _ in trace:
            if label != "start" and prev is not None:
                steps.setdefault(label, []).append(t - prev)
            prev = t
    return {k: provenance.summary(v) for k, v in steps.items()}


def window_split(c):
    """The worker's windows of a chunk against the transfers they ran in (seconds): how many,
    their time, its resolving and engine calls, and by how much they outlasted the time their
    transfer had left (the tail's window, at the status, has no transfer: ``tail_window``)."""
    n = busy = over = tail = 0.0
    n_over = 0
    inside = lambda spans, a, b: sum(max(0.0, min(b, e) - max(a, s)) for _, s, e in spans)  # noqa: E731
    resolve = engine = 0.0
    for _, a, b in c.get("windows", ()):
        resolve += inside(c.get("resolves", ()), a, b)
        engine += inside(c["engine_calls"], a, b)
        hosting = [(w, s) for w, s, e in c["transfers"] if s <= a < e]
        if not hosting:
            tail += b - a
            continue
        n += 1
        busy += b - a
        want, s = hosting[0]
        lag = (b - a) - (s + want - a)
        if lag > 0:
            over += lag
            n_over += 1
    return dict(windows=n, window_busy=busy, window_resolve=resolve, window_engine=engine,
                window_overrun=over, windows_overrun=n_over, tail_window=tail)  # fmt: skip


def analyse(c):
    """A chunk's timeline as the split the docstring describes (seconds)."""
    jobs = [j for j in c["jobs"] if j[1] < c["wall"]]
    late_in_job, late_idle, n_in_job = 0.0, 0.0, 0
    by_kind = {}
    outside_in_job, outside_idle, prev_end = 0.0, 0.0, 0.0
    for want, a, b in c["transfers"]:
        late = (b - a) - want
        running = _spans_at(jobs, a + want)
        if running:
            late_in_job += late
            n_in_job += 1
            kind = running[0][0]
            by_kind[kind] = by_kind.get(kind, 0.0) + late
        else:
            late_idle += late
        gap_job = _overlap(jobs, prev_end, a)
        outside_in_job += gap_job
        outside_idle += (a - prev_end) - gap_job
        prev_end = b
    gap_job = _overlap(jobs, prev_end, c["flush_at"])
    outside_in_job += gap_job
    outside_idle += (c["flush_at"] - prev_end) - gap_job
    return dict(wall=c["wall"], flush_wait=c["wall"] - c["flush_at"], transfers=len(c["transfers"]),
                transfers_ending_in_a_job=n_in_job, late_in_a_job=late_in_job, late_otherwise=late_idle,
                outside_while_a_job_ran=outside_in_job, outside_otherwise=outside_idle,
                thread_jobs=len(jobs), thread_busy=sum(e - s for _, s, e in jobs),
                engine_calls=len(c["engine_calls"]), **window_split(c),
                **{f"late_in_{k}": v for k, v in by_kind.items()})  # fmt: skip


ROWS = (("wall", "wall"), ("flush_wait", "the wait at the status"),
        ("outside_otherwise", "outside the transfers, no digest job running"),
        ("outside_while_a_job_ran", "outside the transfers while a digest job ran"),
        ("late_otherwise", "transfers late, ending with no job running"),
        ("late_in_a_job", "transfers late, ending while a job ran"),
        ("thread_busy", "the digest thread's jobs"),
        ("window_busy", "the worker's windows (its digest inside its transfers)"),
        ("window_resolve", "... of which resolving the queued sends"),
        ("window_engine", "... of which engine calls"),
        ("window_overrun", "the windows' time past their transfer's end"),
        ("tail_window", "the tail's window, at the status"))  # fmt: skip


def _overruns(c, spans="jobs"):
    """Each job (or window) of a timeline against the transfer it started in: (name, start,
    length, the transfer's remaining time when it started, by how much it outlasted it)."""
    out = []
    for name, a, b in (j for j in c.get(spans, ()) if j[1] < c["wall"]):
        inside = [(w, s, e) for w, s, e in c["transfers"] if s <= a < e]
        left = (inside[0][1] + inside[0][0] - a) if inside else 0.0
        out.append((name, a, b - a, left, (b - a) - left))
    return out


def _chunk_section(summary, what, summ):
    on, off = summary["digest_on"], summary["digest_off"]
    out = [f"Per {what} over the emulated link, microseconds, median (min-max) of "
           f"{on['wall']['n']} samples each, alternating:", "",
           "| | digest on | digest off | on - off (medians) |", "|---|---|---|---|"]
    zero = {"median": 0.0, "min": 0.0, "max": 0.0}
    for k, label in ROWS:
        if k not in on and k not in off:
            continue  # a run before this row was timed
        a, b = on.get(k, zero), off.get(k, zero)
        out.append(f"| {label} | {summ(a, 1e6, '{:.0f}')} | {summ(b, 1e6, '{:.0f}')} | "
                   f"{(a['median'] - b['median']) * 1e6:+.0f} |")
    n, n_job = on["transfers"]["median"], on["transfers_ending_in_a_job"]["median"]
    windows = (f"; the worker digested in {on['windows']['median']:.0f} of its transfers, "
               f"{on['windows_overrun']['median']:.0f} (median) of those windows outlasting the "
               "transfer" if "windows" in on else "")
    out += ["", f"Transfers per chunk: {n:.0f}, of which {n_job:.0f} (median) ended while a digest job "
            f"ran; {on['thread_jobs']['median']:.0f} jobs, {on['engine_calls']['median']:.0f} engine "
            f"calls{windows}. A transfer that ended with no job running was as late as with the digest "
            f"off ({on['late_otherwise']['median'] / max(n - n_job, 1) * 1e6:.0f} against "
            f"{off['late_otherwise']['median'] / off['transfers']['median'] * 1e6:.0f} us each, medians "
            "over the count: the emulating sleep's own overshoot).", ""]
    return out


def _first_timeline(c, what):
    out = []
    for spans, label in (("jobs", "digest thread's jobs"), ("windows", "worker's windows")):
        rows = _overruns(c, spans)
        if not rows:
            continue
        out += [f"The first {what}'s {label} (µs from the chunk's start; the transfer they started "
                "in had this much of its time left; overrun = how much longer they ran):", "",
                "| what | start | length | its transfer's time left | overrun |", "|---|---|---|---|---|"]
        for n, a, length, left, over in rows:
            n = "set (the status's wait marker)" if n == "set" else n
            n = "window at the status (no transfer)" if n == "window" and not left else n
            out.append(f"| `{n}` | {a * 1e6:.0f} | {length * 1e6:.0f} | {left * 1e6:.0f} | "
                       f"{over * 1e6:+.0f} |")
        out.append("")
    out += [f"Its transfers asked for {min(w for w, _, _ in c['transfers']) * 1e6:.0f}-"
            f"{max(w for w, _, _ in c['transfers']) * 1e6:.0f} us each; the status's wait began at "
            f"{c['flush_at'] * 1e6:.0f} and the chunk ended at {c['wall'] * 1e6:.0f}."]
    return out


def section(r, origin, summ, name="kv_digest_timeline.json"):
    """The results page's section (``report.py`` passes its provenance and summary renderers)."""
    wait = r.get("link_wait", {}).get("used", "sleep")
    how = cost.link_wait.HOW[wait]
    out = [f"## Where a Kimi-K3 chunk's digest meets the worker: a timeline ({how})", "",
           *origin(name, r["provenance"]), "", f"Timed: {r['provenance']['timed']}.", ""]
    out += _chunk_section(r["summary"], "last chunk", summ)
    if r["timelines"]:
        out += _first_timeline(r["timelines"][0], "last chunk")
    middle = r.get("middle")
    if middle:
        out += ["", *_chunk_section(middle["summary"], "middle chunk", summ)]
        if middle["timelines"]:
            out += _first_timeline(middle["timelines"][0], "middle chunk")
    steps = r.get("submit_steps")
    if steps:
        names = {"lane": "taking a lane", "filled": "its stream entered, the KV-written events waited on, keys and table "
                           "into the pinned buffer",
                 "uploaded": "the upload queued", "launched": "the kernel launched",
                 "downloaded": "the sums' download queued and the event recorded"}  # fmt: skip
        out += ["", "An engine call's host time inside a last chunk's windows (a separate pass of "
                f"{r['provenance']['repetitions'] // 2} last chunks with `DeviceDigest`'s marks, "
                "which record CUDA events themselves; µs per call, median (min-max)): "
                + "; ".join(f"{names.get(k, k)} {summ(v, 1e6)}" for k, v in steps.items()) + "."]
    return out


def main():
    import torch

    import provenance

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (host engine)")
    ap.add_argument("--wait", choices=("sleep", "spin"), default="sleep",
                    help="how each emulated transfer waits (link_wait): asleep, or on its core as "
                         "Mooncake's polling wait does")  # fmt: skip
    args = ap.parse_args()
    if cost.WAITS[args.wait] is None:
        raise SystemExit(f"--wait {args.wait}: {cost.link_wait.describe()[args.wait]}")
    cost.WAIT_UNTIL = cost.WAITS[args.wait]
    g = cost.geometry()
    dev = torch.device(args.device)
    pools = cost.make_pools(g, dev, cost.PREFILL_POOL_PAGES, torch)
    pages = cost.chunk_pages(g)
    slice_fn, _ = cost.slice_byte_blocks()
    sp = cost.send_path_of(g, pools, pages, dev, slice_fn)
    on_gpu = dev.type == "cuda"
    forward = torch.cuda.Stream() if on_gpu else None
    flush_buf = torch.empty(512 << 20, dtype=torch.uint8, device=dev) if on_gpu else None

    def kv_written():
        return cost.l2_flush_event(torch, forward, flush_buf) if on_gpu else None

    rooms = iter(range(10_000, 10_000_000))

    def timelines(last):
        """Samples of one chunk kind, digest on and off alternating: (summary, kept timelines)."""
        out = {True: [], False: []}
        kept = []
        for i in range(args.warmup + args.reps):
            for on in (True, False) if i % 2 else (False, True):
                c = one_chunk(sp, next(rooms), kv_written(), on, last)
                if not last:
                    sp.drain()  # a middle chunk's leftovers, off its timeline's clock
                if i >= args.warmup:
                    out[on].append(analyse(c))
                    if on and len(kept) < KEPT_TIMELINES:
                        kept.append(c)
        summary = {}
        for on, rows in out.items():
            keys = sorted({k for r in rows for k in r})
            summary["digest_on" if on else "digest_off"] = {
                k: provenance.summary([r.get(k, 0.0) for r in rows]) | {"samples": [r.get(k, 0.0) for r in rows]}
                for k in keys}  # fmt: skip
        return summary, kept

    summary, kept = timelines(True)
    middle, middle_kept = timelines(False)
    steps = submit_steps(sp, rooms, kv_written, args) if on_gpu else None
    result = dict(
        provenance=provenance.record(
            repetitions=args.reps, warmup=args.warmup, timed_sources=cost.TIMED,
            timed="kv_digest_cost.SendPath.chunk (the shipped send path of a last chunk, then of a "
                  "middle chunk, 8 decode ranks, over a 50 GB/s link emulated by a GIL-releasing "
                  "sleep, or with --wait spin a GIL-free spin on the thread's core), digest on and "
                  "off alternating; DigestThread._timed, DigestEngine.submit, "
                  "kv_digest_send._digest_window and _signed_parts wrapped to time-stamp the "
                  "thread's jobs, the engine calls, the worker's windows and their resolving"),
        link_wait=dict(used=args.wait, **cost.link_wait.describe()),
        summary=summary, timelines=kept,
        middle=dict(summary=middle, timelines=middle_kept), submit_steps=steps)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    counts = ("transfers", "transfers_ending_in_a_job", "thread_jobs", "engine_calls", "windows",
              "windows_overrun")
    if steps:
        print("submit steps (us):", {k: round(v["median"] * 1e6, 1) for k, v in steps.items()})
    for chunk, summ in (("last", summary), ("middle", middle)):
        for name, s in summ.items():
            print(chunk, name, {k: round(v["median"] * 1e6) if k not in counts else v["median"]
                                for k, v in s.items()})


if __name__ == "__main__":
    main()
