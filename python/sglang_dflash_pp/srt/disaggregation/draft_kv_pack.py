"""Gather draft KV head slices into a registered staging buffer, so one descriptor moves a page run.

Used when the decode rank holds fewer draft heads than the prefill rank (``Regime.PACK_SOURCE``):
its heads are a strided slice of every source token row. Torch only, no sglang import, so the
same code runs where sglang is not installed.

A pack takes every entry of one transfer at once (sources, byte offsets and widths per entry),
which is the shape a single fused Triton launch wants (sglang's ``copy_mla_rows_into_pack`` has
the same contract over raw pointers): on CUDA the fused kernel of ``draft_kv_pack_triton``
(:func:`prepared_pack`), elsewhere and for unaligned slices one ``index_select`` per entry on the
buffers' own device (:func:`pack_row_slices_index_select`).

:class:`PackStagingBuffer` is allocated once per prefill rank at startup, before the server
serves (``draft_kv_staging``), on the draft pool's device, and split into one slot per transfer
worker. Everything a pack touches on the host and the device -- the slot, its side stream, its
pinned and device row-index buffers, its packs' CUDA graphs -- is made there, so a pack while
serving allocates, compiles and captures nothing. A slot is held from the pack until the last synchronous transfer that reads it returns,
so concurrent workers never share bytes; a slot whose transfer failed is kept out of use for
:data:`QUARANTINE_S`, since Mooncake's ``batch_transfer_sync`` returns on its timeout with the
batch possibly still reading it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

import numpy as np
import torch

from sglang_dflash_pp.srt.disaggregation.draft_kv_source import as_byte_rows  # noqa: F401

_SLOT_ALIGN = 256
# How long a slot whose transfer failed stays out of use: well past Mooncake's per-batch
# timeout (``MC_TRANSFER_TIMEOUT``, 30 s by default), after which no read of it is in flight.
QUARANTINE_S = 120.0


def pack_slot_bytes(row_bytes: int, page_size: int, chunk_tokens: int) -> int:
    """Bytes of a slot that packs every head slice of one transfer chunk in one step.

    ``row_bytes`` is one token row of every draft entry of this prefill rank (all its heads):
    the distinct head slices of a chunk's decode ranks partition those heads, so together they
    never exceed it. A chunk of ``chunk_tokens`` (``--chunked-prefill-size``) that does not
    start on a page boundary spans one page more than it fills."""
    pages = -(-int(chunk_tokens) // int(page_size)) + 1
    return -(-pages * int(page_size) * int(row_bytes) // _SLOT_ALIGN) * _SLOT_ALIGN


def prepared_pack(
    sources: Sequence[torch.Tensor],
    byte_offsets: Sequence[int],
    byte_widths: Sequence[int],
    out: torch.Tensor,
) -> Optional[Callable[[torch.Tensor, torch.Tensor], List[int]]]:
    """The fused pack of ``sources`` at these offsets and widths, as ``pack(rows, out, at)``: the
    kernel's checks and table done once. None where the fused kernel does not apply (use
    :func:`pack_row_slices_index_select` then). ``out`` is any buffer the pack will write into
    (for its device and alignment)."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_pack_triton import FusedPack, eligible

    if not eligible(sources, byte_offsets, byte_widths, out):
        return None
    return FusedPack(sources, byte_offsets, byte_widths, out.device)


