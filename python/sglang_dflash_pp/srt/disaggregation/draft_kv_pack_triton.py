"""One Triton launch that packs a strided head slice of every draft KV entry into staging slabs.

Same contract as :func:`draft_kv_pack.pack_row_slices` (slab ``e`` = ``sources[e][rows, off_e :
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

from typing import Dict, List, Sequence, Tuple

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

    @triton.jit
    def _pack_rows_kernel(
        meta,  # int64 [entries, 2]: source address of the slice start (bytes), row stride (words)
        rows,  # int64 [n]
        out,  # int64 words
        n_rows,
        n_ptr,  # int64 [1]: the row count, read on the device (CUDA-graph replays)
        WIDTH: tl.constexpr,  # words per row slice
        BLOCK_COLS: tl.constexpr,  # WIDTH rounded up to a power of two
        BLOCK_ROWS: tl.constexpr,
        N_FROM_PTR: tl.constexpr,
    ):
        entry = tl.program_id(0)
        block = tl.program_id(1)
        if N_FROM_PTR:
            n_rows = tl.load(n_ptr)
        src = tl.load(meta + entry * 2).to(out.dtype)
        stride = tl.load(meta + entry * 2 + 1)
        r = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        c = tl.arange(0, BLOCK_COLS)
        row_ok = r < n_rows
        mask = row_ok[:, None] & (c < WIDTH)[None, :]
        src_rows = tl.load(rows + r, mask=row_ok, other=0)
        values = tl.load(src + src_rows[:, None] * stride + c[None, :], mask=mask)
        dst = out + entry.to(tl.int64) * n_rows * WIDTH + r[:, None] * WIDTH + c[None, :]
        tl.store(dst, values, mask=mask)


class FusedPack:
    """The fused launch for fixed sources, offsets and widths: the per-entry table (source address
    of each slice start, row stride in words) is built and copied to the device once, so a pack
    costs the row upload and one launch. Build only when :func:`eligible` holds for the sources.

    The table holds addresses, not tensors: the caller keys it by the pool's buffers and must not
    use it after they are freed (the send path keys it by the registered entry pointers)."""

    def __init__(self, sources: Sequence[torch.Tensor], byte_offsets, byte_widths, device):
        self.entries = len(sources)
        self.width = int(byte_widths[0])
        self.meta = torch.tensor(
            [[s.data_ptr() + int(o), s.stride(0) // _WORD] for s, o in zip(sources, byte_offsets)],
            dtype=torch.int64,
        ).to(device)
        self.words = self.width // _WORD
        self.block_cols = triton.next_power_of_2(self.words)

    def __call__(
        self, rows: torch.Tensor, out: torch.Tensor, *, block_words: int = 4096, num_warps: int = 4
    ) -> List[int]:
        """One program copies ``block_words`` 8-byte words (whole row slices) of one entry."""
        n = int(rows.numel())
        need = n * self.width * self.entries
        if need > out.numel():
            raise ValueError(f"pack needs {need} bytes, staging slot holds {out.numel()}")
        offsets = [e * n * self.width for e in range(self.entries)]
        if n == 0:
            return offsets
        self.launch(rows, out[:need], n, block_words=block_words, num_warps=num_warps)
        return offsets

    def launch(self, rows, out, n, *, n_ptr=None, block_words: int = 4096, num_warps: int = 4):
        """One launch over ``n`` rows (or, with ``n_ptr``, grid for ``n`` rows and the count read
        from ``n_ptr`` on the device)."""
        block_rows = max(1, block_words // self.block_cols)
        _pack_rows_kernel[(self.entries, triton.cdiv(n, block_rows))](
            self.meta,
            rows,
            out[: out.numel() // _WORD * _WORD].view(torch.int64),
            n,
            self.meta if n_ptr is None else n_ptr,
            WIDTH=self.words,
            BLOCK_COLS=self.block_cols,
            BLOCK_ROWS=block_rows,
            N_FROM_PTR=n_ptr is not None,
            num_warps=num_warps,
        )


class GraphedPack:
    """A :class:`FusedPack` into one fixed output, replayed from CUDA graphs.

    Why: on the send path a pack is waited for before the transfer, so its host cost counts in
    full. An eager Triton launch plus the row upload costs the host several times what the kernel
    takes for a few thousand tokens; a graph replay costs one launch. A graph holds the upload of
    the row indices (from a pinned buffer the host fills) and the launch, for up to ``bucket``
    rows; the row count travels with the rows and the kernel reads it on the device, so a graph
    per power-of-two bucket serves every request length. Captured on first use of a bucket, on
    the caller's (non-default) stream, in thread-local capture mode so other threads' CUDA work
    is not affected; the first launch compiles the kernel before capturing.
    """

    MIN_BUCKET = 1024

    def __init__(self, pack: FusedPack, out: torch.Tensor):
        self.pack = pack
        self.out = out
        self._graphs: Dict[int, tuple] = {}

    def capacity_rows(self) -> int:
        return self.out.numel() // (self.pack.width * self.pack.entries)

    def __call__(self, rows) -> List[int]:
        """Pack host ``rows`` (numpy int64) into :attr:`out` on the current stream; the caller
        waits for the stream before reading the output or calling again."""
        n = int(rows.size)
        if n > self.capacity_rows():
            raise ValueError(
                f"pack needs {n * self.pack.width * self.pack.entries} bytes, "
                f"staging slot holds {self.out.numel()}"
            )
        bucket = max(self.MIN_BUCKET, triton.next_power_of_2(max(n, 1)))
        graph, host, _, _ = self._graphs.get(bucket) or self._capture(bucket)
        host[0] = n
        host[1 : 1 + n] = rows
        graph.replay()
        return [e * n * self.pack.width for e in range(self.pack.entries)]

    def _capture(self, bucket: int) -> tuple:
        stream = torch.cuda.current_stream(self.out.device)
        host = torch.zeros(1 + bucket, dtype=torch.int64, pin_memory=True)
        dev = torch.zeros(1 + bucket, dtype=torch.int64, device=self.out.device)
        self.pack.launch(dev[1:], self.out, bucket, n_ptr=dev)  # compiles; n = 0 writes nothing
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            dev.copy_(host, non_blocking=True)
            self.pack.launch(dev[1:], self.out, bucket, n_ptr=dev)
        finally:
            graph.capture_end()
        entry = self._graphs[bucket] = (graph, host.numpy(), host, dev)
        return entry


_fused_packs: Dict[Tuple, FusedPack] = {}


def pack_row_slices_fused(
    sources: Sequence[torch.Tensor],
    rows: torch.Tensor,
    byte_offsets: Sequence[int],
    byte_widths: Sequence[int],
    out: torch.Tensor,
    *,
    block_words: int = 4096,
    num_warps: int = 4,
) -> List[int]:
    """Fused version of ``pack_row_slices``; call only when :func:`eligible` is true. The table
    is cached by the slices' addresses (a pool's buffers and head offsets are fixed for the
    server's lifetime)."""
    key = (
        out.device,
        int(byte_widths[0]),
        tuple((s.data_ptr() + int(o), s.stride(0)) for s, o in zip(sources, byte_offsets)),
    )
    pack = _fused_packs.get(key)
    if pack is None:
        if len(_fused_packs) >= 256:
            _fused_packs.clear()
        pack = _fused_packs[key] = FusedPack(sources, byte_offsets, byte_widths, out.device)
    return pack(rows, out, block_words=block_words, num_warps=num_warps)
