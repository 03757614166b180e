"""The composed KV digest (``kv_digest``): its word terms, composition across senders, every draft
layout the head-aware plan accepts, a PP split of the target KV, and the decode's messages.

Everything runs over real host memory: numpy buffers, addressed through ``arr.ctypes.data`` and
"transferred" with ``ctypes.memmove`` after a bounds check (a wrong descriptor fails the test,
it never scribbles over the interpreter). Oracles are independent of the code under test where
it matters: the term formula is re-derived from the module docstring in plain Python ints, and
the bytes a decode rank must end up with are computed from head ownership directly.
No server, no GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_dflash_pp.srt.disaggregation import kv_digest as kd
from sglang_dflash_pp.srt.disaggregation import kv_digest_verify as kv
from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
    DraftKVGeometry,
    DraftKVLayoutError,
    DraftKVShape,
    KVComponent,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_digest import digest_blocks
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import (
    Regime,
    per_token_descriptors,
    plan_pair,
    prefill_ranks_for,
)
from sglang_dflash_pp.srt.disaggregation.kv_digest import (
    Blocks,
    BufferKind,
    BufferTable,
    Contribution,
    Sender,
    buffer_key,
    compare,
    digest_blocks_host,
    digest_bytes,
)

K, V = KVComponent.K, KVComponent.V
TPS = (1, 2, 4, 8, 16, 32, 64)
HEADS = (1, 2, 4, 8, 16)
M64 = (1 << 64) - 1


# -- an independent oracle: the docstring's formula in plain Python ints -----------------------



def per_page_blocks(bases, item_lens, pages) -> Blocks:
    """What a decode rank holds of a request, one block per page of each buffer: an independent
    form of ``kv_digest_verify.request_blocks`` (which merges runs of pages)."""
    p = np.asarray(pages, dtype=np.int64)
    return Blocks.concat([Blocks.of(int(b) + p * int(n), p * int(n), int(n), i)
                          for i, (b, n) in enumerate(zip(bases, item_lens))])

def _oracle_fmix32(x: int) -> int:
    """murmur3's 32-bit finaliser, written out from its definition."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def oracle_term(w: int, o: int, k: int) -> int:
    """Term of word ``w`` at *word* offset ``o`` of buffer key ``k`` (module docstring)."""
    m = 0xFFFFFFFF
    base = _oracle_fmix32((k + (o >> 32) * 0x27D4EB2F) & m)
    c1 = (base + (o & m) * 0x9E3779B1) & m
    lo = _oracle_fmix32(w ^ c1)
    hi = _oracle_fmix32(w ^ (((c1 ^ 0x5BD1E995) * 0xCC9E2D51) & m))
    return lo + (hi << 32)


def oracle_digest(data: bytes, k: int, dst_offset: int = 0) -> int:
    assert len(data) % 4 == 0 and dst_offset % 4 == 0
    total = 0
    for i in range(0, len(data), 4):
        w = int.from_bytes(data[i : i + 4], "little")
        total += oracle_term(w, (dst_offset + i) // 4, k)
    return total & M64


# -- real memory ------------------------------------------------------------------------------


def addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


class Memory:
    """The numpy buffers of a test, by address: every transfer and every digest read must lie
    inside one of them (what Mooncake's registration enforces)."""

    def __init__(self):
        self.regions = []  # (base, nbytes, array)

    def alloc(self, nbytes: int, rng=None) -> np.ndarray:
        a = (
            np.zeros(nbytes, np.uint8)
            if rng is None
            else rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        )
        self.regions.append((addr(a), a.nbytes, a))
        return a

    def inside(self, address: int, nbytes: int, array: np.ndarray = None) -> bool:
        for base, n, a in self.regions:
            if base <= address and address + nbytes <= base + n:
                return array is None or a is array
        return False

    def memmove(self, src: int, dst: int, n: int, src_array=None, dst_array=None) -> None:
        assert self.inside(src, n, src_array), f"source [{src}, +{n}) outside its buffer"
        assert self.inside(dst, n, dst_array), f"destination [{dst}, +{n}) outside its buffer"
        ctypes.memmove(dst, src, n)

    def check_blocks_read(self, blocks: Blocks, array: np.ndarray) -> None:
        """Every row a digest block reads lies inside ``array``."""
        for src, _, nbytes, rows, ss, _, _ in zip(*(x.tolist() for x in blocks)):
            if nbytes and rows:
                span = (rows - 1) * ss + nbytes
                assert self.inside(src, span, array), f"digest block reads outside: {src}+{span}"


# == 1. word terms ============================================================================


def test_word_terms_match_the_documented_formula():
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, size=64, dtype=np.uint32)
    words[:4] = [0, 1, 0xFFFFFFFF, 0x80000000]
    for key in (0, 1, 0xFFFFFFFF, buffer_key(BufferKind.KV, 0), buffer_key(BufferKind.STATE, 3)):
        offsets = np.concatenate(
            [
                np.arange(16, dtype=np.uint64),
                np.array([2**32 - 1, 2**32, 2**32 + 1, 2**40 + 7, 2**62 + 3], np.uint64),
                rng.integers(0, 2**60, size=64 - 21, dtype=np.uint64),
            ]
        )
        got = kd.word_terms(words, offsets, key)
        assert got.dtype == np.uint64
        want = [oracle_term(int(w), int(o), key) for w, o in zip(words, offsets)]
        assert [int(x) for x in got] == want
    data = rng.integers(0, 256, size=1024, dtype=np.uint8)
    key = buffer_key(BufferKind.KV, 5)
    for off in (0, 4, 4096, 2**34, 2**34 + 12, 2**40 - 4):
        assert digest_bytes(data, key, off) == oracle_digest(data.tobytes(), key, off), off
    assert digest_bytes(data.view(np.uint32), key) == oracle_digest(data.tobytes(), key)