def pack_row_slices_index_select(
    sources: Sequence[torch.Tensor],
    rows: torch.Tensor,
    byte_offsets: Sequence[int],
    byte_widths: Sequence[int],
    out: torch.Tensor,
) -> List[int]:
    """Write ``sources[e][rows, off_e : off_e + w_e]`` for each ``e`` into consecutive ``out``
    slabs, one ``index_select`` per entry; returns each slab's byte offset in ``out``.

    ``sources`` are ``uint8 [num_rows, row_bytes]`` views (:func:`as_byte_rows`), ``rows`` an
    int64 tensor on their device, ``out`` a flat ``uint8`` tensor; slab ``e`` is
    ``len(rows) x w_e`` bytes, row-major."""
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
    # CUDA: pinned host and device buffers of ``[n, out_word, rows...]`` for the packs' uploads
    host_rows: Optional[torch.Tensor] = None
    device_rows: Optional[torch.Tensor] = None
    host_np: Optional[np.ndarray] = None  # numpy view of ``host_rows``
    graphed: dict = field(default_factory=dict)  # id(prepared pack) -> GraphedPack (startup)

    @contextlib.contextmanager
    def on_stream(self, written: Sequence = ()) -> Iterator[None]:
        """Pack on this slot's side stream and wait for it: the transfer reads the slot next.

        ``written`` are the events the chunk's KV write recorded on the forward stream
        (``kv_write_fence``): the side stream waits on them before it reads a row of the pool."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            for event in written:
                self.stream.wait_event(event)
            yield
        self.stream.synchronize()

    @property
    def max_rows(self) -> int:
        return -1 if self.host_rows is None else int(self.host_rows.numel()) - 2

    def rows(self, token_rows: np.ndarray) -> torch.Tensor:
        """``token_rows`` (int64) on the slot's device, for an eager pack; call inside
        :meth:`on_stream`.

        On CUDA through the slot's pinned host buffer and an asynchronous copy on its stream: a
        pageable ``.to(device)`` blocks the host for a staged copy, which costs as much as the
        pack itself for a few thousand tokens. The slot is held until the pack is synchronised,
        so the next pack never overwrites rows still being read."""
        host = torch.from_numpy(np.ascontiguousarray(token_rows, dtype=np.int64))
        if self.stream is None:
            return host.to(self.buffer.device)
        n = host.numel()
        if n > self.max_rows:
            raise ValueError(f"a pack of {n} rows exceeds the slot's {self.max_rows} row indices")
        self.host_rows[2 : 2 + n].copy_(host)
        out = self.device_rows[2 : 2 + n]
        out.copy_(self.host_rows[2 : 2 + n], non_blocking=True)
        return out


def _allocate_default(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class PackStagingBuffer:
    """One buffer of equal slots, each taken by one transfer worker at a time.

    ``allocate(nbytes, device)`` returns the flat uint8 tensor (the send path allocates from
    Mooncake's custom memory pool when one is configured); ``max_rows`` is the most token rows
    one pack gathers (sized for the narrowest head slice), for the row-index buffers."""

    def __init__(
        self,
        slot_bytes: int,
        num_slots: int,
        device: torch.device,
        *,
        max_rows: int,
        allocate: Callable[[int, torch.device], torch.Tensor] = _allocate_default,
    ):
        if num_slots <= 0:
            raise ValueError("need at least one pack slot")
        # Slots start on 256-byte boundaries whatever the slot count: the fused pack writes
        # whole 8-byte words, and one prepared fused pack serves every slot.
        slot_bytes = int(slot_bytes) // _SLOT_ALIGN * _SLOT_ALIGN
        if slot_bytes <= 0:
            raise ValueError(f"a pack slot of {slot_bytes} bytes cannot hold a page")
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self.tensor = allocate(slot_bytes * num_slots, self.device)
        cuda = self.device.type == "cuda"
        self._lock = threading.Lock()
        self._free: List[PackSlot] = []
        self._quarantined: List[tuple] = []  # (free again at, slot)
        self.slots: List[PackSlot] = []
        for i in range(num_slots):
            view = self.tensor[i * slot_bytes : (i + 1) * slot_bytes]
            slot = PackSlot(view, view.data_ptr(), torch.cuda.Stream(self.device) if cuda else None)
            if cuda:
                slot.host_rows = torch.zeros(2 + max_rows, dtype=torch.int64, pin_memory=True)
                slot.device_rows = torch.zeros(2 + max_rows, dtype=torch.int64, device=self.device)
                slot.host_np = slot.host_rows.numpy()
            self.slots.append(slot)
            self._free.append(slot)

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def free_slots(self) -> int:
        with self._lock:
            self._release_expired()
            return len(self._free)

    def take(self) -> Optional[PackSlot]:
        """A free slot, or None (every slot is held or quarantined: the caller sends without one)."""
        with self._lock:
            self._release_expired()
            return self._free.pop() if self._free else None

    def give_back(self, slot: PackSlot, *, quarantine: bool = False) -> None:
        with self._lock:
            if quarantine:
                self._quarantined.append((time.monotonic() + QUARANTINE_S, slot))
            else:
                self._free.append(slot)

    def _release_expired(self) -> None:
        now = time.monotonic()
        back = [s for t, s in self._quarantined if t <= now]
        if back:
            self._quarantined = [(t, s) for t, s in self._quarantined if t > now]
            self._free.extend(back)
