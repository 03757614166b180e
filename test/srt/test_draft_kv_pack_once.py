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


register_decode_ranks = harness.register_decode_ranks


def run_rooms(m, regs, rooms):
    """Every room to every decode rank in ``regs`` through the real transfer worker; no send fails."""
    harness.run_rooms(m, regs, rooms)
    assert m.failures == []


@pytest.fixture
def pack_calls(monkeypatch):
    """Every pack the send path runs, on the shared-slab path and on the per-send fallback
    (both go through ``draft_kv_chunk_packs.pack_slices``): a list of
    [(source data_ptr, byte offset, width), ...] per call."""
    from sglang_dflash_pp.srt.disaggregation import draft_kv_chunk_packs

    calls = []
    real = draft_kv_chunk_packs.pack_slices

    def counting(slot, at, slices, prepared, rows, written=()):
        calls.append(
            [
                (prepared.sources[q].data_ptr(), int(o), int(w))
                for s in slices
                for q, o, w in zip(s.src_entries, s.byte_offsets, s.byte_widths)
            ]
        )
        return real(slot, at, slices, prepared, rows, written)

    monkeypatch.setattr(draft_kv_chunk_packs, "pack_slices", counting)
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
    buf = harness.staging_of(m).buffer
    assert buf.free_slots() == len(m.transfer_queues)


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
    assert harness.staging_of(m).buffer.free_slots() == 2


def _two_head_rank(rows: int = 64, pages_bytes: int = 1 << 16, slots: int = 1):
    """A prefill rank holding 2 heads of 4 int16 (8 B each) in one K and one V entry, page size 4,
    its staging buffer and its prepared packs (``PreparedPacks``: heads 0 and 1 at 1 head per
    decode rank)."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import PreparedPacks
    from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVGeometry
    from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import PackStagingBuffer, as_byte_rows

    geometry = DraftKVGeometry("prefill", 1, 0, 2, 4, 4, 2, 4)
    tensors = [torch.arange(rows * 8, dtype=torch.int16).reshape(rows, 8) + 1000 * e for e in (0, 1)]
    src = [as_byte_rows(t) for t in tensors]
    buf = PackStagingBuffer(pages_bytes, slots, torch.device("cpu"), max_rows=rows)
    prepared = PreparedPacks(src, geometry, buf.slots[0].buffer)
    a, b = prepared.partition(next(iter(prepared.partitions)))
    return buf, prepared, tensors, a, b


def test_the_slot_is_given_back_after_the_last_reader():
    """ChunkPacks on its own: the slot is held while a reader of a packed slice is left."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import ChunkPacks

    buf, prepared, tensors, a, b = _two_head_rank()
    assert (a.heads, b.heads) == (range(0, 1), range(1, 2)) and a.byte_offsets == (0, 0)
    packs = ChunkPacks(buf, prepared, {a: {"r0", "r1"}, b: {"r2"}}, page_size=4)
    offsets = packs.slab(a, [3, 1])
    assert buf.free_slots() == 0 and packs.launches == 1 and packs.slices_packed == 2
    rows = np.r_[12:16, 4:8]
    for e, at in enumerate(offsets):  # independent oracle: plain indexing of head 0
        got = packs.slot.buffer[at : at + 8 * 8].view(torch.int16).reshape(8, 4)
        assert torch.equal(got, tensors[e][rows, :4])
    assert packs.slab(b, [3, 1]) is not None and packs.launches == 1  # already packed
    for reader, piece in (("r0", a), ("r2", b)):
        packs.done(piece, reader)
        assert buf.free_slots() == 0
    packs.done(a, "r1")
    assert buf.free_slots() == 1 and packs.slot is None


def test_slots_start_on_aligned_boundaries_for_any_slot_count():
    """``SGLANG_DISAGGREGATION_QUEUE_SIZE`` need not be a power of two; one prepared fused pack
    serves every slot and writes 8-byte words, so every slot must start aligned."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import PackStagingBuffer

    for slots in (1, 3, 5, 7):
        buf = PackStagingBuffer((256 << 10) // slots, slots, torch.device("cpu"), max_rows=16)
        taken = [buf.take() for _ in range(slots)]
        assert buf.take() is None  # no slot is ever shared
        assert all((s.ptr - buf.ptr) % 256 == 0 for s in taken), slots
        assert all(s.buffer.numel() == buf.slot_bytes > 0 for s in taken)
        assert slots * buf.slot_bytes <= 256 << 10


def test_a_slot_whose_transfer_failed_is_quarantined(monkeypatch):
    """batch_transfer_sync returns on its timeout with the batch maybe still reading the slot:
    the slot stays out of use for QUARANTINE_S, then comes back."""
    from sglang_dflash_pp.srt.disaggregation import draft_kv_pack
    from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import ChunkPacks

    buf, prepared, _, a, b = _two_head_rank()
    packs = ChunkPacks(buf, prepared, {a: {"r0"}, b: {"r1"}}, page_size=4)
    assert packs.slab(a, [1]) is not None and buf.free_slots() == 0
    packs.failed()
    assert packs.slot is None and buf.free_slots() == 0 and buf.take() is None
    later = ChunkPacks(buf, prepared, {a: {"r0"}}, page_size=4)
    assert later.slab(a, [1]) is None  # no free slot: the caller sends without one
    now = draft_kv_pack.time.monotonic()
    monkeypatch.setattr(draft_kv_pack.time, "monotonic", lambda: now + draft_kv_pack.QUARANTINE_S)
    assert buf.free_slots() == 1 and later.slab(a, [1]) is not None


def test_page_ids_outside_the_pool_are_refused_before_a_pack():
    """A bad page id would make the GPU kernel fault (sticky, the stage dies): refused on the host."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import ChunkPacks

    buf, prepared, _, a, b = _two_head_rank(rows=64)  # 16 pages of 4
    packs = ChunkPacks(buf, prepared, {a: {"r0"}}, page_size=4)
    for bad in ([16], [-1], [3, 99]):
        with pytest.raises(IndexError, match="outside the pool's 16 pages"):
            packs.slab(a, bad)
    assert buf.free_slots() == 1 and packs.launches == 0
    assert packs.slab(a, [15]) is not None


def test_a_trimmed_request_is_served_from_the_packed_pages_within_the_slot():
    """A decode rank whose pages sglang trimmed is served from the slab of the full page list;
    a slice packed later for it must be sized by the pages actually packed (not by the trimmed
    list), or the pack would run past the slot."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import ChunkPacks

    # 16 pages x 4 rows x 16 bytes (K and V, one head each) = 1 KiB per slice: one fits a
    # 1.5 KiB slot, two do not.
    buf, prepared, tensors, a, b = _two_head_rank(pages_bytes=1536)
    packs = ChunkPacks(buf, prepared, {a: {"r0"}, b: {"r1"}}, page_size=4)
    pages = list(range(16))
    packs.slab(a, pages)
    assert packs.slices_packed == 1  # both do not fit together: a alone
    offsets = packs.slab(b, pages[:1])  # trimmed to one page, covered by the packed pages
    assert packs.slices_packed == 2 and packs.launches == 2
    assert offsets[-1] + 16 * 4 * 8 <= buf.slot_bytes
    got = packs.slot.buffer[offsets[0] : offsets[0] + 4 * 8].view(torch.int16).reshape(4, 4)
    assert torch.equal(got, tensors[0][0:4, 4:8])