def test_buffer_keys_are_distinct():
    keys = [buffer_key(kind, i) for kind in BufferKind for i in range(512)]
    assert len(set(keys)) == len(keys)
    assert all(0 <= k < 2**32 for k in keys)


def test_single_bit_flips_are_always_detected():
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, size=4096, dtype=np.uint8)
    key = buffer_key(BufferKind.KV, 1)
    ref = digest_bytes(data, key, 64)
    sampled = set(rng.choice(data.size, 150, replace=False).tolist())
    positions = sorted({0, 1, 2, 3, 4, data.size - 4, data.size - 1} | sampled)
    checked = 0
    for pos in positions:
        bits = range(8) if pos in (0, data.size - 1) else rng.choice(8, 2, replace=False).tolist()
        for bit in bits:
            d = data.copy()
            d[pos] ^= np.uint8(1 << int(bit))
            assert digest_bytes(d, key, 64) != ref, (pos, bit)
            checked += 1
    assert checked > 300
    # also a whole changed byte (any nonzero xor) anywhere
    for pos in (0, data.size - 1, 777):
        for mask in (0xFF, 0x5A, 0x80):
            d = data.copy()
            d[pos] ^= mask
            assert digest_bytes(d, key, 64) != ref


def test_misplaced_bytes_change_the_digest():
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=64 * 48, dtype=np.uint8)
    key = buffer_key(BufferKind.KV, 2)
    ref = digest_bytes(data, key)
    words = data.view(np.uint32)
    for i, j in [(0, 1), (0, len(words) - 1), (10, 500), (len(words) - 2, len(words) - 1)]:
        assert words[i] != words[j]
        w = words.copy()
        w[[i, j]] = w[[j, i]]
        assert digest_bytes(w, key) != ref, (i, j)
    rows = data.reshape(48, 64)
    for i, j in [(0, 1), (0, 47), (5, 30)]:
        r = rows.copy()
        r[[i, j]] = r[[j, i]]
        assert digest_bytes(r, key) != ref, (i, j)
    # same bytes, another buffer or another place
    others = {digest_bytes(data, buffer_key(BufferKind.KV, 3))}
    others.add(digest_bytes(data, buffer_key(BufferKind.STATE, 2)))
    for off in (4, 64, 4096, 2**32, 2**34, 2**34 + 4, 2**35):
        others.add(digest_bytes(data, key, off))
    assert ref not in others and len(others) == 9
    # offsets whose low 32 bits of the word offset agree still differ (the high half is keyed)
    assert digest_bytes(data, key, 0) != digest_bytes(data, key, 4 * 2**32)
    assert digest_bytes(data, key, 16) != digest_bytes(data, key, 16 + 4 * 2**32)


def test_digest_is_additive_over_pieces_and_large_offsets():
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, size=2048, dtype=np.uint8)
    key = buffer_key(BufferKind.KV, 9)
    for base in (0, 2**34 - 1024, 2**34, 2**41 + 8):
        whole = digest_bytes(data, key, base)
        cuts = sorted(rng.choice(np.arange(4, data.size, 4), 5, replace=False).tolist())
        parts = 0
        for a, b in zip([0] + cuts, cuts + [data.size]):
            parts = kd.add64(parts, digest_bytes(data[a:b], key, base + a))
        assert parts == whole == oracle_digest(data.tobytes(), key, base)
        # the host block reader, one block at that decode offset
        blocks = Blocks.of(addr(data), base, data.size, 0)
        assert int(digest_blocks_host(blocks, [key])[0]) == whole
    assert digest_bytes(data[:0], key) == 0


def test_unaligned_offsets_and_lengths_are_refused():
    data = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="4-byte words"):
        digest_bytes(data, 1, 2)
    with pytest.raises(ValueError, match="4-byte words"):
        digest_bytes(data[:6], 1)
    for field in ("dst", "nbytes", "src_stride", "dst_stride"):
        kw = dict(src=addr(data), dst=0, nbytes=8, slot=0, rows=2, src_stride=8, dst_stride=8)
        kw[field] += 2
        with pytest.raises(ValueError, match=field):
            digest_blocks_host(Blocks.of(**kw), [1])


# == 2. composition over arbitrary disjoint pieces ============================================


def _random_cuts(rng, n, k, step=4):
    """Sorted word-aligned cut points splitting [0, n) into k nonempty pieces."""
    inner = rng.choice(np.arange(step, n, step), k - 1, replace=False)
    return [0] + sorted(int(x) for x in inner) + [n]


