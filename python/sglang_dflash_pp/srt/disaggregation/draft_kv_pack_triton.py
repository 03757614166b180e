"""One Triton launch that packs a strided head slice of every draft KV entry into staging slabs.

Same contract as :func:`draft_kv_pack.pack_row_slices_index_select` (slab ``e`` = ``sources[e][rows, off_e :
off_e + w]``, row-major, slabs back to back in ``out``), for the case every entry has the same
slice width and every offset, width, row stride and base is 8-byte aligned, which is the case for
bf16/fp16 draft KV with a head dim divisible by 4.

Why a kernel: the torch fallback gathers entry by entry (one ``index_select`` launch per entry), and
a byte-granular gather (sglang's ``copy_mla_rows_into_pack``) divides every byte index by the row
width. Here one program copies a block of rows of one entry as 8-byte words addressed by
``row * stride + column``: every row slice is one coalesced segment and no division is done.

Importable without Triton (``available()`` says whether it can run); no sglang import.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

try:  # pragma: no cover - exercised on GPU machines
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

_WORD = 8  # bytes per copied element (int64)


def available(out: torch.Tensor) -> bool:
    return triton is not None and out.is_cuda


def eligible(sources: Sequence[torch.Tensor], byte_offsets, byte_widths, out: torch.Tensor) -> bool:
    """Whether the fused kernel can serve this pack (uniform, 8-byte aligned slices on CUDA)."""
    if not available(out) or not sources or len(set(int(w) for w in byte_widths)) != 1:
        return False
    return _aligned(sources, byte_offsets, int(byte_widths[0]), out)


def _aligned(sources, byte_offsets, width: int, out: torch.Tensor) -> bool:
    values = [width] + [int(o) for o in byte_offsets]
    values += [int(s.stride(0)) for s in sources] + [s.data_ptr() for s in sources]
    return all(v % _WORD == 0 for v in values) and out.data_ptr() % _WORD == 0


if triton is not None:

    # The row count and the output offset change with every chunk: left unspecialised, so one
    # compiled kernel per slice width serves every pack. ARGS_ON_DEVICE: both (and the rows) are
    # read from ``args`` on the device, so one captured graph serves every chunk of a bucket.
    @triton.jit(do_not_specialize=["out_word", "n_rows"])
    def _pack_rows_kernel(
        meta,  # int64 [entries, 2]: source address of the slice start (bytes), row stride (words)
        rows,  # int64 [n]
        out,  # int64 words: the slot's base
        out_word,  # where this pack's slabs start in ``out``, in words
        n_rows,
        args,  # int64 [2 + n]: n_rows, out_word, rows (ARGS_ON_DEVICE)
        WIDTH: tl.constexpr,  # words per row slice
        BLOCK_COLS: tl.constexpr,  # WIDTH rounded up to a power of two
        BLOCK_ROWS: tl.constexpr,
        ARGS_ON_DEVICE: tl.constexpr,
    ):
        entry = tl.program_id(0)
        block = tl.program_id(1)
        if ARGS_ON_DEVICE:
            n_rows = tl.load(args)
            out_word = tl.load(args + 1)
        src = tl.load(meta + entry * 2).to(out.dtype)
        stride = tl.load(meta + entry * 2 + 1)
        r = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        c = tl.arange(0, BLOCK_COLS)
        row_ok = r < n_rows
        mask = row_ok[:, None] & (c < WIDTH)[None, :]
        src_rows = tl.load(rows + r, mask=row_ok, other=0)
        values = tl.load(src + src_rows[:, None] * stride + c[None, :], mask=mask)
        slab = out + out_word + entry.to(tl.int64) * n_rows * WIDTH
        tl.store(slab + r[:, None] * WIDTH + c[None, :], values, mask=mask)


class FusedPack:
    """The fused launch for fixed sources, offsets and widths: the per-entry table (source address
    of each slice start, row stride in words) is built and copied to the device once, so a pack
    costs the row upload and one launch. Build only when :func:`eligible` holds.

    The table holds addresses, not tensors: whoever builds it must not use it after the pool's
    buffers are freed (the send path builds its packs at startup, for the pool it registered)."""

    BLOCK_WORDS = 4096  # 8-byte words one program copies (whole row slices of one entry)
    NUM_WARPS = 4

    def __init__(self, sources: Sequence[torch.Tensor], byte_offsets, byte_widths, device):
        self.entries = len(sources)
        self.width = int(byte_widths[0])
        self.meta = torch.tensor(
            [[s.data_ptr() + int(o), s.stride(0) // _WORD] for s, o in zip(sources, byte_offsets)],
            dtype=torch.int64,
        ).to(device)
        self.words = self.width // _WORD
        self.block_cols = triton.next_power_of_2(self.words)
        self.block_rows = max(1, self.BLOCK_WORDS // self.block_cols)

    def offsets(self, n: int, at: int) -> List[int]:
        return [at + e * n * self.width for e in range(self.entries)]

    def __call__(self, rows: torch.Tensor, out: torch.Tensor, at: int = 0) -> List[int]:
        """Pack into ``out`` from byte ``at`` (a multiple of 8), one eager launch; returns each
        slab's offset in ``out``. ``out``'s base is what the kernel is specialised on: pass a
        slot's whole buffer and the offset, not a view at the offset."""
        n = int(rows.numel())
        self._check(n, at, out)
        if n:
            self.launch(rows, out, n, out_word=at // _WORD)
        return self.offsets(n, at)

    def _check(self, n: int, at: int, out: torch.Tensor) -> None:
        need = n * self.width * self.entries
        if at % _WORD or at + need > out.numel():
            raise ValueError(f"pack needs {need} bytes at {at}, staging slot holds {out.numel()}")

    def launch(self, rows, out, n: int, *, out_word: int = 0, args=None) -> None:
        """One launch with a grid for ``n`` rows; with ``args`` (``[n, out_word, rows...]`` on the
        device) the kernel reads the row count, offset and rows from there instead."""
        _pack_rows_kernel[(self.entries, triton.cdiv(n, self.block_rows))](
            self.meta,
            rows if args is None else args[2:],
            out[: out.numel() // _WORD * _WORD].view(torch.int64),
            out_word,
            n,
            self.meta if args is None else args,
            WIDTH=self.words,
            BLOCK_COLS=self.block_cols,
            BLOCK_ROWS=self.block_rows,
            ARGS_ON_DEVICE=args is not None,
            num_warps=self.NUM_WARPS,
        )


class GraphedPack:
    """A :class:`FusedPack` into one slot, replayed from CUDA graphs captured at startup.

    Why graphs: the transfer worker waits for the pack before it sends, so the pack's host cost
    counts in full, and on an H200 an eager Triton launch costs the host about 0.1 ms, more than
    the kernel takes for a whole 8192-token chunk (``benchmark/gpu/results/pack_send_path.json``,
    eager vs graph). A graph holds the upload of ``[n, out_word, rows...]`` from the slot's pinned
    buffer (which the host fills) and the launch, for up to ``bucket`` rows; the kernel reads the
    count, the offset and the rows on the device, so one graph per power-of-two bucket serves every
    chunk length and slab offset. Every bucket is captured by :meth:`capture_all` at startup, on
    the slot's stream, in thread-local capture mode; none while serving (a capture held open on
    any thread makes the allocator skip its free-and-retry for the device)."""

    MIN_BUCKET = 1024

    def __init__(self, pack: FusedPack, slot):
        self.pack = pack
        self.slot = slot
        self.graphs = {}

    def buckets(self, max_rows: int) -> List[int]:
        out, b = [], min(self.MIN_BUCKET, triton.next_power_of_2(max(1, max_rows)))
        while True:
            out.append(b)
            if b >= max_rows:
                return out
            b *= 2

    def capture_all(self, max_rows: int) -> int:
        slot = self.slot
        host, dev = slot.host_rows, slot.device_rows
        with torch.cuda.stream(slot.stream):
            host[:2].zero_()  # n = 0: the compiling launch writes nothing
            dev[:2].copy_(host[:2], non_blocking=True)
            self.pack.launch(None, slot.buffer, 1, args=dev)
            slot.stream.synchronize()
            for bucket in self.buckets(max_rows):
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    dev[: 2 + bucket].copy_(host[: 2 + bucket], non_blocking=True)
                    self.pack.launch(None, slot.buffer, bucket, args=dev)
                finally:
                    graph.capture_end()
                self.graphs[bucket] = graph
        return len(self.graphs)

    def __call__(self, rows, at: int) -> List[int]:
        """Pack host ``rows`` (numpy int64) into the slot from byte ``at``, on the current
        stream (the slot's); the caller waits for the stream before the slot is read or reused."""
        n = int(rows.size)
        self.pack._check(n, at, self.slot.buffer)
        bucket = next((b for b in self.graphs if b >= n), None)
        if bucket is None:
            raise ValueError(f"a pack of {n} rows exceeds the captured buckets {list(self.graphs)}")
        host = self.slot.host_np
        host[0], host[1] = n, at // _WORD
        host[2 : 2 + n] = rows
        self.graphs[bucket].replay()
        return self.pack.offsets(n, at)
