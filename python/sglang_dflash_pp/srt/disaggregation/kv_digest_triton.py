"""The KV digest of :mod:`kv_digest` computed on the GPU, over the blocks a sender moves.

Same contract as :func:`kv_digest.digest_blocks_host`: a ``[n, 7]`` int64 block table (source
address, decode byte offset, bytes per row, rows, source row stride, decode row stride, slot) and
one uint32 key per slot give one uint64 sum per slot, the sum mod 2**64 of every word's term.
The sums are bit-for-bit the host reference's; only the memory differs (``src`` addresses are
device pointers, e.g. ``tensor.data_ptr()`` of CUDA tensors).

Why a kernel: a chunk of the Kimi-K3 last PP stage moves about 0.5 GB to its 8 decode ranks, and
the digest must cost a small fraction of the transfer (Mooncake at ~50 GB/s moves that in ~10 ms);
a host digest would first copy the bytes to the host. One launch reads every block once, hashes in
registers and adds one uint64 per program into its slot's sum with a 64-bit atomic (addition mod
2**64 needs no order, so programs never coordinate).

Work shape: a block is split into *units* of ``BLOCK_C`` words of one row (a block whose rows are
back to back on both sides, or that has one row, is one long row), and a program hashes
``BLOCK_R`` units at a time, a ``[BLOCK_R, BLOCK_C]`` tile. That serves both shapes the send path
digests with full lanes: stock Mooncake descriptors (one row of up to ~10 MB: thousands of units)
and the draft head slices (64 rows of 256 B = 64 words each: one unit per row). Programs are
spread over the work by a 1-D grid: each of the first ``n_split`` programs groups shares one of
the large blocks (listed, not moved: the table is not reordered), striding over its tiles, and
every block has one program of its own (a large block's does nothing); so a few 10 MB blocks and
thousands of 16 KB blocks both fill the GPU. Whole tiles of evenly spaced units, 16-byte aligned,
whose decode offsets share one high half (``o >> 32``) take a fast path: no mask, no division,
vector loads, the high half hashed once per block and ``c1`` a per-tile scalar plus a
loop-invariant part; the rest (tails, 4-byte aligned sources, blocks crossing a 2**32-word line)
takes a general masked path that hashes both candidate high halves per unit. The kernel also
refuses, block by block, what would fault or hash otherwise than the host reference (see
:func:`refusal`), so the host does no validation pass.

:class:`DeviceDigest` is the serving form: every buffer (a few pinned buffers for calls' input
and output and their device twins, its stream, its events) is allocated at construction and the
kernel compiled by :meth:`DeviceDigest.warm`, so a digest allocates nothing and compiles nothing
while serving (``benchmark/gpu/results/kv_digest_cost.json``: 0 allocations and 0 compiles in 100
digests; the kernel digests a chunk of the example in 2.5% of its transfer time at 50 GB/s; the
whole send path, host work included, costs more: see that file). Its calls do not wait for the
GPU: the sums are read when they are needed (:class:`DeviceSums`).

Importable without Triton (``available()`` says whether it can run); no sglang import.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from sglang_dflash_pp.srt.disaggregation.kv_digest import (
    C2_MUL,
    C2_XOR,
    FMIX_1,
    FMIX_2,
    OH_MUL,
    OL_MUL,
    Blocks,
)

try:  # pragma: no cover - exercised on GPU machines and under the interpreter
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

COLUMNS = 7  # the block table's columns (kv_digest.Blocks)
BLOCK_C = 64  # words per unit: a draft head slice's row (128 x bf16), a 256 B coalesced segment
BLOCK_R = 16  # units per tile: 8 words per thread at 4 warps (the H200 sweeps' best,
NUM_WARPS = 4  # benchmark/gpu/results/kv_digest_cost.json: kernel_sweep)
SPLIT_BYTES = 128 << 10  # a block larger than this is shared by several programs
# The share of a large block one program aims for. 1 MiB was best for a chunk's 12,544 blocks of
# 503 MB (every decode rank's copy digested); the send path digests each distinct part once
# (88 MB in 224 blocks for the same chunk), where fewer, larger blocks need finer shares.
PROGRAM_BYTES = 128 << 10
MAX_SPLIT = 1024


def available() -> bool:
    """Whether the kernel can run on a GPU here (the interpreter runs it on CPU tensors)."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    # The hash constants as constexprs (Triton reads no other globals); uint32 arithmetic wraps.
    _FMIX_1 = tl.constexpr(FMIX_1)
    _FMIX_2 = tl.constexpr(FMIX_2)
    _OH_MUL = tl.constexpr(OH_MUL)
    _OL_MUL = tl.constexpr(OL_MUL)
    _C2_XOR = tl.constexpr(C2_XOR)
    _C2_MUL = tl.constexpr(C2_MUL)

    @triton.jit
    def _fmix32(x):
        x ^= x >> 16
        x *= _FMIX_1
        x ^= x >> 13
        x *= _FMIX_2
        x ^= x >> 16
        return x

    @triton.jit
    def _term(w, c1):
        """The uint64 term of words ``w`` whose coordinate hash is ``c1`` (kv_digest)."""
        lo = _fmix32(w ^ c1)
        hi = _fmix32(w ^ ((c1 ^ _C2_XOR) * _C2_MUL))
        return lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)

    # Block counts, the split and the table's column stride change with every call: left
    # unspecialised, so one compiled kernel per tile shape serves every digest.
    @triton.jit(do_not_specialize=["n_blocks", "n_split", "split", "split_bytes", "n_slots",
                                   "row_stride", "col_stride"])  # fmt: skip
    def _digest_kernel(
        table,  # int64 [n, 7] at (row_stride, col_stride): src address, dst byte offset,
        #         bytes per row, rows, src stride, dst stride, slot
        split_blocks,  # int64 [n_split]: the blocks shared by ``split`` programs each
        keys,  # int64 [n_slots]: uint32 buffer keys
        sums,  # int64 [n_slots]: uint64 sums (two's complement wraps like uint64)
        status,  # int64 [1]: 0, or 1 + the greatest index of a refused block
        n_blocks,
        n_split,
        split,
        split_bytes,  # a block of more bytes is a shared one (its own program does nothing)
        n_slots,
        row_stride,
        col_stride,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # Programs [0, n_split * split) share the split blocks; then one program per block.
        p = tl.program_id(0).to(tl.int64)
        shared = n_split.to(tl.int64) * split
        is_shared = p < shared
        k = tl.where(is_shared, p // split, 0)
        b = tl.where(is_shared, tl.load(split_blocks + k, mask=is_shared, other=0), p - shared)
        first = tl.where(is_shared, p - k * split, 0)  # this program's first tile of block b
        step = tl.where(is_shared, split, 1).to(tl.int64)
        at = table + b * row_stride
        nbytes = tl.load(at + 2 * col_stride)
        rows = tl.load(at + 3 * col_stride)
        src_at = tl.load(at)
        dst = tl.load(at + col_stride)
        ss = tl.load(at + 4 * col_stride)
        ds = tl.load(at + 5 * col_stride)
        slot = tl.load(at + 6 * col_stride)
        # Refused, not read (the host raises on the status): a word that is not whole (a
        # misaligned load would fault), a slot outside the keys (the atomic would write out of
        # bounds), a block of several rows of 8 GiB or more (units are divided in int32).
        bad = (((src_at | dst | nbytes | ss | ds) & 3) != 0) | (slot < 0) | (slot >= n_slots)
        bad = bad | ((rows > 1) & (nbytes * rows >= 8589934592))
        if bad & (first == 0):
            tl.atomic_max(status, b + 1, sem="relaxed")
        if (bad == 0) & (is_shared | (nbytes * rows <= split_bytes)):
            src = src_at.to(tl.pointer_type(tl.int32))
            aligned = ((src_at | ss) & 15) == 0  # vector loads on the fast path
            dst_w = dst // 4
            ss_w = ss // 4
            ds_w = ds // 4
            key = tl.load(keys + slot).to(tl.uint32)
            wpr = nbytes // 4
            flat = (rows == 1) | ((ss_w == wpr) & (ds_w == wpr))  # one long row
            wpr = tl.where(flat, wpr * rows, wpr)
            rows = tl.where(flat, 1, rows)
            chunks = (wpr + BLOCK_C - 1) // BLOCK_C  # units per row
            units = rows * chunks
            tiles = (units + BLOCK_R - 1) // BLOCK_R
            # The fast path: whole tiles of a block whose units are evenly spaced on both sides
            # (one row per unit, or units along one row), 16-byte aligned, and whose decode
            # words share one high half. No mask, no division, the high half's hash once per
            # program, and per tile only scalar work besides the words' own: addresses and c1
            # are a loop-invariant per-element part plus a per-tile scalar (c1 is linear in the
            # offset's low half).
            hi_w = dst_w >> 32
            uniform = ((dst_w + (rows - 1) * ds_w + wpr - 1) >> 32) == hi_w
            one_unit_rows = chunks == 1
            linear = one_unit_rows | (rows == 1)
            fast = uniform & linear & aligned & (wpr % BLOCK_C == 0)
            fast_tiles = tl.where(fast, units // BLOCK_R, 0)
            unit_ss = tl.where(one_unit_rows, ss_w, BLOCK_C)  # words between units, source
            unit_ds = tl.where(one_unit_rows, ds_w, BLOCK_C)  # and decode
            base_s = _fmix32(key + hi_w.to(tl.uint32) * _OH_MUL)
            r = tl.arange(0, BLOCK_R).to(tl.int64)
            c = tl.arange(0, BLOCK_C)
            cu = c.to(tl.uint32)
            cm = cu * _OL_MUL  # a column's share of c1
            fast_off = (r * unit_ss)[:, None] + c[None, :]
            fast_c1 = ((r * unit_ds).to(tl.uint32) * _OL_MUL)[:, None] + cm[None, :]
            acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.uint64)
            for t in range(first, tiles, step):
                u0 = t * BLOCK_R
                if t < fast_tiles:
                    ptrs = tl.multiple_of(src + (u0 * unit_ss + fast_off), [16, 16])
                    w = tl.load(ptrs).to(tl.uint32, bitcast=True)
                    c1 = (base_s + (dst_w + u0 * unit_ds).to(tl.uint32) * _OL_MUL) + fast_c1
                    acc += _term(w, c1)
                else:
                    u = u0 + r
                    # (row, first column) of each unit; the division only for blocks of
                    # several rows of several units (int32: check_table bounds the units).
                    if one_unit_rows:
                        row = u
                        col0 = u * 0
                    elif rows == 1:
                        row = u * 0
                        col0 = u * BLOCK_C
                    else:
                        row = (u.to(tl.int32) // chunks.to(tl.int32)).to(tl.int64)
                        col0 = (u - row * chunks) * BLOCK_C
                    s_w = row * ss_w + col0  # source word index of the unit's first word
                    d_w = dst_w + row * ds_w + col0  # decode word offset of it
                    d_lo = d_w.to(tl.uint32)
                    d_hi = (d_w >> 32).to(tl.uint32)
                    base0 = _fmix32(key + d_hi * _OH_MUL)
                    base1 = _fmix32(key + (d_hi + 1) * _OH_MUL)
                    mask = (u < units)[:, None] & (c[None, :] < (wpr - col0)[:, None])
                    w = tl.load(src + (s_w[:, None] + c[None, :]), mask=mask, other=0)
                    w = w.to(tl.uint32, bitcast=True)
                    ol = d_lo[:, None] + cu[None, :]
                    carry = ol < cu[None, :]  # the low half wrapped inside the unit
                    base = tl.where(carry, base1[:, None], base0[:, None])
                    acc += tl.where(mask, _term(w, base + ol * _OL_MUL), 0)
            if first < tiles:
                total = tl.sum(tl.sum(acc, axis=1), axis=0)
                tl.atomic_add(sums + slot, total.to(tl.int64, bitcast=True), sem="relaxed")


class Plan(NamedTuple):
    """How one launch spreads its programs (only balance and speed depend on it)."""

    n_split: int  # blocks shared by ``split`` programs each, listed in the split-blocks buffer
    split: int
    split_bytes: int  # the kernel's test for a shared block: bytes > split_bytes


NO_SPLIT_BYTES = 1 << 62
NO_SPLIT = Plan(0, 1, NO_SPLIT_BYTES)


def plan_split(nbytes: np.ndarray, rows: np.ndarray, split_out: np.ndarray, *,
               split_bytes: int = SPLIT_BYTES, program_bytes: int = PROGRAM_BYTES,
               max_split: int = MAX_SPLIT) -> Plan:
    """The blocks of more than ``split_bytes`` bytes, written to ``split_out``, are each shared
    by ``split`` programs (one per ``program_bytes`` of the largest); every other block has one
    program. No reordering of the table."""
    work = nbytes * rows
    big = np.flatnonzero(work > split_bytes)
    if big.size == 0:
        return NO_SPLIT
    split_out[: big.size] = big
    split = int(min(max_split, max(1, -(-int(work[big].max()) // program_bytes))))
    return Plan(int(big.size), split, int(split_bytes))


def fill_table(blocks: Blocks, lo: int, hi: int, columns: np.ndarray,
               split_out: np.ndarray) -> Plan:
    """Blocks ``lo:hi`` into the flat (pinned) ``columns``, column ``c`` at ``[c*n, (c+1)*n)``
    (``n = hi - lo``: seven contiguous copies; :func:`column_table` views it as ``[n, 7]``), the
    shared blocks into ``split_out``; returns the launch's plan.

    No validation here: the kernel refuses each bad block itself (``status``), so the host part
    of a digest is these copies and one product; the refusals are spelled out by
    :func:`refusal` only when the kernel reported one."""
    n = hi - lo
    if n <= 0:
        return NO_SPLIT
    for c, column in enumerate(blocks):
        columns[c * n : (c + 1) * n] = column[lo:hi]
    return plan_split(columns[2 * n : 3 * n], columns[3 * n : 4 * n], split_out)


def refusal(blocks: Blocks, n_slots: int) -> Optional[str]:
    """Why the kernel refuses some block of ``blocks`` (the rules its ``bad`` test applies), or
    None: whole 4-byte words, a slot among the ``n_slots`` keys, a block of several rows under
    8 GiB (and, beyond the kernel's rules, non-negative sizes)."""
    if not blocks.count:
        return None
    try:
        blocks.check_words()
    except ValueError as e:
        return str(e)
    bad = np.flatnonzero((blocks.slot < 0) | (blocks.slot >= n_slots))
    if bad.size:
        i = int(bad[0])
        return f"KV digest block {i} has slot {int(blocks.slot[i])}, outside the {n_slots} keys"
    bad = np.flatnonzero((blocks.rows > 1) & (blocks.nbytes * blocks.rows >= 1 << 33))
    if bad.size:
        return f"KV digest block {int(bad[0])}: a block of several rows must be under 8 GiB"
    if int(blocks.nbytes.min()) < 0 or int(blocks.rows.min()) < 0:
        return "KV digest blocks need non-negative bytes per row and rows"
    return None


def check_table(blocks: Blocks, n_slots: int) -> None:
    """Raise ValueError for a table the kernel would refuse (host-side, for tools and tests)."""
    why = refusal(blocks, n_slots)
    if why:
        raise ValueError(why)


def column_table(columns: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[n, 7]`` view (strides ``(1, n)``) of a table laid out by :func:`fill_table`."""
    return columns[: 7 * n].view(7, n).t()


def launch(table: torch.Tensor, keys: torch.Tensor, sums: torch.Tensor, n_blocks: int,
           split_blocks: Optional[torch.Tensor] = None, plan: Plan = NO_SPLIT,
           status: Optional[torch.Tensor] = None, *, block_rows: int = BLOCK_R,
           num_warps: int = NUM_WARPS):
    """Add the terms of the first ``n_blocks`` rows of ``table`` (int64 ``[>= n_blocks, 7]``, any
    strides: ``Blocks.table()`` or :func:`column_table`) into ``sums`` (int64 ``[slots]``, mod
    2**64) with keys ``keys`` (int64 ``[slots]``: ``slots`` is ``keys.numel()``), on the current
    stream. ``plan`` (from :func:`fill_table`) and ``split_blocks`` share large blocks among
    programs; by default each block has one program. A refused block (see :func:`refusal`) adds
    nothing and sets ``status`` (int64 ``[1]``, 0 before) to 1 + its index, at least.
    ``sums`` is added to, not zeroed; nothing is allocated, except a status when none is given.
    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``. Returns what Triton's
    launch returns (the compiled kernel on a GPU)."""
    n_blocks = int(n_blocks)
    if n_blocks <= 0:
        return None
    if status is None:
        status = torch.zeros(1, dtype=torch.int64, device=table.device)
    n_split, split = int(plan.n_split), max(1, int(plan.split))
    return _digest_kernel[(n_split * split + n_blocks,)](
        table, table if split_blocks is None else split_blocks, keys, sums, status, n_blocks,
        n_split, split, int(plan.split_bytes), keys.numel(), table.stride(0), table.stride(1),
        BLOCK_R=block_rows, BLOCK_C=BLOCK_C, num_warps=num_warps,
    )  # fmt: skip


def _even(i: int) -> int:
    return i + (i & 1)  # int64 offsets kept even: every region of the buffer 16-byte aligned


STATUS = 2  # int64 words before the sums: the kernel's status, and alignment


class Lane:
    """One call's pinned input/output buffer and its device twin, ``[status | sums | keys |
    columns (7n) | shared blocks]``, and the events that say when each may be used again.
    ``ptr`` is the twin's address: a direct launch passes the kernel addresses in it, not tensor
    views (a view is a few microseconds of host time each, and a call took five)."""

    __slots__ = ("host", "host_np", "dev", "ptr", "uploaded", "done", "sums", "_downloads")

    def __init__(self, size: int, device):
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.ptr = self.dev.data_ptr()
        self.uploaded = torch.cuda.Event()  # the pinned table may be refilled once it is set
        self.done = torch.cuda.Event()  # the status and sums reached the pinned buffer
        self.sums: Optional["DeviceSums"] = None  # the call whose sums it holds, not yet read
        self._downloads: dict = {}  # keys -> (pinned, device) views of [status | sums]

    def download(self, n_keys: int):
        """The (pinned, device) views a call of ``n_keys`` sums downloads, made once per key
        count (views only: no memory is allocated)."""
        views = self._downloads.get(n_keys)
        if views is None:
            if len(self._downloads) >= 64:
                self._downloads.clear()
            end = STATUS + n_keys
            views = self._downloads[n_keys] = (self.host[:end], self.dev[:end])
        return views


class DeviceSums:
    """The per-slot sums of one :meth:`DeviceDigest.submit`, on their way to the host: ``done()``
    asks without waiting, ``result()`` waits for the call's event (the GIL released) and returns
    the uint64 sums, or raises ValueError for a block the kernel refused."""

    __slots__ = ("_digest", "_lane", "_blocks", "_n_keys", "_value", "_error")

    def __init__(self, digest: "DeviceDigest", lane: Lane, blocks: Blocks, n_keys: int):
        self._digest, self._lane, self._blocks, self._n_keys = digest, lane, blocks, n_keys
        self._value: Optional[np.ndarray] = None
        self._error: Optional[str] = None

    def done(self) -> bool:
        lane = self._lane
        return lane is None or lane.sums is not self or lane.done.query()

    def result(self) -> np.ndarray:
        lane = self._lane
        if lane is not None:
            lane.done.synchronize()  # outside the lock: a later submit may take the lane meanwhile
            with self._digest._lock:
                self._collect(waited=True)
        if self._error is not None:
            raise ValueError(self._error)
        return self._value

    def _collect(self, waited: bool = False) -> None:
        """Copy the sums out of the lane and give it back (the caller holds the digest's lock).
        ``waited``: the caller synchronised the lane's ``done`` event, which still marks this
        call's sums (the lane was not taken again, or it would not hold them); else it is waited
        for here."""
        lane = self._lane
        if lane is None or lane.sums is not self:
            return
        if not waited:
            lane.done.synchronize()
        host = lane.host_np
        if host[0]:
            why = refusal(self._blocks, self._n_keys)
            self._error = why or "KV digest: the kernel refused a block"
        else:
            self._value = host[STATUS : STATUS + self._n_keys].view(np.uint64).copy()
        lane.sums, self._lane, self._blocks = None, None, None


def _highest_priority() -> int:
    """The highest stream priority this CUDA build offers (0 where it names none). Why: the
    prefill's next forward keeps every SM busy while a chunk's digests run, and a kernel of a
    stream of equal priority starts only once the forward's running kernel has handed out all
    its blocks, so its sums, which the room's status waits for, came up to a GEMM late; one of
    higher priority gets the next free SMs (its kernels are tens of microseconds:
    ``benchmark/gpu/results``)."""
    priority_range = getattr(torch.cuda.Stream, "priority_range", None)
    try:
        return int(priority_range()[1]) if priority_range is not None else 0
    except Exception:  # noqa: BLE001 - no CUDA context to ask: the default priority
        return 0


class DeviceDigest:
    """Digests on one GPU with every buffer allocated at construction (startup).

    ``max_blocks`` bounds the rows uploaded per launch (longer tables go in pieces, summed into
    the same sums); ``max_slots`` bounds the keys of one call (more is refused). One stream of its
    own, of the highest priority, so a digest never queues behind the forward
    (:func:`_highest_priority`); which forward work it must follow is named by the events the
    caller passes.

    :meth:`submit` never waits for the GPU: it fills one of ``lanes`` pinned buffers, uploads it,
    launches, queues the sums' download into the same buffer and records the lane's ``done``
    event; the caller reads the sums later (:class:`DeviceSums`). Why: a prefill's transfer worker
    digests inside its own transfers while the GPU runs the next chunk's forward; a worker that
    waited there for its kernel would wait behind the forward's and outlast its transfers (on
    the H200 with 13 ms of GEMMs beside each chunk: 40-42% of a last chunk's link time against
    6%, ``benchmark/gpu/results``; with the GPU idle the two cost the same). A submit finding every
    lane holding unread sums reads the oldest first (its event long done, as a later launch on
    the same stream follows it). :meth:`digest` is a submit and its result.

    Each lane holds a call's whole input and output, so a launch costs one upload (no separate
    key copy and no zeroing launch: the upload writes the status and sums' zeros) and one
    download of the status and sums. The table is validated by the kernel (a bad block is
    skipped and reported in the status; the result then raises ValueError), not by the host:
    the host's part of a call is the table's seven column copies and the split.

    The table holds addresses, not tensors: whoever builds blocks must keep their memory alive
    until the sums are read."""

    def __init__(self, device, max_blocks: int = 1 << 15, max_slots: int = 1024, *,
                 block_rows: int = BLOCK_R, num_warps: int = NUM_WARPS, lanes: int = 1):
        if triton is None:
            raise RuntimeError("the GPU KV digest needs Triton")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"DeviceDigest runs on a CUDA device, not {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_blocks, self.max_slots = int(max_blocks), int(max_slots)
        self.block_rows, self.num_warps = int(block_rows), int(num_warps)
        size = STATUS + 2 * _even(self.max_slots) + _even(COLUMNS * self.max_blocks) + self.max_blocks
        self.lanes = [Lane(size, self.device) for _ in range(max(1, int(lanes)))]
        self._next = 0
        self._warm_words = torch.zeros(32 * BLOCK_C, dtype=torch.int32, device=self.device)
        self.stream = torch.cuda.Stream(self.device, priority=_highest_priority())
        self._lock = threading.Lock()
        self._keys = (None, None, None)  # the last keys (the tuple itself), as a list, as int64
        self.warmed = False
        # Triton's compiled kernel and the extra arguments its launcher takes, when warm()
        # verified that launching it directly gives the sums of the JIT's launch. Why: the JIT's
        # launch (binding, specialisation key, cache lookup) was the largest host cost of a call
        # after the table itself (benchmark/gpu/results/kv_digest_cost.json: host_steps).
        self._direct = None
        self._compiled = None
        self.trace = None  # a list to time the steps of each call (benchmark/gpu/kv_digest_cost.py)

    @property
    def nbytes(self) -> int:
        """Pinned host memory, and as much device memory, that the lanes hold."""
        return sum(lane.host.numel() * 8 for lane in self.lanes)

    def warm(self) -> None:
        """Compile the kernel with a tiny digest (a 16-byte aligned block of two tiles: the fast
        path, and a 4-byte aligned one: the general path) at startup, so nothing compiles while serving
        (block counts, the split and the strides are run-time arguments: one variant), and
        choose how to launch it; every lane is used once."""
        base, n = self._warm_words.data_ptr(), self._warm_words.numel() * 4
        blocks = Blocks.of([base, base + 4], [0, n], [n, n - 4], [0, 1])
        self._direct = None
        want = self.digest(blocks, [1, 2])  # the JIT's launch: compiles
        for extra in ((self.block_rows, BLOCK_C), ()):  # the launcher's forms, by Triton version
            self._direct = (self._compiled, extra)
            try:
                if all((self.digest(blocks, [1, 2]) == want).all() for _ in self.lanes):
                    break
            except Exception:  # noqa: BLE001 - another form: the JIT's launch serves
                pass
            self._direct = None
        self.warmed = True

    def _launch(self, lane: Lane, n: int, n_keys: int, keys_at: int, cols_at: int, split_at: int,
                plan: Plan) -> None:
        """Launch over ``lane``'s device buffer: ``n`` table rows at ``cols_at`` (column ``c`` at
        ``cols_at + c * n``), the shared blocks at ``split_at``, ``n_keys`` keys at ``keys_at``
        (int64 word offsets). Directly: the compiled kernel given the addresses as integers
        (Triton's launcher takes an int as a device pointer; ``warm`` checked this form's sums
        against the JIT's). Else through the JIT, with tensor views of the same words."""
        if self._direct is None:
            dev = lane.dev
            self._compiled = launch(column_table(dev[cols_at:], n), dev[keys_at : keys_at + n_keys],
                                    dev[STATUS:], n, dev[split_at:], plan, dev[:1],
                                    block_rows=self.block_rows, num_warps=self.num_warps)  # fmt: skip
            return
        compiled, extra = self._direct
        split, at = max(1, int(plan.split)), lane.ptr
        compiled[(plan.n_split * split + n, 1, 1)](
            at + 8 * cols_at, at + 8 * split_at, at + 8 * keys_at, at + 8 * STATUS, at, n,
            plan.n_split, split, plan.split_bytes, n_keys, 1, n, *extra,
        )  # fmt: skip

    def _mark(self, label: str) -> None:
        if self.trace is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record(self.stream)
            self.trace.append((label, time.perf_counter(), e))

    def _keys_np(self, keys) -> np.ndarray:
        held, last, arr = self._keys
        if held is keys:  # the same tuple (immutable): the send path's per-registration keys
            return arr
        if last is not None and len(last) == len(keys) and last == list(keys):
            return arr
        arr = np.asarray(keys, dtype=np.int64) & 0xFFFFFFFF
        self._keys = (keys if isinstance(keys, tuple) else None, list(keys), arr)
        return arr

    def _lane(self) -> Lane:
        """The next lane, its unread sums (if any) read out first (lock held)."""
        lane = self.lanes[self._next]
        self._next = (self._next + 1) % len(self.lanes)
        if lane.sums is not None:
            lane.sums._collect()
        return lane

    def digest(self, blocks: Blocks, keys: Sequence[int], wait_events=()) -> np.ndarray:
        """Per-slot uint64 sums (``len(keys)``) of ``blocks``: :meth:`submit`, then its result."""
        sums = self.submit(blocks, keys, wait_events).result()
        self._mark("returned")
        return sums

    def submit(self, blocks: Blocks, keys: Sequence[int], wait_events=()) -> DeviceSums:
        """Launch the digest of ``blocks`` over device memory (per-slot sums, ``len(keys)``) and
        return without waiting for it.

        ``wait_events`` are the KV-written events of the chunk (the forward's writes of every
        byte the blocks read): the digest stream waits on each before reading, so every
        cross-stream read names the event it waits on. None is needed only for memory no other
        stream writes. Raises ValueError, before any work, for more keys than ``max_slots``; a
        table the kernel refuses (see :func:`refusal`) raises at the result."""
        n_keys = len(keys)
        if n_keys > self.max_slots:
            raise ValueError(
                f"a KV digest of {n_keys} slots exceeds this DeviceDigest's {self.max_slots} "
                "(max_slots is fixed at startup, where its buffers are allocated)"
            )
        with self._lock:
            self._mark("start")
            lane = self._lane()
            self._mark("lane")
            host = lane.host_np
            keys_np = self._keys_np(keys)
            # [status | sums | keys | columns (7n) | shared blocks]: the first piece uploads it
            # all (the status' and sums' zeros too), later pieces their table. The lane's
            # previous sums were read (``_lane``): its upload left the buffer.
            keys_at = STATUS + _even(n_keys)
            cols_at = keys_at + _even(n_keys)
            host[: STATUS + n_keys] = 0
            host[keys_at : keys_at + n_keys] = keys_np
            with torch.cuda.stream(self.stream):
                for e in wait_events:
                    self.stream.wait_event(e)
                for lo in range(0, max(blocks.count, 1), self.max_blocks):
                    hi = min(lo + self.max_blocks, blocks.count)
                    n = hi - lo
                    if lo:
                        lane.uploaded.synchronize()  # the previous piece left the buffer
                    split_at = cols_at + _even(COLUMNS * n)
                    plan = fill_table(blocks, lo, hi, host[cols_at : cols_at + COLUMNS * n],
                                      host[split_at:])  # fmt: skip
                    self._mark("filled")
                    first, end = (0 if not lo else cols_at), split_at + plan.n_split
                    lane.dev[first:end].copy_(lane.host[first:end], non_blocking=True)
                    lane.uploaded.record(self.stream)
                    self._mark("uploaded")
                    if n:
                        self._launch(lane, n, n_keys, keys_at, cols_at, split_at, plan)
                    self._mark("launched")
                pinned, dev = lane.download(n_keys)
                pinned.copy_(dev, non_blocking=True)
                lane.done.record(self.stream)
                self._mark("downloaded")
            lane.sums = DeviceSums(self, lane, blocks, n_keys)
            return lane.sums