@pytest.mark.parametrize("seed", range(6))
def test_senders_compose_to_the_decode_digest(seed):
    rng = np.random.default_rng(100 + seed)
    mem = Memory()
    rows, width = int(rng.integers(8, 40)), 4 * int(rng.integers(6, 30))
    n_buffers = 2
    keys = [buffer_key(BufferKind.KV, 0), buffer_key(BufferKind.STATE, 0)]
    truth = [rng.integers(0, 256, size=rows * width, dtype=np.uint8) for _ in range(n_buffers)]
    decode = [mem.alloc(rows * width) for _ in range(n_buffers)]
    n_senders = int(rng.integers(2, 6))
    blocks = {s: [] for s in range(n_senders)}
    sources = []
    for b in range(n_buffers):
        # buffer b as a grid: row bands x word-aligned column slices (strided pieces), and one
        # band cut into contiguous byte runs (single-row blocks that cross row boundaries)
        bands = _random_cuts(rng, rows, int(rng.integers(2, min(rows, 5) + 1)), step=1)
        for (r0, r1) in zip(bands[:-1], bands[1:]):
            if rng.random() < 0.3:
                flat = truth[b][r0 * width : r1 * width]
                cuts = _random_cuts(rng, flat.size, int(rng.integers(1, 6)))
                for a, z in zip(cuts[:-1], cuts[1:]):
                    src = mem.alloc(z - a + 4 * int(rng.integers(0, 4)), rng)
                    pad = src.size - (z - a)
                    src[pad:] = flat[a:z]  # the piece sits at an unaligned-to-row spot
                    sources.append(src)
                    s = int(rng.integers(n_senders))
                    blocks[s].append(Blocks.of(addr(src) + pad, r0 * width + a, z - a, b))
                    mem.memmove(addr(src) + pad, addr(decode[b]) + r0 * width + a, z - a)
                continue
            cols = _random_cuts(rng, width, int(rng.integers(1, 5)))
            for c0, c1 in zip(cols[:-1], cols[1:]):
                n = r1 - r0
                w = c1 - c0
                stride = w + 4 * int(rng.integers(0, 5))  # the sender's own row layout
                src = mem.alloc(n * stride, rng)
                src.reshape(n, stride)[:, :w] = truth[b].reshape(rows, width)[r0:r1, c0:c1]
                sources.append(src)
                s = int(rng.integers(n_senders))
                blocks[s].append(
                    Blocks.of(addr(src), r0 * width + c0, w, b, rows=n, src_stride=stride,
                              dst_stride=width)  # fmt: skip
                )
                for r in range(n):  # the transfer: one descriptor per row
                    mem.memmove(addr(src) + r * stride, addr(decode[b]) + (r0 + r) * width + c0, w)
    for b in range(n_buffers):
        np.testing.assert_array_equal(decode[b], truth[b])  # the pieces tile the buffer

    per_sender = {s: digest_blocks_host(Blocks.concat(bl), keys) for s, bl in blocks.items()}
    total = [0] * n_buffers
    for sums in per_sender.values():
        for b in range(n_buffers):
            total[b] = kd.add64(total[b], int(sums[b]))
    own = [digest_bytes(decode[b], keys[b]) for b in range(n_buffers)]
    assert total == own
    assert own == [oracle_digest(truth[b].tobytes(), keys[b]) for b in range(n_buffers)]
    # the decode's own digest through request_blocks (every row a "page") gives the same sums
    pb = kv.request_blocks(SimpleNamespace(kv_data_ptrs=[addr(d) for d in decode],
                                           kv_item_lens=[width] * n_buffers, state_data_ptrs=[],
                                           state_item_lens=[]), np.arange(rows), None)
    assert [int(x) for x in digest_blocks_host(pb, keys)] == own

    # a piece lost, or a piece written twice, breaks the sums of its buffer only
    s = next(s for s, bl in blocks.items() if bl)
    lost = Blocks.concat(blocks[s][1:])
    twice = Blocks.concat(blocks[s] + blocks[s][:1])
    b = int(blocks[s][0].slot[0])
    for bad in (lost, twice):
        sums = digest_blocks_host(bad, keys)
        t = [kd.add64(total[i], int(sums[i]) - int(per_sender[s][i])) for i in range(n_buffers)]
        assert t[b] != own[b] and t[1 - b] == own[1 - b]


# == 3. every draft layout the planner accepts ================================================

PAGE = 4
N_SRC_POOL, N_DST_POOL = 7, 8


def _page_lists(rng):
    n = int(rng.integers(1, 5))
    if rng.random() < 0.5:  # runs, as allocators give
        s0, d0 = int(rng.integers(0, N_SRC_POOL - n + 1)), int(rng.integers(0, N_DST_POOL - n + 1))
        return list(range(s0, s0 + n)), list(range(d0, d0 + n))
    return (
        rng.choice(N_SRC_POOL, n, replace=False).tolist(),
        rng.choice(N_DST_POOL, n, replace=False).tolist(),
    )


