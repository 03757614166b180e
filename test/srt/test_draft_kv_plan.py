"""Head-aware draft KV plan, pure: every (prefill TP, decode TP, heads) combination, simulated byte by byte.

The simulation gives every byte of every prefill rank's draft pool a unique identity, runs the
plan's descriptors (and, for packing, the real pack function) against a tiny address space that,
like Mooncake, refuses any range outside a registered buffer, and then checks every decode
rank's pool: each byte of each sent page holds the right identity and was written exactly once,
nothing else was written, and the bytes moved equal the decode rank's own draft bytes.
No sglang import in this file.
"""

from __future__ import annotations

import bisect
import itertools
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
    DraftKVGeometry,
    DraftKVLayoutError,
    DraftKVShape,
    KVComponent,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import (
    pack_row_slices_index_select as pack_row_slices,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import (
    Descriptors,
    Regime,
    dst_page_runs,
    pack_source_rows,
    packed_descriptors,
    page_runs,
    per_token_descriptors,
    plan_pair,
    prefill_ranks_for,
    whole_page_descriptors,
)

TPS = (1, 2, 4, 8, 16, 32, 64)
HEADS = (1, 2, 4, 8, 16)
K, V = KVComponent.K, KVComponent.V


class AddressSpace:
    """Registered regions of int32 'bytes'; a transfer outside every region fails like Mooncake's."""

    def __init__(self):
        self.regions = []  # (base, array, write counts or None), bases increasing
        self.bases = []
        self.next_base = 1 << 20

    def register(self, array: np.ndarray, count_writes: bool = False) -> int:
        base = self.next_base
        self.next_base += ((array.size >> 12) + 2) << 12  # leave a gap: no two regions touch
        self.regions.append((base, array, np.zeros(array.size, np.int32) if count_writes else None))
        self.bases.append(base)
        return base

    def _find(self, addr: int, length: int):
        i = bisect.bisect_right(self.bases, addr) - 1
        if i >= 0:
            base, array, counts = self.regions[i]
            if addr + length <= base + array.size:
                return array, counts, addr - base
        raise AssertionError(f"[{addr}, {addr + length}) is not inside a registered buffer")

    def transfer(self, d: Descriptors) -> int:
        for s, t, n in zip(d.src.tolist(), d.dst.tolist(), d.length.tolist()):
            src, _, so = self._find(s, n)
            dst, counts, do = self._find(t, n)
            dst[do : do + n] = src[so : so + n]
            if counts is not None:
                counts[do : do + n] += 1
        return d.total_bytes


def byte_ids(entry: int, positions: np.ndarray, heads: range, head_bytes: int, total_heads: int):
    """Identity of byte k of global head g of the token at request position i: [i, h, k] -> id."""
    i = positions[:, None, None]
    g = np.asarray(list(heads))[None, :, None]
    k = np.arange(head_bytes)[None, None, :]
    return (((entry * 100_000 + i) * total_heads + g) * head_bytes + k + 1).astype(np.int32)


def prefill_image(geom: DraftKVGeometry, c: KVComponent, entry: int, src_pages, n_pool_pages):
    S, hb = geom.page_size, geom.head_bytes(c)
    img = np.full(n_pool_pages * geom.page_bytes(c), -7, np.int32)
    pos = np.arange(len(src_pages) * S)
    ids = byte_ids(entry, pos, geom.owned_heads, hb, geom.total_heads).reshape(len(src_pages), -1)
    view = img.reshape(n_pool_pages, -1)
    view[np.asarray(src_pages)] = ids
    return img


def expected_decode(geom: DraftKVGeometry, c: KVComponent, entry: int, dst_pages, n_pool_pages):
    S, hb = geom.page_size, geom.head_bytes(c)
    img = np.zeros(n_pool_pages * geom.page_bytes(c), np.int32)
    pos = np.arange(len(dst_pages) * S)
    ids = byte_ids(entry, pos, geom.owned_heads, hb, geom.total_heads).reshape(len(dst_pages), -1)
    img.reshape(n_pool_pages, -1)[np.asarray(dst_pages)] = ids
    written = np.zeros(img.size, np.int32)
    written.reshape(n_pool_pages, -1)[np.asarray(dst_pages)] = 1
    return img, written


def simulate(shape, page_size, prefill_tp, decode_tp, src_pages, dst_pages, pack_capacity=None):
    """Send the draft KV of every prefill rank to every decode rank; check every decode byte."""
    entries = ((0, K), (1, V))
    n_src_pool = max(src_pages) + 2
    n_dst_pool = max(dst_pages) + 2
    space = AddressSpace()
    src = {}
    for p in range(prefill_tp):
        g = DraftKVGeometry.for_rank(
            shape, side="prefill", tp_size=prefill_tp, tp_rank=p, page_size=page_size
        )
        arrays = {e: prefill_image(g, c, e, src_pages, n_src_pool) for e, c in entries}
        src[p] = (g, {e: space.register(a) for e, a in arrays.items()}, arrays)
    dst = {}
    for r in range(decode_tp):
        g = DraftKVGeometry.for_rank(
            shape, side="decode", tp_size=decode_tp, tp_rank=r, page_size=page_size
        )
        arrays = {e: np.zeros(n_dst_pool * g.page_bytes(c), np.int32) for e, c in entries}
        dst[r] = (g, {e: space.register(a, count_writes=True) for e, a in arrays.items()}, arrays)
    # One pack slot per simulated transfer worker; its contents die with each send.
    slot = np.zeros(pack_capacity or (1 << 16), np.int32)
    slot_base = space.register(slot)

    moved = {r: 0 for r in dst}
    regimes = set()
    for r, (dg, dbases, _) in dst.items():
        for p in prefill_ranks_for(r, prefill_tp=prefill_tp, decode_tp=decode_tp):
            pg, pbases, parrays = src[p]
            plan = plan_pair(pg, dg)
            if not plan.writer:
                continue
            regimes.add(plan.regime)
            if plan.regime is Regime.WHOLE_PAGES:
                d = Descriptors.concat(
                    [
                        whole_page_descriptors(plan, c, pbases[e], dbases[e], src_pages, dst_pages)
                        for e, c in entries
                    ]
                )
            elif plan.regime is Regime.PER_TOKEN:
                d = Descriptors.concat(
                    [
                        per_token_descriptors(plan, c, pbases[e], dbases[e], src_pages, dst_pages)
                        for e, c in entries
                    ]
                )
            else:
                rows = torch.from_numpy(pack_source_rows(plan, src_pages))
                sources = [
                    torch.from_numpy(parrays[e]).view(-1, pg.row_bytes(c)) for e, c in entries
                ]
                slabs = pack_row_slices(
                    sources,
                    rows,
                    [plan.src_offset(c) for _, c in entries],
                    [plan.width(c) for _, c in entries],
                    torch.from_numpy(slot),
                )
                d = Descriptors.concat(
                    [
                        packed_descriptors(plan, c, slot_base + at, dbases[e], dst_pages)
                        for (e, c), at in zip(entries, slabs)
                    ]
                )
                # The minimum: one descriptor per destination page run and entry.
                assert d.count == len(entries) * len(dst_page_runs(dst_pages)[0])
            moved[r] += space.transfer(d)

    for r, (dg, _, arrays) in dst.items():
        for e, c in entries:
            want, written = expected_decode(dg, c, e, dst_pages, n_dst_pool)
            counts = next(cnt for base, a, cnt in space.regions if a is arrays[e])
            np.testing.assert_array_equal(
                counts, written, err_msg=f"write count, decode rank {r} entry {c}"
            )
            np.testing.assert_array_equal(
                arrays[e], want, err_msg=f"bytes, decode rank {r} entry {c}"
            )
        minimum = sum(len(dst_pages) * dg.page_bytes(c) for _, c in entries)
        assert moved[r] == minimum, f"decode rank {r}: moved {moved[r]} B, minimum {minimum} B"
    return regimes


@pytest.mark.parametrize("heads", HEADS)
def test_every_tp_pair_places_every_byte_once(heads):
    shape = DraftKVShape(total_heads=heads, k_head_dim=2, v_head_dim=3, dtype_bytes=2)
    src_pages, dst_pages = [6, 7, 2, 3, 4], [1, 2, 3, 8, 0]
    seen = set()
    for prefill_tp, decode_tp in itertools.product(TPS, TPS):
        seen |= simulate(shape, 2, prefill_tp, decode_tp, src_pages, dst_pages)
    if heads > 1:
        assert seen == set(Regime)
    else:
        assert seen == {Regime.WHOLE_PAGES}


def test_tp4_to_tp32_regression_case():
    """The seed's case: decode base 2000000, page 2 at TP4 -> TP32 lands at 2032768, 16384 B/page."""
    shape = DraftKVShape(total_heads=8, k_head_dim=128, v_head_dim=128, dtype_bytes=2)
    src = DraftKVGeometry.for_rank(shape, side="prefill", tp_size=4, tp_rank=1, page_size=64)
    dst = DraftKVGeometry.for_rank(shape, side="decode", tp_size=32, tp_rank=12, page_size=64)
    plan = plan_pair(src, dst)
    assert plan.writer and plan.regime is Regime.PACK_SOURCE
    assert (plan.heads, src.owned_heads, dst.owned_heads) == (range(3, 4), range(2, 4), range(3, 4))
    assert (src.page_bytes(K), dst.page_bytes(K)) == (32768, 16384)
    assert (plan.src_offset(K), plan.dst_offset(K), plan.width(K)) == (256, 0, 256)

    pack_base = 5_000_000
    d = packed_descriptors(plan, K, pack_base, 2_000_000, [2, 3, 4, 9])
    assert d.src.tolist() == [pack_base, pack_base + 3 * 16384]
    assert d.dst.tolist() == [2_032_768, 2_000_000 + 9 * 16384]
    assert d.length.tolist() == [3 * 16384, 16384]
    # Stock 0.5.23 addressed the same page with the source item length: 2065536, 32768 B/page.
    assert 2_000_000 + 2 * src.page_bytes(K) == 2_065_536 != d.dst[0]

    per_token = per_token_descriptors(plan, K, 1_000_000, 2_000_000, [5, 6, 7, 20], [2, 3, 4, 9])
    assert per_token.count == 4 * 64
    assert per_token.dst[:2].tolist() == [2_032_768, 2_032_768 + 256]
    assert per_token.src[:2].tolist() == [
        1_000_000 + 5 * 32768 + 256,
        1_000_000 + 5 * 32768 + 512 + 256,
    ]
    assert per_token.total_bytes == 4 * 16384


@pytest.mark.parametrize(
    "prefill_tp, decode_tp, heads, writers",
    [
        (32, 16, 8, {0: [0], 1: [2]}),  # prefill replicated x4, decode x2: one of each pair
        (16, 4, 8, {0: [0, 2], 1: [4, 6]}),  # two heads per decode rank, one writer each
        (8, 2, 8, {0: [0, 1, 2, 3]}),  # four disjoint writers
        (64, 1, 8, {0: [0, 8, 16, 24, 32, 40, 48, 56]}),
    ],
)
def test_writer_election(prefill_tp, decode_tp, heads, writers):
    shape = DraftKVShape(heads, 128, 128, 2)
    for r, expected in writers.items():
        dst = DraftKVGeometry.for_rank(
            shape, side="decode", tp_size=decode_tp, tp_rank=r, page_size=64
        )
        got = [
            p
            for p in prefill_ranks_for(r, prefill_tp=prefill_tp, decode_tp=decode_tp)
            if plan_pair(
                DraftKVGeometry.for_rank(
                    shape, side="prefill", tp_size=prefill_tp, tp_rank=p, page_size=64
                ),
                dst,
            ).writer
        ]
        assert got == expected


def test_descriptor_counts_for_the_deployment():
    """TP4 -> TP32, 6 layers x (K, V), 4096 tokens in one page run: 12 packed descriptors per decode rank."""
    shape = DraftKVShape(8, 128, 128, 2)
    src = DraftKVGeometry.for_rank(shape, side="prefill", tp_size=4, tp_rank=1, page_size=64)
    pages = np.arange(64)
    counts = {"packed": 0, "per_token": 0}
    for r in range(8, 16):
        plan = plan_pair(
            src, DraftKVGeometry.for_rank(shape, side="decode", tp_size=32, tp_rank=r, page_size=64)
        )
        for c in [K] * 6 + [V] * 6:  # prefill rank 1 serves decode ranks 8..15
            counts["packed"] += packed_descriptors(plan, c, 0, 0, pages).count
            counts["per_token"] += per_token_descriptors(plan, c, 0, 0, pages, pages).count
    assert counts == {"packed": 8 * 12, "per_token": 8 * 49152}


# -- properties -------------------------------------------------------------------------------


@st.composite
def page_lists(draw, max_pages=12, pool_pages=40):
    n = draw(st.integers(1, max_pages))
    pool = st.lists(st.integers(0, pool_pages - 1), min_size=n, max_size=n, unique=True)
    if draw(st.booleans()):  # runs: a sorted slice of consecutive pages, as allocators give
        start_s, start_d = draw(st.integers(0, pool_pages - n)), draw(
            st.integers(0, pool_pages - n)
        )
        src, dst = list(range(start_s, start_s + n)), list(range(start_d, start_d + n))
        cut = draw(st.integers(0, n))  # one break somewhere
        dst = dst[:cut] + [x + pool_pages for x in dst[cut:]]
        return src, dst
    return draw(pool), draw(pool)


@settings(max_examples=60, deadline=None)
@given(
    pages=page_lists(),
    heads=st.sampled_from(HEADS),
    prefill_tp=st.sampled_from(TPS[:5]),
    decode_tp=st.sampled_from(TPS[:5]),
    page_size=st.sampled_from([1, 2, 4]),
    dims=st.sampled_from([(2, 2), (2, 3), (4, 1)]),
    dtype_bytes=st.sampled_from([1, 2, 4]),
)
def test_random_pages_every_byte_once(
    pages, heads, prefill_tp, decode_tp, page_size, dims, dtype_bytes
):
    src_pages, dst_pages = pages
    shape = DraftKVShape(heads, dims[0], dims[1], dtype_bytes)
    simulate(shape, page_size, prefill_tp, decode_tp, src_pages, dst_pages)


@settings(max_examples=200, deadline=None)
@given(pages=page_lists(max_pages=30, pool_pages=64))
def test_page_runs_cover_pages_in_order(pages):
    src, dst = pages
    s0, d0, n = page_runs(src, dst)
    assert n.sum() == len(src) and (n > 0).all()
    assert np.concatenate([np.arange(a, a + m) for a, m in zip(s0, n)]).tolist() == src
    assert np.concatenate([np.arange(a, a + m) for a, m in zip(d0, n)]).tolist() == dst
    # maximal: a run never continues into the next one on both sides
    ends_s, ends_d = s0[:-1] + n[:-1], d0[:-1] + n[:-1]
    assert not ((ends_s == s0[1:]) & (ends_d == d0[1:])).any()
    pos, dd0, dn = dst_page_runs(dst)
    assert dn.sum() == len(dst) and len(dn) <= len(n)
    assert not ((dd0[:-1] + dn[:-1]) == dd0[1:]).any()
    assert pos.tolist() == np.r_[0, np.cumsum(dn)[:-1]].tolist()


# -- geometry refusals ------------------------------------------------------------------------


def test_geometry_of_replicated_heads():
    shape = DraftKVShape(8, 128, 64, 2)
    g = DraftKVGeometry.for_rank(shape, side="decode", tp_size=32, tp_rank=13, page_size=64)
    assert (g.heads_per_rank, g.replication, g.owned_heads) == (1, 4, range(3, 4))
    assert (g.row_bytes(K), g.row_bytes(V), g.page_bytes(K), g.page_bytes(V)) == (
        256,
        128,
        16384,
        8192,
    )
    g = DraftKVGeometry.for_rank(shape, side="prefill", tp_size=4, tp_rank=3, page_size=64)
    assert (g.heads_per_rank, g.replication, g.owned_heads) == (2, 1, range(6, 8))


def test_from_item_lengths_accepts_the_published_lengths():
    shape = DraftKVShape(8, 128, 128, 2)
    g = DraftKVGeometry.from_item_lengths(
        shape,
        side="decode",
        tp_size=32,
        tp_rank=5,
        page_size=64,
        k_item_len=16384,
        v_item_len=16384,
    )
    assert g.owned_heads == range(1, 2)


@pytest.mark.parametrize(
    "k_len, v_len, needles",
    [
        (8192, 8192, ["--page-size 32", "1-byte draft KV elements", "--kv-cache-dtype"]),
        (16384, 8192, ["V head_dim 64 where this prefill's has 128"]),
        (
            32768,
            32768,
            [
                "--page-size 128",
                "2 draft KV head(s) per decode rank instead of 1",
                "attention data parallelism",
            ],
        ),
    ],
)
def test_from_item_lengths_names_the_setting(k_len, v_len, needles):
    shape = DraftKVShape(8, 128, 128, 2)
    with pytest.raises(DraftKVLayoutError) as info:
        DraftKVGeometry.from_item_lengths(
            shape,
            side="decode",
            tp_size=32,
            tp_rank=0,
            page_size=64,
            k_item_len=k_len,
            v_item_len=v_len,
        )
    message = str(info.value)
    assert f"K={k_len} B" in message or k_len == 16384
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize(
    "tp, suggestion", [(12, "divides 8 (e.g. 8) or is a multiple of it (e.g. 16)"), (3, "(e.g. 2)")]
)
def test_heads_must_divide_tp(tp, suggestion):
    with pytest.raises(DraftKVLayoutError, match="neither divides the other") as info:
        DraftKVGeometry.for_rank(
            DraftKVShape(8, 128, 128, 2), side="decode", tp_size=tp, tp_rank=0, page_size=64
        )
    assert suggestion in str(info.value)
    assert "decode attention TP" in str(info.value)


def test_tp_sizes_must_divide_each_other():
    with pytest.raises(DraftKVLayoutError, match="must divide one another"):
        prefill_ranks_for(0, prefill_tp=4, decode_tp=6)


def test_pure_modules_import_without_sglang():
    import subprocess

    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import sglang_dflash_pp.srt.disaggregation.draft_kv_geometry\n"
        "import sglang_dflash_pp.srt.disaggregation.draft_kv_plan\n"
        "import sglang_dflash_pp.srt.disaggregation.draft_kv_pack\n"
        "import sglang_dflash_pp.srt.disaggregation.draft_kv_peer\n"
        "assert not [m for m in sys.modules if m.startswith('sglang.')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
