"""Gather draft KV head slices into a registered staging buffer, so one descriptor moves a page run.

Used when the decode rank holds fewer draft heads than the prefill rank (``Regime.PACK_SOURCE``):
its heads are a strided slice of every source token row. Torch only, no sglang import, so the
same code runs where sglang is not installed.

:func:`pack_row_slices` is the kernel boundary: it takes every entry of one transfer at once
(sources, byte offsets and widths per entry), which is the shape a single fused Triton launch
wants (sglang's ``copy_mla_rows_into_pack`` has the same contract over raw pointers). On CUDA it
runs the fused Triton kernel of ``draft_kv_pack_triton``; elsewhere (and for unaligned slices) one
``index_select`` per entry on the buffers' own device.

:class:`PackStagingBuffer` is allocated and registered with the transfer engine once per prefill
KV manager, on the draft pool's device, and split into one slot per transfer worker; a slot is
held from the pack until the synchronous transfer that reads it returns, so concurrent workers
never share bytes. Requests larger than a slot are sent in chunks of whole pages.
"""

from __future__ import annotations

import contextlib
import queue
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

import numpy as np
import torch

_SLOT_ALIGN = 256


def as_byte_rows(t: torch.Tensor) -> torch.Tensor:
    """View a pool buffer ``[rows, ...]`` as ``uint8 [rows, row_bytes]`` without copying."""
    if not t.is_contiguous():
        raise ValueError("draft KV buffers must be contiguous to be packed by byte offset")
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def pack_row_slices(
    sources: Sequence[torch.Tensor],
    rows: torch.Tensor,
    byte_offsets: Sequence[int],
    byte_widths: Sequence[int],
    out: torch.Tensor,
) -> List[int]:
    """Write ``sources[e][rows, off_e : off_e + w_e]`` for each ``e`` into consecutive ``out`` slabs.

    ``sources`` are ``uint8 [num_rows, row_bytes]`` views (:func:`as_byte_rows`), ``rows`` an
    int64 tensor on their device, ``out`` a flat ``uint8`` tensor. Returns each slab's byte
    offset in ``out``; slab ``e`` is ``len(rows) x w_e`` bytes, row-major.

    On CUDA, uniform 8-byte-aligned slices (every bf16/fp16 draft) go through one fused Triton
    launch (``draft_kv_pack_triton``); otherwise one ``index_select`` per entry.
    """
    from sglang_dflash_pp.srt.disaggregation import draft_kv_pack_triton

    if draft_kv_pack_triton.eligible(sources, byte_offsets, byte_widths, out):
        return draft_kv_pack_triton.pack_row_slices_fused(
            sources, rows, byte_offsets, byte_widths, out
        )
    return pack_row_slices_index_select(sources, rows, byte_offsets, byte_widths, out)


def prepared_pack(
    sources: Sequence[torch.Tensor],
    byte_offsets: Sequence[int],
    byte_widths: Sequence[int],
    out: torch.Tensor,
) -> Optional[Callable[[torch.Tensor, torch.Tensor], List[int]]]:
    """:func:`pack_row_slices` with its sources, offsets and widths fixed, as ``pack(rows, out)``:
    the fused kernel's checks and table done once. None where the fused kernel does not apply
    (call :func:`pack_row_slices` then). ``out`` is any buffer the pack will write into (for its
    device and alignment); the send path keeps one per slot."""
    from sglang_dflash_pp.srt.disaggregation import draft_kv_pack_triton

    if not draft_kv_pack_triton.eligible(sources, byte_offsets, byte_widths, out):
        return None
    return draft_kv_pack_triton.FusedPack(sources, byte_offsets, byte_widths, out.device)


def pack_row_slices_index_select(
    sources: Sequence[torch.Tensor],
    rows: torch.Tensor,
    byte_offsets: Sequence[int],
    byte_widths: Sequence[int],
    out: torch.Tensor,
) -> List[int]:
    """The portable implementation of :func:`pack_row_slices`: one ``index_select`` per entry."""
    n = int(rows.numel())
    offsets: List[int] = []
    at = 0
    need = n * sum(int(w) for w in byte_widths)
    if need > out.numel():
        raise ValueError(f"pack needs {need} bytes, staging slot holds {out.numel()}")
    for src, off, width in zip(sources, byte_offsets, byte_widths):
        off, width = int(off), int(width)
        if off < 0 or off + width > src.shape[1]:
            raise ValueError(f"slice [{off}, {off + width}) outside a {src.shape[1]}-byte row")
        torch.index_select(
            src[:, off : off + width], 0, rows, out=out[at : at + n * width].view(n, width)
        )
        offsets.append(at)
        at += n * width
    return offsets


@dataclass
class PackSlot:
    buffer: torch.Tensor  # flat uint8 view of this slot
    ptr: int
    stream: Optional["torch.cuda.Stream"]
    _host_rows: Optional[torch.Tensor] = None  # pinned staging for the row indices (CUDA)
    _device_rows: Optional[torch.Tensor] = None
    graphed: dict = field(default_factory=dict)  # (pack, byte offset) -> GraphedPack or None

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Pack on this slot's side stream and wait for it: the transfer reads the slot next."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()

    def rows(self, token_rows: np.ndarray) -> torch.Tensor:
        """``token_rows`` (int64) on the slot's device; call inside :meth:`on_stream`.

        On CUDA through a pinned host buffer and an asynchronous copy on the slot's stream, kept
        between packs: a pageable ``.to(device)`` blocks the host for a staged copy, which costs
        as much as the pack itself for a few thousand tokens. The slot is held until the pack
        is synchronised, so the next pack never overwrites rows still being read."""
        host = torch.from_numpy(np.ascontiguousarray(token_rows, dtype=np.int64))
        if self.stream is None:
            return host.to(self.buffer.device)
        n = host.numel()
        if self._host_rows is None or self._host_rows.numel() < n:
            size = max(n, 2 * (0 if self._host_rows is None else self._host_rows.numel()), 4096)
            self._host_rows = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._device_rows = torch.empty(size, dtype=torch.int64, device=self.buffer.device)
        self._host_rows[:n].copy_(host)
        out = self._device_rows[:n]
        out.copy_(self._host_rows[:n], non_blocking=True)
        return out


class PackStagingBuffer:
    """One engine-registered buffer, split into equal slots handed out one caller at a time."""

    def __init__(
        self,
        total_bytes: int,
        num_slots: int,
        device: torch.device,
        register: Callable[[int, int], None],
    ):
        if num_slots <= 0:
            raise ValueError("need at least one pack slot")
        # Slots start on 256-byte boundaries whatever the slot count: the fused pack writes
        # whole 8-byte words, and one prepared pack serves every slot.
        slot_bytes = total_bytes // num_slots // _SLOT_ALIGN * _SLOT_ALIGN
        if slot_bytes <= 0:
            raise ValueError(f"{total_bytes} bytes cannot be split into {num_slots} slots")
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self.tensor = torch.empty(slot_bytes * num_slots, dtype=torch.uint8, device=self.device)
        register(self.tensor.data_ptr(), self.tensor.numel())
        self._free: "queue.Queue[PackSlot]" = queue.Queue()
        for i in range(num_slots):
            view = self.tensor[i * slot_bytes : (i + 1) * slot_bytes]
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            self._free.put(PackSlot(view, view.data_ptr(), stream))

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @contextlib.contextmanager
    def acquire(self) -> Iterator[PackSlot]:
        slot = self._free.get()
        try:
            yield slot
        finally:
            self._free.put(slot)