def _check_layout(shape, prefill_tp, decode_tp, rng):
    """Transfer and digest one layout; returns (regimes, decode ranks checked)."""
    H = shape.total_heads
    entries = ((0, K), (1, V))
    src_pages, dst_pages = _page_lists(rng)
    mem = Memory()
    # One random draft KV per entry over all heads: [page, token, head, bytes]. A prefill rank's
    # pool is its heads' slice (replicas hold the same bytes, as they do in a server).
    truth = {
        e: rng.integers(0, 256, size=(N_SRC_POOL, PAGE, H, shape.head_dim(c) * shape.dtype_bytes),
                        dtype=np.uint8)  # fmt: skip
        for e, c in entries
    }
    prefill = {}
    for p in range(prefill_tp):
        g = DraftKVGeometry.for_rank(shape, side="prefill", tp_size=prefill_tp, tp_rank=p,
                                     page_size=PAGE)  # fmt: skip
        pools = {}
        for e, c in entries:
            a = mem.alloc(N_SRC_POOL * g.page_bytes(c))
            h = g.owned_heads
            a[:] = np.ascontiguousarray(truth[e][:, :, h.start : h.stop, :]).reshape(-1)
            pools[e] = a
        prefill[p] = (g, pools)
    regimes = set()
    for r in range(decode_tp):
        dg = DraftKVGeometry.for_rank(shape, side="decode", tp_size=decode_tp, tp_rank=r,
                                      page_size=PAGE)  # fmt: skip
        dpools = {e: mem.alloc(N_DST_POOL * dg.page_bytes(c)) for e, c in entries}
        contributions = []
        digested = {e: 0 for e, _ in entries}
        for p in prefill_ranks_for(r, prefill_tp=prefill_tp, decode_tp=decode_tp):
            pg, pools = prefill[p]
            plan = plan_pair(pg, dg)
            if not plan.writer:
                continue
            regimes.add(plan.regime)
            blocks = []
            for e, c in entries:
                d = per_token_descriptors(plan, c, addr(pools[e]), addr(dpools[e]), src_pages,
                                          dst_pages)  # fmt: skip
                for s, t, n in zip(d.src.tolist(), d.dst.tolist(), d.length.tolist()):
                    mem.memmove(s, t, n, pools[e], dpools[e])
                b = digest_blocks(plan, c, addr(pools[e]), e, src_pages, dst_pages)
                mem.check_blocks_read(b, pools[e])
                digested[e] += b.total_bytes
                blocks.append(b)
            entry_keys = [buffer_key(BufferKind.KV, e) for e, _ in entries]
            sums = digest_blocks_host(Blocks.concat(blocks), entry_keys)
            c = Contribution(room=7, sender=Sender(0, p, p))
            for e, _ in entries:
                c.add(BufferKind.KV, e, int(sums[e]))
            contributions.append(c)
        # exactly one writer per decode byte: the writers digest exactly the request's bytes
        for e, c in entries:
            assert digested[e] == len(dst_pages) * dg.page_bytes(c), (prefill_tp, decode_tp, H, r)
        # independent oracle of the bytes: the decode rank's heads of the source pages
        for e, c in entries:
            want = np.zeros((N_DST_POOL, PAGE, dg.heads_per_rank, truth[e].shape[-1]), np.uint8)
            h = dg.owned_heads
            want[dst_pages] = truth[e][src_pages][:, :, h.start : h.stop, :]
            np.testing.assert_array_equal(
                dpools[e], want.reshape(-1), err_msg=f"TP{prefill_tp}->TP{decode_tp} H{H} rank {r}"
            )
        kv_args = SimpleNamespace(
            kv_data_ptrs=[addr(dpools[e]) for e, _ in entries],
            kv_item_lens=[dg.page_bytes(c) for _, c in entries],
            state_data_ptrs=[],
            state_item_lens=[],
            num_draft_entries=2,
            kv_layer_ids=[],
        )
        tables = kv.decode_tables(kv_args)
        keys = kd.slots_of(tables)

        def own_sums():
            blocks = kv.request_blocks(kv_args, dst_pages, None)
            return kd.as_sums(tables, digest_blocks_host(blocks, keys))

        actual = own_sums()
        assert set(actual) == {(int(BufferKind.KV), 0), (int(BufferKind.KV), 1)}
        assert compare(actual, contributions) == [], (prefill_tp, decode_tp, H, r)

        if r == (decode_tp - 1) // 2:  # the fault: one received byte changes
            e = int(rng.integers(2))
            page = int(rng.choice(dst_pages))
            item = dg.page_bytes(entries[e][1])
            at = page * item + int(rng.integers(item))
            old = int(dpools[e][at])
            dpools[e][at] ^= np.uint8(int(rng.integers(1, 256)))
            bad = compare(own_sums(), contributions)
            assert [(m.kind, m.index) for m in bad] == [(BufferKind.KV, e)]
            assert bad[0].senders == tuple(c.sender for c in contributions)
            assert bad[0].actual != bad[0].expected
            # one block per page (not per page run) sees the same corrupted sums
            pb = per_page_blocks(kv_args.kv_data_ptrs, kv_args.kv_item_lens, dst_pages)
            assert kd.as_sums(tables, digest_blocks_host(pb, keys)) == own_sums()
            dpools[e][at] = old
            assert compare(own_sums(), contributions) == []
            # a byte outside the request's pages is not the request's
            spare = next(pg for pg in range(N_DST_POOL) if pg not in dst_pages)
            dpools[e][spare * dg.page_bytes(entries[e][1])] ^= 1
            assert compare(own_sums(), contributions) == []
    return regimes, decode_tp


