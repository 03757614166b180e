"""Each distinct draft head slice is packed once per chunk, through sglang's real transfer worker.

The prefill manager shell of test_draft_kv_mooncake.py (real, hooked ``transfer_worker`` and
``send_kvcache`` of sglang 0.5.23's ``MooncakeKVManager``; ``_transfer_data`` a recorder that
snapshots source bytes) serves one prefill rank of TP4 and its 8 decode ranks of TP32 in one room,
as sglang queues a chunk for every decode rank of a request. The pack function the send path
calls is wrapped to count what it gathers. The oracle for the number of distinct slices is
sglang's own head sharding (``QKVParallelLinear`` via the harness's ``owned_heads``), and every
decode rank's bytes are checked against the whole model's draft KV.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_draft_kv_mooncake as harness  # noqa: E402
from test_draft_kv_mooncake import pools  # noqa: E402,F401  (fixture)

DECODE_RANKS = list(range(8, 16))  # the decode ranks sglang maps to prefill rank 1 of 4


def register_decode_ranks(m, ranks):
    regs = []
    for r in ranks:
        reg = harness.decode_registration(f"d:{r}", tp_size=32, tp_rank=r)
        reg.dst_kv_ptrs = [p + r * 50_000_000 for p in reg.dst_kv_ptrs]
        assert m._publish_peer_registration(reg.mooncake_session_id, reg) is None
        regs.append(reg)
    harness.with_pack_regions(m)
    return regs


def run_rooms(m, regs, rooms):
    """Every room to every decode rank in ``regs`` through the real transfer worker; no send fails."""
    harness.run_rooms(m, regs, rooms)
    assert m.failures == []


@pytest.fixture
def pack_calls(monkeypatch):
    """Every call of the pack function, on the shipped path and on the per-send fallback:
    a list of [(source data_ptr, byte offset, width), ...] per call."""
    from sglang_dflash_pp.srt.disaggregation import draft_kv_chunk_packs, draft_kv_pack

    calls = []
    real = draft_kv_pack.pack_row_slices

    def counting(sources, rows, offsets, widths, out):
        calls.append(
            [(s.data_ptr(), int(o), int(w)) for s, o, w in zip(sources, offsets, widths)]
        )
        return real(sources, rows, offsets, widths, out)

    monkeypatch.setattr(draft_kv_chunk_packs, "pack_row_slices", counting)
    monkeypatch.setattr(draft_kv_pack, "pack_row_slices", counting)
    return calls


def assert_every_rank_holds_its_heads(m, regs, src_pages, dst_pages, room_calls):
    for reg in regs:
        writes = [
            w
            for session, blocks, snaps in room_calls
            if session == reg.mooncake_session_id
            for w in zip(blocks, snaps)
        ]
        images = harness.decode_images_from(writes, reg, 32)
        harness.assert_decode_holds_its_heads(images, 32, reg.dst_tp_rank, src_pages, dst_pages)


def distinct_slices(ranks) -> set:
    return {tuple(harness.owned_heads(32, r)) for r in ranks}


def test_tp4_to_tp32_packs_each_distinct_head_slice_once_per_chunk(pools, pack_calls):
    m, _ = harness.setup_prefill(pools, 4, 1)
    regs = register_decode_ranks(m, DECODE_RANKS)
    rooms = {7: ([5, 6, 7, 20, 11], [2, 3, 4, 9, 15]), 8: ([1, 2, 3], [10, 11, 12])}
    run_rooms(m, regs, rooms)

    assert len(distinct_slices(DECODE_RANKS)) == 2  # heads 2 and 3, each on 4 decode ranks
    # One pack call per chunk, covering both slices of all 12 entries; no per-send pack.
    assert len(pack_calls) == len(rooms)
    for call in pack_calls:
        assert len(call) == 2 * harness.N_DRAFT
        per_slice = Counter(offset for _, offset, _ in call)
        assert len(per_slice) == len(distinct_slices(DECODE_RANKS))
        assert set(per_slice.values()) == {harness.N_DRAFT}
        assert len(set(call)) == len(call)  # no (entry, slice) gathered twice
    # Every decode rank still receives exactly its own head, once, for each room.
    calls = m._transfer_data.calls
    draft_calls = [c for c in calls if all(d < harness.TARGET_BASE for _, d, _ in c[1])]
    assert len(draft_calls) == len(rooms) * len(regs)
    # The rooms' decode pages are disjoint: each page written once, from its room's source page.
    src = [p for s, _ in rooms.values() for p in s]
    dst = [p for _, d in rooms.values() for p in d]
    assert_every_rank_holds_its_heads(m, regs, src, dst, calls)
    # The slot came back: every slot free once the worker is done.
    buf = m._dflash_draft_kv_pack_buffer
    assert buf._free.qsize() == len(m.transfer_queues)


def test_slices_that_do_not_fit_together_are_packed_one_at_a_time(pools, pack_calls, monkeypatch):
    """3 MB in 2 slots: one slice of 5 pages (983,040 B) fits a 1.5 MB slot, two do not."""
    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB", "3")
    m, _ = harness.setup_prefill(pools, 4, 1)
    ordered = register_decode_ranks(m, DECODE_RANKS)
    src, dst = harness.SRC_PAGES, harness.DST_PAGES
    run_rooms(m, ordered, {7: (src, dst)})
    assert [len(c) for c in pack_calls] == [harness.N_DRAFT] * 2  # heads 2, then heads 3
    assert_every_rank_holds_its_heads(m, ordered, src, dst, m._transfer_data.calls)

    # Decode ranks whose heads alternate: each send evicts the other slice, still exact.
    pack_calls.clear()
    m2, _ = harness.setup_prefill(pools, 4, 1)
    interleaved = register_decode_ranks(m2, [8, 12, 9, 13, 10, 14, 11, 15])
    run_rooms(m2, interleaved, {7: (src, dst)})
    assert [len(c) for c in pack_calls] == [harness.N_DRAFT] * 8
    assert_every_rank_holds_its_heads(m2, interleaved, src, dst, m2._transfer_data.calls)


def test_a_slice_larger_than_a_slot_is_packed_per_decode_rank_in_windows(pools, pack_calls, monkeypatch):
    """1 MB in 2 slots: 2 pages per window, 3 windows for each of the 8 decode ranks."""
    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB", "1")
    m, _ = harness.setup_prefill(pools, 4, 1)
    regs = register_decode_ranks(m, DECODE_RANKS)
    run_rooms(m, regs, {7: (harness.SRC_PAGES, harness.DST_PAGES)})
    assert len(pack_calls) == 8 * 3
    assert_every_rank_holds_its_heads(
        m, regs, harness.SRC_PAGES, harness.DST_PAGES, m._transfer_data.calls
    )
    assert m._dflash_draft_kv_pack_buffer._free.qsize() == 2


def test_the_slot_is_given_back_after_the_last_reader():
    """ChunkPacks on its own: the slot is held while a reader of a packed slice is left."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import ChunkPacks, HeadSlice
    from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import PackStagingBuffer, as_byte_rows

    buf = PackStagingBuffer(1 << 16, 1, torch.device("cpu"), lambda ptr, n: None)
    src = [as_byte_rows(torch.arange(64 * 8, dtype=torch.int16).reshape(64, 8))]
    a = HeadSlice(range(0, 1), (0,), (0,), (8,))
    b = HeadSlice(range(1, 2), (0,), (8,), (8,))
    packs = ChunkPacks(buf, {a: {"r0", "r1"}, b: {"r2"}}, lambda: src, page_size=4)
    offsets = packs.slab(a, [3, 1])
    assert buf._free.qsize() == 0 and packs.launches == 1 and packs.slices_packed == 2
    rows = np.r_[12:16, 4:8]
    got = packs.slot.buffer[offsets[0] : offsets[0] + 8 * 8].view(torch.int16).reshape(8, 4)
    assert torch.equal(got, src[0].view(torch.int16)[rows, :4])  # independent: plain indexing
    assert packs.slab(b, [3, 1]) is not None and packs.launches == 1  # already packed
    for reader, piece in (("r0", a), ("r2", b)):
        packs.done(piece, reader)
        assert buf._free.qsize() == 0
    packs.done(a, "r1")
    assert buf._free.qsize() == 1 and packs.slot is None


