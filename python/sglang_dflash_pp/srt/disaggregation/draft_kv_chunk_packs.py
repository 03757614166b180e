"""Pack each distinct draft head slice of a transfer chunk once, and send every decode rank that
holds those heads from the same slab.

Why: sglang's transfer worker sends one chunk of a request to each decode rank in turn
(``send_kvcache`` once per decode rank). When the decode TP is larger than the prefill's
(``Regime.PACK_SOURCE``), several decode ranks hold the same heads: at Kimi-K3's TP4 -> TP32 a
prefill rank serves 8 decode ranks but only 2 distinct head slices, so packing per send gathers
every byte 4 times. Here the first send of a chunk packs every slice the chunk's decode ranks
need, in one launch when they fit in the worker's pack slot together, and each later send of the
chunk only builds descriptors into the packed slab.

Lifetime: a :class:`ChunkPacks` belongs to one transfer worker thread and one chunk. It holds a
slot of the :class:`~draft_kv_pack.PackStagingBuffer` from the first pack until the last decode
rank expected to read it has sent (:meth:`ChunkPacks.done`), or until the worker takes its next
chunk (:meth:`ChunkPacks.release`; a failed send ends sglang's loop over the chunk's decode ranks
early). A slot is one worker's share of the staging memory, so the memory stays bounded by
``SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB`` whatever the number of decode ranks.

When the slices of a chunk do not fit in a slot together, one slice is packed at a time (a
slice whose decode ranks interleave with another's is then packed again); when one slice alone
does not fit, :meth:`ChunkPacks.slab` answers None and the caller packs per decode rank in
windows of whole pages (the send path's ``pages_per_send``), as before this module.

Torch and numpy only, no sglang import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set

import numpy as np
import torch

from sglang_dflash_pp.srt.disaggregation import draft_kv_pack_triton
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import token_rows
from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import (
    PackSlot,
    PackStagingBuffer,
    pack_row_slices,
    prepared_pack,
)


@dataclass(frozen=True)
class HeadSlice:
    """The bytes one prefill rank packs for the decode ranks holding ``heads``: for each source
    draft entry, ``byte_widths[i]`` bytes from ``byte_offsets[i]`` of every token row."""

    heads: range
    src_entries: tuple  # draft entry index within the source pool (K0..K(L-1), V0..V(L-1))
    byte_offsets: tuple
    byte_widths: tuple

    def bytes_per_row(self) -> int:
        return sum(self.byte_widths)


logger = logging.getLogger(__name__)
_prepared: Dict[tuple, Callable] = {}


def pack_slices(
    slot: PackSlot,
    at: int,
    slices: Sequence[HeadSlice],
    sources: Callable[[], Sequence[torch.Tensor]],
    rows: np.ndarray,
    *,
    key: Optional[tuple] = None,
) -> List[List[int]]:
    """Pack ``slices`` of ``rows`` into ``slot`` from byte ``at``, in one pack call (one fused
    launch on GPU when the widths are uniform), and wait for it.

    ``sources()`` gives the draft entries as ``uint8 [token slots, row bytes]``. ``key``, when
    given, names those buffers (the send path: their registered pointers and item lengths); the
    fused kernel's table is then built once per key and slice set, so a pack costs the row upload
    and one launch. Returns, per slice, each entry's slab offset in the slot. This is the pack
    the send path times on an H200 (``benchmark/gpu/pack_send_path.py``)."""
    slices = tuple(slices)
    pack = None if key is None else _prepared.get((key, slices))
    if pack is None:
        entries = sources()
        flat = [entries[q] for s in slices for q in s.src_entries]
        offsets = [o for s in slices for o in s.byte_offsets]
        widths = [w for s in slices for w in s.byte_widths]
        pack = prepared_pack(flat, offsets, widths, slot.buffer)
        if pack is not None and key is not None:
            if len(_prepared) >= 64:
                _prepared.clear()
            _prepared[(key, slices)] = pack
        elif pack is None:
            pack = lambda r, out: pack_row_slices(flat, r, offsets, widths, out)  # noqa: E731
    graphed = _graphed(slot, pack, at)
    with slot.on_stream():
        if graphed is not None:
            try:
                slabs = graphed(rows)
            except Exception:
                logger.exception("DFlash draft KV: CUDA-graph pack failed; packing eagerly")
                slot.graphed[(id(pack), at)] = None
                slabs = pack(slot.rows(rows), slot.buffer[at:])
        else:
            slabs = pack(slot.rows(rows), slot.buffer[at:])
    out, i = [], 0
    for s in slices:
        out.append([at + o for o in slabs[i : i + len(s.src_entries)]])
        i += len(s.src_entries)
    return out


def _graphed(slot: PackSlot, pack, at: int):
    """The slot's CUDA-graph replay of a fused ``pack`` at byte ``at`` (None: pack eagerly)."""
    if slot.stream is None or not isinstance(pack, draft_kv_pack_triton.FusedPack):
        return None
    key = (id(pack), at)  # the GraphedPack holds ``pack``, so its id is not reused meanwhile
    if key not in slot.graphed:
        if len(slot.graphed) >= 16:
            slot.graphed.clear()
        slot.graphed[key] = draft_kv_pack_triton.GraphedPack(pack, slot.buffer[at:])
    return slot.graphed[key]