def test_every_accepted_draft_layout_composes():
    t0 = time.monotonic()
    rng = np.random.default_rng(5)
    layouts = refused = decode_ranks = 0
    regimes_by_heads = {}
    for heads in HEADS:
        shape = DraftKVShape(total_heads=heads, k_head_dim=4, v_head_dim=6, dtype_bytes=2)
        seen = set()
        for prefill_tp, decode_tp in itertools.product(TPS, TPS):
            try:
                regimes, n = _check_layout(shape, prefill_tp, decode_tp, rng)
            except DraftKVLayoutError:
                refused += 1
                continue
            layouts += 1
            decode_ranks += n
            seen |= regimes
        regimes_by_heads[heads] = seen
    print(
        f"\nKV digest: {layouts} draft layouts checked ({refused} refused), {decode_ranks} decode "
        f"ranks, {time.monotonic() - t0:.1f} s"
    )
    # Power-of-two TP sizes and heads always nest: the planner accepts every pair.
    assert (layouts, refused) == (len(TPS) ** 2 * len(HEADS), 0)
    assert decode_ranks == len(HEADS) * len(TPS) * sum(TPS)
    assert set().union(*regimes_by_heads.values()) == set(Regime)
    assert regimes_by_heads[1] == {Regime.WHOLE_PAGES}  # one head: h_P == h_D == 1 always
    for heads in HEADS[1:]:
        assert regimes_by_heads[heads] == set(Regime), heads


def test_digest_blocks_refuses_a_non_writer():
    shape = DraftKVShape(total_heads=2, k_head_dim=4, v_head_dim=6, dtype_bytes=2)
    dst = DraftKVGeometry.for_rank(shape, side="decode", tp_size=1, tp_rank=0, page_size=PAGE)
    # prefill TP 4 over 2 heads: ranks 0, 1 hold head 0; 2, 3 head 1; 1 and 3 lose the election
    writers = []
    for p in range(4):
        src = DraftKVGeometry.for_rank(shape, side="prefill", tp_size=4, tp_rank=p, page_size=PAGE)
        plan = plan_pair(src, dst)
        writers.append(plan.writer)
        if not plan.writer:
            with pytest.raises(ValueError, match="not a writer"):
                digest_blocks(plan, K, 0, 0, [1], [2])
    assert writers == [True, False, True, False]


# == 4. a PP split of the target KV ===========================================================

L = 6
ROWS, ROW_BYTES = 4, 72  # page = S rows of R bytes (MLA-like: one buffer per layer)
ITEM = ROWS * ROW_BYTES
STATE_ITEM, STATE_HALF = 48, 24  # a state slot, written as two TP slices
N_POOL, N_STATE = 10, 5


def _runs(src_pages, dst_pages):
    """Contiguous pages merged, as sglang's send path groups them (written out here)."""
    out = []
    for s, d in zip(src_pages, dst_pages):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return out


class PPWorld:
    """Prefill PP stages (each a buffer per layer it holds; the last stage's two TP ranks hold a
    state slice each) and one decode rank holding all layers and the state."""

    def __init__(self, split, rng):
        assert sum(split) == L
        self.mem = Memory()
        self.split = split
        self.stage_layers = []
        start = 0
        for n in split:
            self.stage_layers.append(list(range(start, start + n)))
            start += n
        self.src = {l: self.mem.alloc(N_POOL * ITEM, rng) for l in range(L)}
        self.src_state = [self.mem.alloc(N_STATE * STATE_HALF, rng) for _ in range(2)]
        # decode buffers with *descending* bases in entry order: resolve must not assume order
        bufs = sorted((self.mem.alloc(N_POOL * ITEM) for _ in range(L)), key=addr, reverse=True)
        self.dst = dict(enumerate(bufs))
        assert [addr(b) for b in bufs] == sorted((addr(b) for b in bufs), reverse=True)
        self.dst_state = self.mem.alloc(N_STATE * STATE_ITEM)
        self.kv_args = SimpleNamespace(
            kv_data_ptrs=[addr(self.dst[l]) for l in range(L)],
            kv_item_lens=[ITEM] * L,
            state_data_ptrs=[[addr(self.dst_state)]],
            state_item_lens=[[STATE_ITEM]],
            num_draft_entries=0,
            kv_layer_ids=list(range(L)),
        )
        self.kv_table = BufferTable(BufferKind.KV, self.kv_args.kv_data_ptrs)
        self.state_table = BufferTable(BufferKind.STATE, [addr(self.dst_state)], first_slot=L)
        self.tables = (self.kv_table, self.state_table)
        self.keys = kd.slots_of(self.tables)
        assert self.keys == kd.slots_of(kv.decode_tables(self.kv_args))
        last = len(split) - 1
        self.senders = [Sender(s, 0, 2 * s) for s in range(len(split))]
        self.senders.append(Sender(last, 1, 2 * last + 1))  # the last stage's second TP rank

    def reset(self):
        for b in list(self.dst.values()) + [self.dst_state]:
            b[:] = 0

    def kv_descriptors(self, stage, src_pages, dst_pages):
        out = []
        for l in self.stage_layers[stage]:
            for s0, d0, n in _runs(src_pages, dst_pages):
                out.append((addr(self.src[l]) + s0 * ITEM, addr(self.dst[l]) + d0 * ITEM, n * ITEM))
        return out

    def state_descriptor(self, tp, src_slot, dst_slot):
        src = addr(self.src_state[tp]) + src_slot * STATE_HALF
        return src, addr(self.dst_state) + dst_slot * STATE_ITEM + tp * STATE_HALF, STATE_HALF

    def send(self, src_pages, dst_pages, src_slot, dst_slot, *, tamper=None):
        """Every sender transfers and digests what it writes; returns the wire frames.
        ``tamper(sender_index, kv, state) -> (kv, state, digest_kv, digest_state)``."""
        frames = []
        last = len(self.split) - 1
        for i, sender in enumerate(self.senders):
            kv_d, st_d = [], []
            if sender.tp_rank == 0:  # the target KV is replicated over TP: TP rank 0 sends it
                kv_d = self.kv_descriptors(sender.pp_rank, src_pages, dst_pages)
            if sender.pp_rank == last:
                st_d = [self.state_descriptor(sender.tp_rank, src_slot, dst_slot)]
            dig_kv, dig_st = kv_d, st_d
            if tamper is not None:
                kv_d, st_d, dig_kv, dig_st = tamper(i, kv_d, st_d)
            for s, t, n in kv_d + st_d:
                self.mem.memmove(s, t, n)
            blocks = [
                table.blocks(*map(list, zip(*d))) if d else Blocks.empty()
                for table, d in ((self.kv_table, dig_kv), (self.state_table, dig_st))
            ]
            sums = digest_blocks_host(Blocks.concat(blocks), self.keys)
            c = Contribution(room=1234, sender=sender)
            c.add_slots(self.tables, sums)
            wire = kd.encode(c)
            assert kd.decode(wire) == c
            frames.append(wire)
        return frames

    def own_sums(self, dst_pages, dst_slot):
        blocks = kv.request_blocks(self.kv_args, dst_pages, [dst_slot])
        tables = kv.decode_tables(self.kv_args)
        return kd.as_sums(tables, digest_blocks_host(blocks, kd.slots_of(tables)))


