"""Pack each distinct draft head slice of a transfer chunk once, and send every decode rank that
holds those heads from the same slab.

Why: sglang's transfer worker sends one chunk of a request to each decode rank in turn
(``send_kvcache`` once per decode rank). When the decode TP is larger than the prefill's
(``Regime.PACK_SOURCE``), several decode ranks hold the same heads: at Kimi-K3's TP4 -> TP32 a
prefill rank serves 8 decode ranks but only 2 distinct head slices, so packing per send gathers
every byte 4 times. Here the first send of a chunk packs every slice of the prefill rank's heads
at the decode's heads per rank, in one launch, and each later send of the chunk only builds
descriptors into the packed slab.

Nothing is built while serving: :class:`PreparedPacks` holds, for every number of heads per rank
a decode could hold, the partition of this rank's heads into slices and its packs (the whole
partition in one launch, and each slice alone), built and, on GPU, compiled and captured into
CUDA graphs for every slot at startup (``draft_kv_staging``). The slot a chunk packs into was
allocated at startup too.

Lifetime: a :class:`ChunkPacks` belongs to one transfer worker thread and one chunk. It holds a
slot of the :class:`~draft_kv_pack.PackStagingBuffer` from the first pack until the last decode
rank expected to read it has sent (:meth:`ChunkPacks.done`), or until the worker takes its next
chunk (:meth:`ChunkPacks.release`; a failed send ends sglang's loop over the chunk's decode ranks
early). A failed transfer from the slot quarantines it (:meth:`ChunkPacks.failed`).

When a partition does not fit in a slot, one slice is packed at a time (a slice whose decode
ranks interleave with another's is then packed again); when one slice alone does not fit, or no
slot is free, :meth:`ChunkPacks.slab` answers None and the caller sends per decode rank without
the shared slab.

Torch and numpy only, no sglang import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
    DraftKVGeometry,
    KVComponent,
    check_page_ids,
    draft_entry_components,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import (
    PackSlot,
    PackStagingBuffer,
    pack_row_slices_index_select,
    prepared_pack,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import dst_page_runs, token_rows


@dataclass(frozen=True)
class HeadSlice:
    """The bytes one prefill rank packs for the decode ranks holding ``heads``: for each source
    draft entry, ``byte_widths[i]`` bytes from ``byte_offsets[i]`` of every token row."""

    heads: range
    src_entries: tuple  # draft entry index within the source pool (K0..K(L-1), V0..V(L-1))
    byte_offsets: tuple
    byte_widths: tuple

    @classmethod
    def of(
        cls, src: DraftKVGeometry, heads: range, components: Sequence[KVComponent], src_entries
    ) -> "HeadSlice":
        """Heads ``heads`` of prefill rank ``src``'s token rows, for entries of ``components``."""
        return cls(
            heads=heads,
            src_entries=tuple(src_entries),
            byte_offsets=tuple((heads.start - src.head_start) * src.head_bytes(c) for c in components),
            byte_widths=tuple(len(heads) * src.head_bytes(c) for c in components),
        )

    def bytes_per_row(self) -> int:
        return sum(self.byte_widths)


