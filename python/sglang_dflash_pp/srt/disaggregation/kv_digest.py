"""A KV digest that composes across senders and layouts: what makes a PD transfer checkable when
prefill and decode hold different shares of it (another TP width, PP stages, head slices).

Stock's ``--disaggregation-enable-kv-checksum`` digests a prefill rank's whole KV range and
compares it with the decode's only when both sides have the same layout signature; a PP stage or
another TP width is admitted unverified. Here every 4-byte word a decode rank ends up holding is
a term of a sum, and the term depends only on the word and on **where it sits on that decode
rank**: the decode buffer (a KV entry or a state component, by its index in the decode's own
registration, which every sender addresses) and the word's byte offset in that buffer. A term
does not depend on who wrote it, so each sender adds up the terms of the words it writes to a
decode rank, the decode adds the senders' sums per buffer, and compares them with the sum over
its own bytes of the request. Every decode byte has exactly one writer (stock's rank mapping and
the draft plan's writer election), so the sums meet exactly when every byte arrived intact at
the right place; addition mod 2**64 needs no order, no collective and no coordination between
senders.

The term of word ``w`` at word offset ``o`` of buffer key ``k`` (all uint32 arithmetic)::

    base = fmix32(k + (o >> 32) * 0x27D4EB2F)
    c1   = base + (o & 0xFFFFFFFF) * 0x9E3779B1
    lo   = fmix32(w ^ c1)
    hi   = fmix32(w ^ ((c1 ^ 0x5BD1E995) * 0xCC9E2D51))
    term = lo + hi * 2**32            (summed mod 2**64)

``fmix32`` (murmur3's finaliser) is a bijection, so a single changed word changes its term's
low half and hence the sum: **one flipped byte is always detected**. A word written to the wrong
place contributes a term with other coordinates, which misses the decode's sum with probability
about 2**-64 per disagreeing buffer.

Blocks, the unit of work: ``(src address, dst offset, bytes per row, rows, src row stride, dst
row stride, slot)``: ``rows`` runs of ``bytes per row`` bytes read at ``src + r * src stride``,
landing at decode offset ``dst offset + r * dst stride`` of the buffer ``slot`` names. A stock
Mooncake descriptor is one row; a head slice of a page is ``page_size`` strided rows. The GPU
kernel (``kv_digest_triton``) and the host reference here take the same table.

Stdlib and numpy only.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import itertools
import struct
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, NamedTuple, Sequence, Tuple

import numpy as np

from sglang_dflash_pp.srt.disaggregation.column_arrays import concat_columns

M32 = 0xFFFFFFFF
OH_MUL = 0x27D4EB2F
OL_MUL = 0x9E3779B1
C2_XOR = 0x5BD1E995
C2_MUL = 0xCC9E2D51
FMIX_1 = 0x85EBCA6B
FMIX_2 = 0xC2B2AE35
WORD = 4


class BufferKind(enum.IntEnum):
    """What a decode buffer index counts: ``kv_args.kv_data_ptrs`` or the flattened
    ``kv_args.state_data_ptrs`` of the decode's registration."""

    KV = 1
    STATE = 2


def buffer_key(kind: BufferKind, index: int) -> int:
    """The uint32 key of one decode buffer."""
    return int(fmix32_int((int(kind) * 0x01000193 + int(index) * 0x9E3779B1 + 0x2545F491) & M32))


def fmix32_int(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * FMIX_1) & M32
    x ^= x >> 13
    x = (x * FMIX_2) & M32
    x ^= x >> 16
    return x