SPLITS = [(6,), (3, 3), (2, 2, 2), (1, 5), (4, 2), (1, 2, 3)]


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_pp_split_of_the_target_kv(split):
    rng = np.random.default_rng(hash(split) & 0xFFFF)
    world = PPWorld(split, rng)
    src_pages, dst_pages = [2, 3, 4, 8, 0, 1], [5, 6, 7, 1, 3, 4]  # runs of 3, 1 and 2 pages
    assert len(_runs(src_pages, dst_pages)) == 3  # (2,3,4->5,6,7) (8->1) (0,1->3,4)
    src_slot, dst_slot = 3, 1

    def contributions(frames):
        return [kd.decode(f) for f in frames]

    frames = world.send(src_pages, dst_pages, src_slot, dst_slot)
    # the bytes arrived (independent check against the sources)
    for l in range(L):
        for s, d in zip(src_pages, dst_pages):
            np.testing.assert_array_equal(world.dst[l][d * ITEM : (d + 1) * ITEM],
                                          world.src[l][s * ITEM : (s + 1) * ITEM])  # fmt: skip
    for tp in range(2):
        np.testing.assert_array_equal(
            world.dst_state[dst_slot * STATE_ITEM + tp * STATE_HALF :][:STATE_HALF],
            world.src_state[tp][src_slot * STATE_HALF :][:STATE_HALF],
        )
    cs = contributions(frames)
    actual = world.own_sums(dst_pages, dst_slot)
    assert len(actual) == L + 1
    assert compare(actual, cs) == []
    # who wrote what: stage s's KV sender sums exactly its layers; the last stage's TP ranks the
    # state
    for c in cs:
        kv_idx = {i for (k, i) in c.sums if k == int(BufferKind.KV)}
        layers = set(world.stage_layers[c.sender.pp_rank]) if c.sender.tp_rank == 0 else set()
        assert kv_idx == layers
        assert ((int(BufferKind.STATE), 0) in c.sums) == (c.sender.pp_rank == len(split) - 1)

    # a descriptor off by one page: layer `bad`'s first run lands one page later
    bad = split[0] - 1 if len(split) > 1 else 2
    stage = next(s for s, ls in enumerate(world.stage_layers) if bad in ls)
    sender_i = stage  # stage s's TP-0 sender

    def off_by_one(i, kv_d, st_d, digest_too):
        if i != sender_i:
            return kv_d, st_d, kv_d, st_d
        j = world.stage_layers[stage].index(bad) * len(_runs(src_pages, dst_pages))
        kv_bad = list(kv_d)
        s, t, n = kv_bad[j]
        kv_bad[j] = (s, t + ITEM, n)
        assert t + ITEM + n <= addr(world.dst[bad]) + world.dst[bad].nbytes
        return kv_bad, st_d, (kv_bad if digest_too else kv_d), st_d

    for digest_too in (True, False):  # a wrong plan (digested as sent), a wrong transfer
        world.reset()
        frames = world.send(src_pages, dst_pages, src_slot, dst_slot,
                            tamper=lambda i, k, s: off_by_one(i, k, s, digest_too))  # fmt: skip
        mm = compare(world.own_sums(dst_pages, dst_slot), contributions(frames))
        assert [(m.kind, m.index) for m in mm] == [(BufferKind.KV, bad)], digest_too
        assert mm[0].senders == (world.senders[sender_i],)
        message = kv.mismatch_message(1234, "rid-x", world.kv_args, mm)
        assert f"target KV entry {bad} layer {bad} (of {L} target entries)" in message
        assert world.senders[sender_i].describe() in message

    # a sender whose contribution never arrived
    world.reset()
    frames = world.send(src_pages, dst_pages, src_slot, dst_slot)
    missing = 0  # stage 0's KV sender
    mm = compare(world.own_sums(dst_pages, dst_slot), contributions(frames[1:]))
    if len(split) == 1:  # it also wrote half the state, which the other TP rank's sum lacks
        assert [(m.kind, m.index) for m in mm] == [(BufferKind.KV, l) for l in range(L)] + [
            (BufferKind.STATE, 0)
        ]
        assert mm[-1].senders == (world.senders[-1],)
    else:
        lost = [(BufferKind.KV, l) for l in world.stage_layers[missing]]
        assert [(m.kind, m.index) for m in mm] == lost
    for m in mm:
        if m.kind is BufferKind.KV:
            assert m.senders == () and kd.describe_senders(m.senders) == "no sender wrote it"
            assert m.expected == 0
    assert "no sender wrote it" in kv.mismatch_message(1234, "r", world.kv_args, mm)
    # the state's second TP slice missing: the state buffer only, naming the slice that did arrive
    mm = compare(world.own_sums(dst_pages, dst_slot), contributions(frames[:-1]))
    assert [(m.kind, m.index) for m in mm] == [(BufferKind.STATE, 0)]
    assert mm[0].senders == (world.senders[len(split) - 1],)
    assert "state component 0" in kv.mismatch_message(1234, "r", world.kv_args, mm)


