"""Host time of the draft-KV send path per transfer chunk, before and after, in one run.

What is timed: the Python work one prefill transfer worker does for one chunk of the Kimi-K3
example (prefill TP4 rank 1 -> its 8 decode ranks of TP32, 12 draft entries, an 8192-token chunk
of 128 pages of 64), through the plugin's own ``mooncake_draft_kv.send_draft_entries`` inside the
worker-chunk scope the hooked ``transfer_worker`` opens (``begin_chunk`` ... ``end_chunk``): the
chunk's readers, the slot, the shared-slab bookkeeping and every decode rank's descriptors. It
runs on the transfer thread beside the scheduler, under the GIL, on the last PP stage (the
straggler), so it is the figure that matters; the issue's goal is at most 0.3 ms.

What is not timed, and why: the pack's device work (``draft_kv_chunk_packs.pack_slices`` is
replaced by a stub that returns the slab offsets the real pack returns; on a CPU the torch gather
of 48 MiB would be all there is to see, and on the GPU it is asynchronous device work timed by
``benchmark/gpu/pack_send_path.py``), and the transfer engine (``_transfer_data`` records the
descriptors and returns 0). Registrations go through sglang 0.5.23's real, hooked
``MooncakeKVManager._publish_peer_registration`` on a manager shell (``object.__new__`` plus the
attributes the path reads), as in ``bench_draft_kv_transfer.py``.

``before`` runs the same driver against the project at ``--before`` (default ``db84bfe``, the
last commit with the previous send path: descriptors built entry by entry, the draft geometry
re-validated per call), checked out into a temporary git worktree, in a subprocess; ``after`` the
working tree. Both record every decode rank's descriptors of the first chunk, and the run checks
that they are identical.

    python benchmark/draft_kv_transfer/host_time.py [--reps 300 --warmup 30]

writes ``host_time.json`` next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HEADS, HEAD_DIM, LAYERS, PAGE, CHUNK = 8, 128, 6, 64, 8192
PREFILL_TP, PREFILL_RANK, DECODE_TP = 4, 1, 32
DECODE_RANKS = list(range(8, 16))
N_PAGES = CHUNK // PAGE
POOL_PAGES = N_PAGES + 8
SRC_PAGES = list(range(3, 3 + N_PAGES))
DST_PAGES = list(range(40, 40 + N_PAGES))
DRAFT_LAYER_IDS = [100 + i for i in range(LAYERS)] * 2
TIMED = [
    "python/sglang_dflash_pp/srt/disaggregation/mooncake_draft_kv.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_chunk_packs.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_plan.py",
    "python/sglang_dflash_pp/srt/disaggregation/draft_kv_geometry.py",
]


def _manager(pool):
    """The manager shell of ``bench_draft_kv_transfer`` (same geometry), with no engine."""
    from bench_draft_kv_transfer import prefill_manager

    return prefill_manager(SimpleNamespace(batch_register=lambda p, n: 0,
                                           batch_deregister=lambda p: 0), pool)  # fmt: skip


def _registration(session, rank, item_lens):
    from bench_draft_kv_transfer import registration

    return registration(session, rank, [1 << 40 | rank << 32 | q << 24 for q in range(2 * LAYERS)],
                        item_lens)  # fmt: skip


def _stub_pack(chunk_packs):
    """``pack_slices`` without the gather: the slab offsets the real one returns (each slice's
    entries back to back from ``at``, ``rows x width`` bytes each). Either API generation."""

    def pack_slices(slot, at, slices, *args, **kwargs):
        rows = next(a for a in args if isinstance(a, np.ndarray))
        out, top = [], at
        for s in slices:
            offsets = []
            for w in s.byte_widths:
                offsets.append(top)
                top += rows.size * w
            out.append(offsets)
        return out

    chunk_packs.pack_slices = pack_slices


def drive(reps: int, warmup: int) -> dict:
    """Run in a subprocess whose ``sys.path`` starts with the project under test."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_context

    from sglang_dflash_pp.srt.disaggregation import draft_kv_chunk_packs, mooncake_draft_kv
    from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
        DraftKVGeometry,
        DraftKVShape,
        KVComponent,
    )
    from sglang_dflash_pp.srt.disaggregation.draft_kv_source import (
        describe_draft_pool,
        record_draft_kv_source,
    )

    torch.set_num_threads(1)
    load_plugins()
    get_context().override_server_args(speculative_algorithm="DFLASH").install()
    shape = DraftKVShape(HEADS, HEAD_DIM, HEAD_DIM, 2)
    src = DraftKVGeometry.for_rank(shape, side="prefill", tp_size=PREFILL_TP,
                                   tp_rank=PREFILL_RANK, page_size=PAGE)  # fmt: skip
    pool = MHATokenToKVPool(
        size=POOL_PAGES * PAGE, page_size=PAGE, dtype=torch.bfloat16,
        head_num=src.heads_per_rank, head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    source = describe_draft_pool(pool, HEADS)
    new_api = hasattr(mooncake_draft_kv, "DraftSend")
    if new_api:  # the prefill's startup (prefill_draft_kv): the staging with the pool
        from dataclasses import replace

        from sglang_dflash_pp.srt.disaggregation.draft_kv_staging import build_staging

        staging = build_staging(source, src, chunk_tokens=CHUNK, num_slots=4)
        source = replace(source, staging=staging)
    record_draft_kv_source(source)
    m = _manager(pool)
    if not new_api:  # the previous path allocated its buffer at the first registration
        mooncake_draft_kv._pack_buffer(m, source)
    _stub_pack(draft_kv_chunk_packs)

    sessions = {r: f"decode:{r}" for r in DECODE_RANKS}
    regs = {}
    for r in DECODE_RANKS:
        dst = DraftKVGeometry.for_rank(shape, side="decode", tp_size=DECODE_TP, tp_rank=r,
                                       page_size=PAGE)  # fmt: skip
        item_lens = [dst.page_bytes(KVComponent.K)] * LAYERS + [dst.page_bytes(KVComponent.V)] * LAYERS
        regs[r] = _registration(sessions[r], r, item_lens)
        reason = m._publish_peer_registration(sessions[r], regs[r])
        assert reason is None, reason
    recorded = []
    m._transfer_data = lambda session, blocks: recorded.append((session, list(blocks))) or 0
    room = 7
    m.request_status[room] = 3  # KVPoll.Transferring
    m.transfer_infos[room] = {
        sessions[r]: SimpleNamespace(is_dummy=False) for r in DECODE_RANKS
    }
    src_pages, dst_pages = np.asarray(SRC_PAGES, np.int32), np.asarray(DST_PAGES, np.int32)
    chunk = SimpleNamespace(room=room, wait_event=None)
    if new_api:
        sends = {r: getattr(regs[r], "_dflash_draft_kv_send") for r in DECODE_RANKS}

        def send(r):
            return mooncake_draft_kv.send_draft_entries(m, sends[r], sessions[r], src_pages,
                                                        dst_pages)  # fmt: skip
    else:
        plans = {r: getattr(regs[r], "dflash_draft_kv_plan") for r in DECODE_RANKS}

        def send(r):
            return mooncake_draft_kv.send_draft_entries(
                m, plans[r], sessions[r], src_pages, dst_pages, regs[r].dst_kv_ptrs
            )

    samples = []
    for i in range(warmup + reps):
        recorded.clear()
        t0 = time.perf_counter()
        mooncake_draft_kv.begin_chunk(m, chunk)
        for r in DECODE_RANKS:
            assert send(r) == 0
        mooncake_draft_kv.end_chunk()
        dt = time.perf_counter() - t0
        if i >= warmup:
            samples.append(dt)
        if i == 0:
            first = [(s, [list(b) for b in blocks]) for s, blocks in recorded]
    slot_base = min(b[0] for _, blocks in first for b in blocks)
    # Slot addresses differ between the two processes: descriptors compared relative to it.
    relative = [(s, [[b[0] - slot_base, b[1], b[2]] for b in blocks]) for s, blocks in first]
    return dict(
        api="DraftSend (this tree)" if new_api else "per-entry (before)",
        samples_s=samples,
        descriptors=sum(len(b) for _, b in first),
        transfer_calls=len(first),
        first_chunk_descriptors=relative,
        failures=m.failures,
    )


def _run(root: str, reps: int, warmup: int) -> dict:
    import before_after  # benchmark/, on the path (main)

    return before_after.run_driver(root, HERE, f"host_time.drive({reps}, {warmup})", cwd=root)


def main() -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    import before_after
    import provenance

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--before", default="db84bfe")
    parser.add_argument("--out", default=os.path.join(HERE, "host_time.json"))
    args = parser.parse_args()
    runs = {}
    with before_after.worktree_at(args.before, "host-time-before-") as worktree:
        for name, root in (("before", worktree), ("after", ROOT)):
            runs[name] = _run(root, args.reps, args.warmup)
            print(name, provenance.summary(runs[name]["samples_s"]), flush=True)
    same = runs["before"]["first_chunk_descriptors"] == runs["after"]["first_chunk_descriptors"]
    assert same, "the descriptors differ between before and after"
    before, after = (provenance.summary(runs[k]["samples_s"]) for k in ("before", "after"))
    result = dict(
        provenance=provenance.record(
            repetitions=args.reps, warmup=args.warmup, timed_sources=TIMED,
            before_commit=args.before,
        ),  # fmt: skip
        geometry=dict(
            prefill_tp=PREFILL_TP, prefill_rank=PREFILL_RANK, decode_tp=DECODE_TP,
            decode_ranks=DECODE_RANKS, draft_entries=2 * LAYERS, chunk_tokens=CHUNK,
            pages=N_PAGES, page_size=PAGE,
        ),  # fmt: skip
        descriptors_identical=same,
        descriptors_per_chunk=runs["after"]["descriptors"],
        transfer_calls_per_chunk=runs["after"]["transfer_calls"],
        per_chunk_s={"before": before, "after": after},
        ratio_after_over_before_median=after["median"] / before["median"],
        samples_s={k: v["samples_s"] for k, v in runs.items()},
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("per_chunk_s", "ratio_after_over_before_median")}))


if __name__ == "__main__":
    main()
