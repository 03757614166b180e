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
        WIDTH: tl.constexpr,  # words per row slice
        BLOCK_COLS: tl.constexpr,  # WIDTH rounded up to a power of two
        BLOCK_ROWS: tl.constexpr,
    ):
        entry = tl.program_id(0)
        block = tl.program_id(1)
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


_slice_tables: Dict[Tuple, torch.Tensor] = {}


def _slice_table(sources, byte_offsets, device) -> torch.Tensor:
    """The kernel's per-entry table on the device. The pool buffers and head offsets of a transfer
    are fixed for the server's lifetime, so the table is built (and copied to the device) once."""
    key = (
        device,
        tuple((s.data_ptr() + int(o), s.stride(0)) for s, o in zip(sources, byte_offsets)),
    )
    table = _slice_tables.get(key)
    if table is None:
        if len(_slice_tables) >= 256:
            _slice_tables.clear()
        table = torch.tensor(
            [[addr, stride // _WORD] for addr, stride in key[1]], dtype=torch.int64
        )
        table = _slice_tables[key] = table.to(device)
    return table


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
    """Fused version of ``pack_row_slices``; call only when :func:`eligible` is true.

    One program copies ``block_words`` 8-byte words (whole row slices) of one entry."""
    n = int(rows.numel())
    width = int(byte_widths[0])
    need = n * width * len(sources)
    if need > out.numel():
        raise ValueError(f"pack needs {need} bytes, staging slot holds {out.numel()}")
    offsets = [e * n * width for e in range(len(sources))]
    if n == 0:
        return offsets
    meta = _slice_table(sources, byte_offsets, out.device)
    words = width // _WORD
    block_rows = max(1, block_words // triton.next_power_of_2(words))
    grid = (len(sources), triton.cdiv(n, block_rows))
    _pack_rows_kernel[grid](
        meta,
        rows,
        out[:need].view(torch.int64),
        n,
        WIDTH=words,
        BLOCK_COLS=triton.next_power_of_2(words),
        BLOCK_ROWS=block_rows,
        num_warps=num_warps,
    )
    return offsets