def test_wire_format_round_trip_and_refusals():
    c = Contribution(room=2**63 + 5, sender=Sender(3, 7, 15))
    c.add(BufferKind.KV, 0, M64)
    c.add(BufferKind.KV, 0, 2)  # wraps
    c.add(BufferKind.STATE, 4, 12345)
    assert c.sums[(int(BufferKind.KV), 0)] == 1
    frames = kd.encode(c)
    assert frames[0] == kd.MESSAGE_TAG
    assert kd.decode(frames) == c
    with pytest.raises(ValueError):
        kd.decode([b"OTHER", frames[1], frames[2]])
    with pytest.raises(ValueError):
        kd.decode([frames[0], frames[1], frames[2][:-1]])
    with pytest.raises(ValueError):
        kd.decode(frames[:2])


def test_buffer_table_resolves_addresses():
    t = BufferTable(BufferKind.KV, [5000, 1000, 3000], first_slot=2)
    index, offset = t.resolve([1000, 2999, 3000, 5004, 4999])
    assert index.tolist() == [1, 1, 2, 0, 2]
    assert offset.tolist() == [0, 1999, 0, 4, 1999]
    b = t.blocks([1, 2], [3004, 5008], [8, 12])
    assert b.slot.tolist() == [4, 2] and b.dst.tolist() == [4, 8] and b.nbytes.tolist() == [8, 12]
    with pytest.raises(ValueError, match="below every decode buffer"):
        t.resolve([999])
    with pytest.raises(ValueError, match="consecutive slots"):
        kd.slots_of(
            [BufferTable(BufferKind.KV, [1, 2]), BufferTable(BufferKind.STATE, [9], first_slot=3)]
        )



def _per_list(tables, srcs, dsts, lengths):
    """The oracle: each list resolved alone by its own table (``BufferTable.blocks``)."""
    return kd.Blocks.concat([t.blocks(s, d, n) for t, s, d, n in zip(tables, srcs, dsts, lengths)])


@pytest.mark.parametrize("seed", range(6))
def test_descriptor_lists_resolved_together_equal_each_resolved_alone(seed):
    """Decode ranks are other processes: their registered addresses overlap from table to table
    (here they are drawn from one range), a table may serve several lists, and one list may be
    empty; resolving every list in one pass gives each list's blocks exactly, in order."""
    rng = np.random.default_rng(seed)
    tables = []
    for i in range(int(rng.integers(1, 9))):
        bases = rng.choice(1 << 20, int(rng.integers(1, 12)), replace=False) * 4096 + (1 << 44)
        tables.append(BufferTable(BufferKind(1 + i % 2), bases.tolist(), first_slot=int(rng.integers(0, 40))))
    use = [tables[int(rng.integers(len(tables)))] for _ in range(int(rng.integers(1, 20)))]
    srcs, dsts, lengths = [], [], []
    for t in use:
        n = int(rng.integers(0, 50))
        dsts.append((t.bases[rng.integers(0, len(t), n)] + rng.integers(0, 4096, n) * 4).tolist())
        srcs.append(rng.integers(0, 1 << 40, n).tolist())
        lengths.append((rng.integers(1, 1000, n) * 4).tolist())
    resolver = kd.ListResolver()
    for _ in range(2):  # the joined tables made, then reused
        got, ends = resolver.resolve(use, srcs, dsts, lengths)
        want = _per_list(use, srcs, dsts, lengths)
        assert all((a == b).all() for a, b in zip(got, want))
        assert ends.tolist() == np.cumsum([len(s) for s in srcs]).tolist()