class PreparedPacks:
    """Every pack a prefill rank can be asked for, prepared once (see the module docstring).

    ``sources`` are the draft entries as ``uint8 [token slots, row bytes]`` views, ``src`` the
    rank's geometry. The decode ranks a chunk goes to hold ``h`` heads per rank for some ``h``
    smaller than this rank's ``h_P`` that divides it (nested sharding), so the partitions are
    known before any decode registers."""

    def __init__(self, sources: Sequence[torch.Tensor], src: DraftKVGeometry, out: torch.Tensor):
        self.sources = list(sources)
        self.num_pages = int(self.sources[0].shape[0]) // src.page_size if self.sources else 0
        components = draft_entry_components(len(self.sources))
        entries = tuple(range(len(self.sources)))
        h_p, first = src.heads_per_rank, src.head_start
        self.partitions: Dict[HeadSlice, Tuple[HeadSlice, ...]] = {}
        self._packs: Dict[Tuple[HeadSlice, ...], Callable] = {}
        for h in (d for d in range(1, h_p) if h_p % d == 0):
            partition = tuple(
                HeadSlice.of(src, range(first + i, first + i + h), components, entries)
                for i in range(0, h_p, h)
            )
            for s in partition:
                self.partitions[s] = partition
                self._packs[(s,)] = self._prepare((s,), out)
            self._packs[partition] = self._prepare(partition, out)

    def _prepare(self, slices: Tuple[HeadSlice, ...], out: Optional[torch.Tensor]) -> Callable:
        """``pack(rows, buffer, at) -> slab offsets``: the fused kernel where it applies (``out``
        gives its device and alignment), else torch's gather, which compiles nothing."""
        flat = [self.sources[q] for s in slices for q in s.src_entries]
        offsets = [o for s in slices for o in s.byte_offsets]
        widths = [w for s in slices for w in s.byte_widths]
        fused = None if out is None else prepared_pack(flat, offsets, widths, out)
        if fused is not None:
            return fused
        return lambda rows, buffer, at=0: [  # noqa: E731
            at + o
            for o in pack_row_slices_index_select(flat, rows, offsets, widths, buffer[at:])
        ]

    @property
    def count(self) -> int:
        return len(self._packs)

    def partition(self, s: HeadSlice) -> Tuple[HeadSlice, ...]:
        """The slices packed together with ``s`` (its partition), or ``(s,)`` for a slice no
        partition has (a layout this rank was not prepared for: it is packed by torch)."""
        return self.partitions.get(s, (s,))

    def pack(self, slices: Tuple[HeadSlice, ...]) -> Callable:
        pack = self._packs.get(slices)
        return pack if pack is not None else self._prepare(slices, None)

    def warm(self, buffer: PackStagingBuffer) -> int:
        """Make every prepared pack ready for every slot of ``buffer`` now: on CUDA capture the
        fused packs' graphs (``draft_kv_pack_triton.GraphedPack``, which compiles and loads their
        kernel first), the only form they run in while serving; run every other pack once on one
        row. Returns the graphs captured."""
        from sglang_dflash_pp.srt.disaggregation.draft_kv_pack_triton import FusedPack, GraphedPack

        slot = buffer.slots[0]
        eager = [p for p in self._packs.values() if slot.stream is None or not isinstance(p, FusedPack)]
        with slot.on_stream():
            rows = slot.rows(np.zeros(1, dtype=np.int64))
            for pack in eager:  # the torch packs (and every pack on a CPU) run eagerly
                pack(rows, slot.buffer, 0)
        graphs = 0
        for slot in buffer.slots if slot.stream is not None else ():
            for pack in self._packs.values():
                if isinstance(pack, FusedPack):
                    graphed = slot.graphed[id(pack)] = GraphedPack(pack, slot)
                    graphs += graphed.capture_all(slot.max_rows)
        return graphs



def pack_slices(
    slot: PackSlot,
    at: int,
    slices: Tuple[HeadSlice, ...],
    prepared: PreparedPacks,
    rows: np.ndarray,
    written: Sequence = (),
) -> List[List[int]]:
    """Pack ``slices`` of ``rows`` into ``slot`` from byte ``at`` in one prepared pack (one
    fused launch on GPU), after ``written`` (the chunk's KV-write events), and wait for it.

    Returns, per slice, each entry's slab offset in the slot. This is the pack the send path
    times on an H200 (``benchmark/gpu/pack_send_path.py``)."""
    pack = prepared.pack(slices)
    graphed = slot.graphed.get(id(pack))  # every fused pack of a CUDA slot has its graphs
    with slot.on_stream(written):
        slabs = graphed(rows, at) if graphed is not None else pack(slot.rows(rows), slot.buffer, at)
    out, i = [], 0
    for s in slices:
        out.append(list(slabs[i : i + len(s.src_entries)]))
        i += len(s.src_entries)
    return out