class ChunkPacks:
    """The packed slabs of one chunk on one transfer worker (see the module docstring)."""

    def __init__(
        self,
        buffer: PackStagingBuffer,
        readers: Dict[HeadSlice, Set[str]],
        sources: Callable[[], Sequence[torch.Tensor]],
        page_size: int,
        key: Optional[tuple] = None,
    ):
        self.buffer = buffer
        self.key = key
        self.readers = {s: set(r) for s, r in readers.items() if r}
        self._sources = sources
        self.page_size = page_size
        self.slot: Optional[PackSlot] = None
        self._acquired = None
        self.pages: Optional[np.ndarray] = None
        self.slabs: Dict[HeadSlice, List[int]] = {}
        self._top = 0
        self.slices_packed = 0  # for tests and benchmarks: head slices gathered in this chunk
        self.launches = 0

    def _bytes(self, s: HeadSlice, n_pages: int) -> int:
        return n_pages * self.page_size * s.bytes_per_row()

    def _covers(self, src_pages: np.ndarray) -> bool:
        """The packed pages start with ``src_pages`` (sglang may trim a decode rank's pages)."""
        n = src_pages.size
        return (
            self.pages is not None
            and n <= self.pages.size
            and np.array_equal(self.pages[:n], src_pages)
        )

    def slab(self, s: HeadSlice, src_pages) -> Optional[List[int]]:
        """Each entry's slab offset in :attr:`slot` for slice ``s`` of ``src_pages`` (packing it,
        and every other slice still to be read when they all fit, if needed); None when ``s``
        alone does not fit in a slot."""
        pages = np.asarray(src_pages, dtype=np.int64).reshape(-1)
        if s in self.slabs and self._covers(pages):
            return self.slabs[s]
        # A covered (trimmed) request is served from the packed pages: size by those.
        n = self.pages.size if self._covers(pages) else pages.size
        if self._bytes(s, n) > self.buffer.slot_bytes:
            self.release()
            return None
        if not self._covers(pages):
            self._drop_slabs()
            self.pages = pages.copy()
        wanted = [s] + [o for o in self.readers if o != s and o not in self.slabs]
        if self._top + sum(self._bytes(o, n) for o in wanted) > self.buffer.slot_bytes:
            wanted = [s]
        if self._top + self._bytes(s, n) > self.buffer.slot_bytes:
            self._drop_slabs()
        if self.slot is None:
            self._acquired = self.buffer.acquire()
            self.slot = self._acquired.__enter__()
        packed = pack_slices(
            self.slot,
            self._top,
            wanted,
            self._sources,
            token_rows(self.pages, self.page_size),
            key=self.key,
        )
        for o, offsets in zip(wanted, packed):
            self.slabs[o] = offsets
        self._top += sum(self._bytes(o, self.pages.size) for o in wanted)
        self.slices_packed += len(wanted)
        self.launches += 1
        return self.slabs[s]

    def done(self, s: HeadSlice, session: str) -> None:
        """``session`` has sent its copy of ``s``; give the slot back after the last reader."""
        left = self.readers.get(s)
        if left is not None:
            left.discard(session)
            if not left:
                del self.readers[s]
        if not self.readers:
            self.release()

    def _drop_slabs(self) -> None:
        self.slabs.clear()
        self._top = 0

    def release(self) -> None:
        self._drop_slabs()
        self.pages = None
        if self._acquired is not None:
            acquired, self._acquired, self.slot = self._acquired, None, None
            acquired.__exit__(None, None, None)


def readers_by_slice(pairs: Iterable) -> Dict[HeadSlice, Set[str]]:
    """``{slice: sessions}`` from ``(session, slice or None)`` pairs."""
    out: Dict[HeadSlice, Set[str]] = {}
    for session, s in pairs:
        if s is not None:
            out.setdefault(s, set()).add(session)
    return out