def test_descriptor_lists_past_the_joined_range_or_below_every_buffer():
    """Addresses at or past 2**52 are resolved list by list (the same blocks); a destination
    below its own table's buffers is refused even where another table's buffers lie below it."""
    high = BufferTable(BufferKind.KV, [1 << 60, (1 << 60) + 4096])
    low = BufferTable(BufferKind.KV, [4096, 8192], first_slot=2)
    args = ([high, low], [[1, 2], [3]], [[(1 << 60) + 4100, (1 << 60) + 8], [8196]], [[4, 8], [12]])
    got, ends = kd.ListResolver().resolve(*args)
    want = _per_list(*args)
    assert all((a == b).all() for a, b in zip(got, want)) and ends.tolist() == [2, 3]
    assert got.slot.tolist() == [1, 0, 3] and got.dst.tolist() == [4, 8, 4]
    other = BufferTable(BufferKind.KV, [1 << 30], first_slot=0)
    with pytest.raises(ValueError, match="below every decode buffer"):
        kd.ListResolver().resolve([low, other], [[1], [2]], [[4096], [4096]], [[4], [4]])
    # a negative base (no real pointer) goes list by list too: the shift cannot tell it apart
    negative = BufferTable(BufferKind.KV, [-4096], first_slot=5)
    args = ([negative, low], [[1], [2]], [[-4092], [(1 << 52) - 100]], [[4], [4]])
    got, _ = kd.ListResolver().resolve(*args)
    assert all((a == b).all() for a, b in zip(got, _per_list(*args)))
    assert got.slot.tolist() == [5, 3]
    with pytest.raises(ValueError, match="differ in count"):  # rows never shift between lists
        kd.ListResolver().resolve([low, low], [[1], [2, 3]], [[4096, 4100], [8192]], [[4], [4, 4]])

# == 5. the decode's messages =================================================================


def test_describe_buffer_names_target_draft_and_state():
    kv_args = SimpleNamespace(
        kv_data_ptrs=[100, 200, 300, 400, 500, 600, 700],
        kv_item_lens=[8] * 7,
        state_data_ptrs=[[800, 900]],
        state_item_lens=[[4, 4]],
        num_draft_entries=4,  # K0, K1, V0, V1 after 3 target entries
        kv_layer_ids=[],
    )
    d = lambda i: kv.describe_buffer(kv_args, BufferKind.KV, i)  # noqa: E731
    want = [f"target KV entry {i} (of 3 target entries)" for i in range(3)]
    assert [d(i) for i in range(3)] == want
    assert d(3) == "draft KV entry 3 (K, draft layer 0)"
    assert d(4) == "draft KV entry 4 (K, draft layer 1)"
    assert d(5) == "draft KV entry 5 (V, draft layer 0)"
    assert d(6) == "draft KV entry 6 (V, draft layer 1)"
    assert kv.describe_buffer(kv_args, BufferKind.STATE, 1) == "state component 1 (KDA / Mamba)"
    # with layer ids for the target entries
    kv_args.kv_layer_ids = [10, 11, 12]
    assert d(1) == "target KV entry 1 layer 11 (of 3 target entries)"
    assert d(5) == "draft KV entry 5 (V, draft layer 0)"
    # no draft entries: every entry is a target one
    plain = SimpleNamespace(**{**vars(kv_args), "num_draft_entries": 0, "kv_layer_ids": None})
    assert kv.describe_buffer(plain, BufferKind.KV, 6) == "target KV entry 6 (of 7 target entries)"

    s = [Sender(0, 1, 1), Sender(1, 0, 2)]
    mm = [
        kd.Mismatch(BufferKind.KV, 0, 1, 2, (s[1],)),
        kd.Mismatch(BufferKind.KV, 4, 3, 4, (s[0], s[1])),
        kd.Mismatch(BufferKind.KV, 5, 0, 5, ()),
        kd.Mismatch(BufferKind.STATE, 1, 6, 7, (s[0],)),
        kd.Mismatch(BufferKind.KV, 6, 8, 9, ()),
        kd.Mismatch(BufferKind.KV, 2, 8, 9, ()),
    ]
    msg = kv.mismatch_message(42, "req-1", kv_args, mm)
    assert msg.startswith("KV checksum mismatch: room 42 (req req-1) on this decode rank: ")
    assert ("target KV entry 0 layer 10 (of 3 target entries): expected 0x0000000000000001, got "
            "0x0000000000000002, written by prefill pp rank 1 / attention TP rank 0") in msg
    assert ("draft KV entry 4 (K, draft layer 1): expected 0x0000000000000003, got "
            "0x0000000000000004, written by prefill pp rank 0 / attention TP rank 1, prefill pp "
            "rank 1 / attention TP rank 0") in msg  # fmt: skip
    assert ("draft KV entry 5 (V, draft layer 0): expected 0x0000000000000000, got "
            "0x0000000000000005, no sender wrote it") in msg
    assert "state component 1 (KDA / Mamba): expected 0x0000000000000006" in msg
    assert "draft KV entry 6" not in msg and msg.endswith("; and 2 more buffer(s)")
    assert kv.mismatch_message(1, 2, kv_args, mm[:4]).count(";") == 3