class ChunkPacks:
    """The packed slabs of one chunk on one transfer worker (see the module docstring)."""

    def __init__(
        self,
        buffer: PackStagingBuffer,
        prepared: PreparedPacks,
        readers: Dict[HeadSlice, Set[str]],
        page_size: int,
        written: Sequence = (),
    ):
        self.buffer = buffer
        self.prepared = prepared
        self.readers = {s: set(r) for s, r in readers.items() if r}
        self.page_size = page_size
        self.written = tuple(written)
        self.slot: Optional[PackSlot] = None
        self.pages: Optional[np.ndarray] = None
        self.slabs: Dict[HeadSlice, List[int]] = {}
        self._top = 0
        self._dst_runs = None
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
        with the rest of its partition when that fits, if needed); None when ``s`` alone does
        not fit in a slot or no slot is free."""
        pages = np.asarray(src_pages, dtype=np.int64).reshape(-1)
        if s in self.slabs and self._covers(pages):
            return self.slabs[s]
        # A covered (trimmed) request is served from the packed pages: size by those.
        covered = self._covers(pages)
        n = self.pages.size if covered else pages.size
        if self._bytes(s, n) > self.buffer.slot_bytes:
            self.release()
            return None
        if not covered:
            check_page_ids(pages, self.prepared.num_pages)
            self._drop_slabs()
            self.pages = pages.copy()
        partition = self.prepared.partition(s)
        wanted = tuple(o for o in partition if o not in self.slabs)
        if len(wanted) < len(partition) or (
            self._top + sum(self._bytes(o, n) for o in wanted) > self.buffer.slot_bytes
        ):
            wanted = (s,)
        if self._top + self._bytes(s, n) > self.buffer.slot_bytes:
            self._drop_slabs()
        if self.slot is None:
            self.slot = self.buffer.take()
            if self.slot is None:
                self.pages = None
                return None
        packed = pack_slices(
            self.slot,
            self._top,
            wanted,
            self.prepared,
            token_rows(self.pages, self.page_size),
            self.written,
        )
        for o, offsets in zip(wanted, packed):
            self.slabs[o] = offsets
        self._top += sum(self._bytes(o, self.pages.size) for o in wanted)
        self.slices_packed += len(wanted)
        self.launches += 1
        return self.slabs[s]

    def dst_runs(self, dst_pages: np.ndarray):
        """``dst_page_runs`` of a decode rank's pages. The decode ranks of one decode instance
        allocate the same pages, so the chunk's later ranks reuse the first one's runs."""
        cached = self._dst_runs
        if cached is not None and np.array_equal(cached[0], dst_pages):
            return cached[1]
        runs = dst_page_runs(dst_pages)
        self._dst_runs = (dst_pages, runs)
        return runs

    def done(self, s: HeadSlice, session: str) -> None:
        """``session`` has sent its copy of ``s``; give the slot back after the last reader."""
        left = self.readers.get(s)
        if left is not None:
            left.discard(session)
            if not left:
                del self.readers[s]
        if not self.readers:
            self.release()

    def failed(self) -> None:
        """A transfer from the slot failed: it may still be read, so it is quarantined."""
        self.release(quarantine=True)

    def _drop_slabs(self) -> None:
        self.slabs.clear()
        self._top = 0

    def release(self, *, quarantine: bool = False) -> None:
        self._drop_slabs()
        self.pages = None
        if self.slot is not None:
            slot, self.slot = self.slot, None
            self.buffer.give_back(slot, quarantine=quarantine)


def readers_by_slice(pairs: Iterable) -> Dict[HeadSlice, Set[str]]:
    """``{slice: sessions}`` from ``(session, slice or None)`` pairs."""
    out: Dict[HeadSlice, Set[str]] = {}
    for session, s in pairs:
        if s is not None:
            out.setdefault(s, set()).add(session)
    return out