def test_slots_start_on_aligned_boundaries_for_any_slot_count():
    """``SGLANG_DISAGGREGATION_QUEUE_SIZE`` need not be a power of two; one prepared fused pack
    serves every slot and writes 8-byte words, so every slot must start aligned."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import PackStagingBuffer

    for slots in (1, 3, 5, 7):
        buf = PackStagingBuffer(256 << 10, slots, torch.device("cpu"), lambda ptr, n: None)
        taken = [buf._free.get() for _ in range(slots)]
        assert all((s.ptr - buf.ptr) % 256 == 0 for s in taken), slots
        assert all(s.buffer.numel() == buf.slot_bytes > 0 for s in taken)
        assert slots * buf.slot_bytes <= 256 << 10


def test_a_trimmed_request_is_served_from_the_packed_pages_within_the_slot():
    """A decode rank whose pages sglang trimmed is served from the slab of the full page list;
    a slice packed later for it must be sized by the pages actually packed (not by the trimmed
    list), or the pack would run past the slot."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import ChunkPacks, HeadSlice
    from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import PackStagingBuffer, as_byte_rows

    # 16 pages x 4 rows x 8 bytes = 512 B per slice: one fits a 768-byte slot, two do not.
    buf = PackStagingBuffer(768, 1, torch.device("cpu"), lambda ptr, n: None)
    src = [as_byte_rows(torch.arange(64 * 8, dtype=torch.int16).reshape(64, 8))]
    a = HeadSlice(range(0, 1), (0,), (0,), (8,))
    b = HeadSlice(range(1, 2), (0,), (8,), (8,))
    packs = ChunkPacks(buf, {a: {"r0"}, b: {"r1"}}, lambda: src, page_size=4)
    pages = list(range(16))
    packs.slab(a, pages)
    assert packs.slices_packed == 1  # both do not fit together: a alone
    offsets = packs.slab(b, pages[:1])  # trimmed to one page, covered by the packed pages
    assert packs.slices_packed == 2 and packs.launches == 2
    assert offsets[0] + 16 * 4 * 8 <= buf.slot_bytes
    got = packs.slot.buffer[offsets[0] : offsets[0] + 4 * 8].view(torch.int16).reshape(4, 4)
    assert torch.equal(got, src[0].view(torch.int16)[0:4, 4:8])