def _fmix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(FMIX_1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(FMIX_2)
    return x ^ (x >> np.uint32(16))


def word_terms(words: np.ndarray, word_offsets: np.ndarray, key: int) -> np.ndarray:
    """The uint64 term of each word (uint32) at its word offset (uint64) in buffer ``key``."""
    w = np.asarray(words, dtype=np.uint32)
    o = np.asarray(word_offsets, dtype=np.uint64)
    with np.errstate(over="ignore"):
        oh = (o >> np.uint64(32)).astype(np.uint32)
        ol = (o & np.uint64(M32)).astype(np.uint32)
        base = _fmix32(np.uint32(key) + oh * np.uint32(OH_MUL))
        c1 = base + ol * np.uint32(OL_MUL)
        lo = _fmix32(w ^ c1)
        hi = _fmix32(w ^ ((c1 ^ np.uint32(C2_XOR)) * np.uint32(C2_MUL)))
    return lo.astype(np.uint64) | (hi.astype(np.uint64) << np.uint64(32))


def wrap_sum(terms: np.ndarray) -> int:
    """Sum mod 2**64 (numpy's uint64 sum wraps)."""
    return int(np.sum(np.asarray(terms, dtype=np.uint64), dtype=np.uint64))


def add64(a: int, b: int) -> int:
    return (int(a) + int(b)) & 0xFFFFFFFFFFFFFFFF


def digest_bytes(data, key: int, dst_offset: int = 0) -> int:
    """Digest of contiguous bytes landing at byte ``dst_offset`` of buffer ``key``."""
    raw = np.ascontiguousarray(np.asarray(data).reshape(-1)).view(np.uint8)
    _check_words(dst_offset, raw.size)
    words = raw.view(np.uint32)
    offsets = np.arange(words.size, dtype=np.uint64) + np.uint64(dst_offset // WORD)
    return wrap_sum(word_terms(words, offsets, key))


def _check_words(*values: int) -> None:
    for v in values:
        if int(v) % WORD:
            raise ValueError(f"KV digest works in {WORD}-byte words; got an offset or length {v}")


# -- blocks ---------------------------------------------------------------------------------


class Blocks(NamedTuple):
    """A digest's work as parallel int64 arrays (module docstring)."""

    src: np.ndarray
    dst: np.ndarray  # byte offset in the decode buffer
    nbytes: np.ndarray  # per row
    rows: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray
    slot: np.ndarray  # index into the digest's key table

    @classmethod
    def empty(cls) -> "Blocks":
        z = np.zeros(0, dtype=np.int64)
        return cls(*(z for _ in cls._fields))

    @classmethod
    def of(cls, src, dst, nbytes, slot, rows=1, src_stride=0, dst_stride=0) -> "Blocks":
        """Columns from arrays of the blocks' count or scalars (the send path calls this per
        decode rank and chunk: no copies beyond one array per column)."""
        src = np.asarray(src, dtype=np.int64).reshape(-1)
        n = src.size

        def col(v):
            if np.ndim(v) == 0:
                return np.full(n, int(v), dtype=np.int64)
            a = np.asarray(v, dtype=np.int64).reshape(-1)
            return a if a.size == n else np.broadcast_to(a, (n,)).copy()

        return cls(src, col(dst), col(nbytes), col(rows), col(src_stride), col(dst_stride),
                   col(slot))  # fmt: skip

    def fingerprint(self) -> bytes:
        """Equal for equal blocks (so equal sums): several decode ranks often receive the same
        bytes at the same offsets (replicated MLA KV, a draft head held by several ranks)."""
        h = hashlib.blake2b(digest_size=16)
        for column in self:
            h.update(np.ascontiguousarray(column).data)
        return h.digest()

    @classmethod
    def concat(cls, parts: Sequence["Blocks"]) -> "Blocks":
        return concat_columns(cls, parts)

    @property
    def count(self) -> int:
        return int(self.src.size)

    @property
    def total_bytes(self) -> int:
        return int((self.nbytes * self.rows).sum())

    def table(self) -> np.ndarray:
        """``[n, 7]`` int64, the kernel's input."""
        return np.stack(list(self), axis=1) if self.count else np.zeros((0, 7), np.int64)

    def check_words(self) -> None:
        for name in ("src", "dst", "nbytes", "src_stride", "dst_stride"):
            bad = getattr(self, name) % WORD
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"KV digest works in {WORD}-byte words; block {i} has {name} "
                    f"{int(getattr(self, name)[i])}"
                )


class BufferTable:
    """The decode buffers of one registration as digest slots: sorted bases, for resolving a
    descriptor's destination address to (slot, offset)."""

    def __init__(self, kind: BufferKind, bases: Sequence[int], first_slot: int = 0):
        self.kind = kind
        self.bases = np.asarray([int(b) for b in bases], dtype=np.int64)
        self.first_slot = first_slot
        self._order = np.argsort(self.bases, kind="stable")
        self._sorted = self.bases[self._order]

    def __len__(self) -> int:
        return int(self.bases.size)

    def keys(self) -> List[int]:
        return [buffer_key(self.kind, i) for i in range(len(self))]

    def resolve(self, dst_addresses) -> Tuple[np.ndarray, np.ndarray]:
        """(buffer index, byte offset) of each destination address: the buffer with the
        greatest base at or below it (registered buffers do not interleave)."""
        dst = np.asarray(dst_addresses, dtype=np.int64).reshape(-1)
        pos = np.searchsorted(self._sorted, dst, side="right") - 1
        if dst.size and (pos < 0).any():
            raise ValueError("a descriptor's destination lies below every decode buffer")
        index = self._order[pos]
        return index, dst - self.bases[index]

    def blocks(self, src, dst, length) -> Blocks:
        index, offset = self.resolve(dst)
        return Blocks.of(src, offset, length, index + self.first_slot)


# Tables resolved together are told apart by this bit and above of a shifted address (every
# registered address lies below it: 4 PiB, over the 47- to 52-bit virtual addresses of x86-64,
# CUDA and arm64); more tables than fit, or an address past it or below 0, resolve one list at
# a time.
_TABLE_SHIFT = 52
_MAX_TABLES = (1 << (63 - _TABLE_SHIFT)) - 1


class _Joined(NamedTuple):
    """Several tables' sorted bases in one array, table ``t``'s shifted by ``t << 52``."""

    tables: Tuple[BufferTable, ...]
    keys: np.ndarray  # shifted sorted bases
    bases: np.ndarray  # the same, unshifted
    slots: np.ndarray  # the slot of each
    starts: np.ndarray  # where each table's bases begin in ``keys``
    shiftable: bool  # few enough tables, every base in [0, 2**52): the shift tells them apart


def _joined(tables: Tuple[BufferTable, ...]) -> _Joined:
    keys = [t._sorted + (i << _TABLE_SHIFT) for i, t in enumerate(tables)]
    bases = np.concatenate([t._sorted for t in tables])
    return _Joined(
        tables,
        np.concatenate(keys),
        bases,
        np.concatenate([t._order + t.first_slot for t in tables]),
        np.cumsum([0] + [len(t) for t in tables[:-1]]).astype(np.int64),
        len(tables) <= _MAX_TABLES
        and not (bases.size and (int(bases.min()) < 0 or int(bases.max()) >> _TABLE_SHIFT)),
    )


class ListResolver:
    """Resolves many descriptor lists, each against its own decode's table, in a few numpy passes
    rather than a few per list: what one digest of a chunk's sends (8 decode ranks' target and
    state lists) costs the host (``benchmark/gpu/results``). Keeps the joined tables of the last
    few sets of tables it resolved against (a prefill sends every chunk to the same decodes)."""

    _CACHED = 32

    def __init__(self):
        self._joined: Dict[Tuple[int, ...], _Joined] = {}

    def resolve(self, tables: Sequence[BufferTable], srcs: Sequence[Sequence[int]],
                dsts: Sequence[Sequence[int]], lengths: Sequence[Sequence[int]]
                ) -> Tuple[Blocks, np.ndarray]:  # fmt: skip
        """The blocks of list ``i`` (``srcs[i]``, ``dsts[i]``, ``lengths[i]``, one row each,
        destinations resolved against ``tables[i]``) in list order, and each list's end row.
        Equal to ``Blocks.concat(tables[i].blocks(...) for i)``; raises ValueError as
        :meth:`BufferTable.resolve` does."""
        counts = [len(s) for s in srcs]
        if counts != [len(d) for d in dsts] or counts != [len(n) for n in lengths]:
            raise ValueError("a descriptor list's sources, destinations and lengths differ in "
                             "count")
        ends = np.cumsum(counts, dtype=np.int64)
        total = int(ends[-1]) if counts else 0
        src = np.fromiter(itertools.chain.from_iterable(srcs), np.int64, total)
        dst = np.fromiter(itertools.chain.from_iterable(dsts), np.int64, total)
        length = np.fromiter(itertools.chain.from_iterable(lengths), np.int64, total)
        distinct: Dict[int, Tuple[int, BufferTable]] = {}
        order = [distinct.setdefault(id(t), (len(distinct), t))[0] for t in tables]
        joined = self._joined_of(tuple(t for _, t in distinct.values())) if total else None
        if (joined is None or not joined.shiftable or int(dst.min()) < 0
                or int(dst.max()) >> _TABLE_SHIFT):  # fmt: skip
            parts, lo = [], 0
            for t, hi in zip(tables, ends.tolist()):
                parts.append(t.blocks(src[lo:hi], dst[lo:hi], length[lo:hi]))
                lo = hi
            return Blocks.concat(parts), ends
        which = np.repeat(np.asarray(order, dtype=np.int64), counts)
        pos = np.searchsorted(joined.keys, dst + (which << _TABLE_SHIFT), side="right") - 1
        if (pos < joined.starts[which]).any():
            raise ValueError("a descriptor's destination lies below every decode buffer")
        zero = np.zeros(total, dtype=np.int64)
        blocks = Blocks(src, dst - joined.bases[pos], length, np.ones(total, dtype=np.int64),
                        zero, zero, joined.slots[pos])  # fmt: skip
        return blocks, ends

    def _joined_of(self, tables: Tuple[BufferTable, ...]) -> _Joined:
        key = tuple(id(t) for t in tables)
        j = self._joined.get(key)
        if j is None or any(a is not b for a, b in zip(j.tables, tables)):
            if len(self._joined) >= self._CACHED:
                self._joined.clear()
            j = self._joined[key] = _joined(tables)
        return j


# -- the host reference ---------------------------------------------------------------------


def read_memory(address: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory at ``address`` (a CPU tensor's ``data_ptr()``), as uint8."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    buf = (ctypes.c_char * int(nbytes)).from_address(int(address))
    return np.frombuffer(buf, dtype=np.uint8)


def digest_blocks_host(blocks: Blocks, keys: Sequence[int], reader=read_memory) -> np.ndarray:
    """Per-slot sums (uint64) of ``blocks`` over host memory: the CPU path and the GPU kernel's
    reference. One numpy pass per block row group; CPU servers move small tensors."""
    blocks.check_words()
    out = np.zeros(len(keys), dtype=np.uint64)
    for src, dst, nbytes, rows, ss, ds, slot in zip(*(a.tolist() for a in blocks)):
        if nbytes == 0 or rows == 0:
            continue
        r = np.arange(rows, dtype=np.int64)
        if rows == 1 or ss == nbytes:
            words = reader(src, nbytes * rows).view(np.uint32).reshape(rows, nbytes // WORD)
        else:
            span = (rows - 1) * ss + nbytes
            raw = reader(src, span)
            idx = (r[:, None] * ss + np.arange(nbytes, dtype=np.int64)[None, :]).reshape(-1)
            words = raw[idx].view(np.uint32).reshape(rows, nbytes // WORD)
        offsets = (dst + r * ds)[:, None] // WORD + np.arange(nbytes // WORD, dtype=np.int64)
        terms = word_terms(words.reshape(-1), offsets.reshape(-1).astype(np.uint64), keys[slot])
        out[slot] = np.uint64(add64(int(out[slot]), wrap_sum(terms)))
    return out


# -- contributions and their comparison -----------------------------------------------------


@dataclass(frozen=True)
class Sender:
    """One prefill rank, as the decode names it."""

    pp_rank: int
    tp_rank: int
    rank_id: int  # sglang's per-sender id (``_prefill_unique_rank``), what the decode counts

    def describe(self) -> str:
        return f"prefill pp rank {self.pp_rank} / attention TP rank {self.tp_rank}"


@dataclass
class Contribution:
    """What one sender wrote to one decode rank for one room: per decode buffer, the sum of its
    words' terms."""

    room: int
    sender: Sender
    sums: Dict[Tuple[int, int], int] = field(default_factory=dict)  # (kind, index) -> uint64

    def add(self, kind: BufferKind, index: int, value: int) -> None:
        k = (int(kind), int(index))
        self.sums[k] = add64(self.sums.get(k, 0), value)

    def add_slots(self, tables: Iterable[BufferTable], sums: np.ndarray) -> None:
        """Add a digest's per-slot sums; a slot no block touched (sum 0) is skipped."""
        for table in tables:
            part = sums[table.first_slot : table.first_slot + len(table)]
            for i in np.flatnonzero(part).tolist():
                self.add(table.kind, i, int(part[i]))


MESSAGE_TAG = b"DFLASH_KV_DIGEST"
# How long a decode waits for the senders' sums after a room's transfer, and a prefill worker for
# its digest thread before the room's status: a digest path that stalls fails rooms, never hangs.
TIMEOUT_ENV = "SGLANG_DFLASH_KV_DIGEST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0
_HEADER = struct.Struct(">QqqqI")  # room, pp rank, tp rank, rank id, entry count
_ENTRY = struct.Struct(">BIQ")  # kind, index, sum


def encode(c: Contribution) -> List[bytes]:
    """The ZMQ frames of one contribution (sent to the decode rank's endpoint, ahead of the
    sender's transfer status on the same socket, so it is there when the room completes)."""
    body = b"".join(_ENTRY.pack(k, i, v) for (k, i), v in sorted(c.sums.items()))
    s = c.sender
    return [MESSAGE_TAG, _HEADER.pack(c.room, s.pp_rank, s.tp_rank, s.rank_id, len(c.sums)), body]


def decode(frames: Sequence[bytes]) -> Contribution:
    if len(frames) != 3 or frames[0] != MESSAGE_TAG:
        raise ValueError("not a KV digest message")
    room, pp, tp, rank_id, n = _HEADER.unpack(frames[1])
    if len(frames[2]) != n * _ENTRY.size:
        raise ValueError(f"KV digest message of room {room}: {n} entries, {len(frames[2])} B")
    c = Contribution(room, Sender(pp, tp, rank_id))
    for k, i, v in _ENTRY.iter_unpack(frames[2]):
        c.sums[(k, i)] = v
    return c


@dataclass(frozen=True)
class Mismatch:
    kind: BufferKind
    index: int
    expected: int
    actual: int
    senders: Tuple[Sender, ...]  # those that wrote into this buffer


def compare(actual: Dict[Tuple[int, int], int], contributions: Sequence[Contribution]) -> List[Mismatch]:
    """Every decode buffer whose own sum differs from its senders' sums added up."""
    expected: Dict[Tuple[int, int], int] = {}
    writers: Dict[Tuple[int, int], List[Sender]] = {}
    for c in contributions:
        for k, v in c.sums.items():
            expected[k] = add64(expected.get(k, 0), v)
            writers.setdefault(k, []).append(c.sender)
    out = []
    for k in sorted(set(expected) | set(actual)):
        e, a = expected.get(k, 0), actual.get(k, 0)
        if e != a:
            out.append(Mismatch(BufferKind(k[0]), k[1], e, a, tuple(writers.get(k, ()))))
    return out


def describe_senders(senders: Sequence[Sender]) -> str:
    if not senders:
        return "no sender wrote it"
    return "written by " + ", ".join(s.describe() for s in senders)


def slots_of(tables: Sequence[BufferTable]) -> List[int]:
    keys: List[int] = []
    for t in tables:
        if t.first_slot != len(keys):
            raise ValueError("buffer tables must take consecutive slots")
        keys.extend(t.keys())
    return keys


def as_sums(tables: Sequence[BufferTable], sums: np.ndarray) -> Dict[Tuple[int, int], int]:
    """Per-slot sums as ``(kind, index) -> sum`` (every buffer, touched or not)."""
    out = {}
    for t in tables:
        for i in range(len(t)):
            out[(int(t.kind), i)] = int(sums[t.first_slot + i])
    return out
