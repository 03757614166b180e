"""Which prefill rank writes which draft KV bytes of which decode rank, as Mooncake descriptors.

Data flow: :class:`DraftKVGeometry` of each side -> :class:`DraftKVPairPlan` for one prefill
rank and one decode rank -> :class:`Descriptors` ``(src address, dst address, length)``, the
form Mooncake's ``batch_transfer_sync_write`` takes. Stdlib and numpy only.

**Writers.** A decode rank ``r`` bootstraps against the prefill ranks sglang's rank mapping
assigns it (``CommonKVManager._resolve_rank_mapping``): ``{r // (Td/Tp)}`` when ``Td >= Tp``,
else ``[r*k, (r+1)*k)`` with ``k = Tp/Td``. Prefill rank ``p`` of that group shares with ``r``
the draft heads both hold, and writes them iff they are not empty and no lower rank of the
group holds the same heads. Every decode byte so has exactly one writer; a replicated prefill
rank that loses the election sends no draft entries (its target KV and ack follow sglang's rules).

**Regimes** (``h_P``, ``h_D``: draft heads per prefill / decode rank):

* ``h_P == h_D`` -- :attr:`Regime.WHOLE_PAGES`. A page is contiguous on both sides: one
  descriptor per run of pages contiguous in both page lists. These are the descriptors sglang's
  own send path builds when both sides' item lengths agree.
* ``h_D < h_P`` (decode TP larger, e.g. TP4 -> TP32) -- :attr:`Regime.PACK_SOURCE`. The decode
  rank's heads are a slice of every source token row. The slice of each page is gathered
  (``draft_kv_pack``) into a staging buffer registered with the engine, page after page in
  request order, so one descriptor covers each run of destination-contiguous pages. Without
  packing it would be one descriptor per token row (x page size).
* ``h_D > h_P`` (decode TP smaller, e.g. TP2 -> TP1) -- :attr:`Regime.PER_TOKEN`. Several
  prefill ranks fill disjoint head slices of every decode token row, so the destination is
  strided: one descriptor per token row and entry. We chose this over decode-side staging
  because per-token descriptors need no code on the decode server: a stock decode receives into
  its own pool. Staging would need a receive buffer registered on the decode side, an unpack
  kernel, and a hook into decode's transfer completion that runs the unpack for all ``k``
  writers before the request is released. Bytes moved are the same physical minimum; only the
  descriptor count grows, by the page size. Decode usually runs the larger TP, so the regime is
  uncommon, and decode-side staging could replace it behind :func:`plan_pair` later.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Iterator, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
    DraftKVGeometry,
    DraftKVLayoutError,
    KVComponent,
    format_heads,
)
from sglang_dflash_pp.srt.disaggregation.column_arrays import concat_columns


class Regime(enum.Enum):
    WHOLE_PAGES = "whole pages"
    PACK_SOURCE = "pack on prefill, then page runs"
    PER_TOKEN = "one descriptor per token row"


def prefill_ranks_for(decode_rank: int, *, prefill_tp: int, decode_tp: int) -> range:
    """The prefill attention-TP ranks a decode rank receives from (sglang's rank mapping)."""
    if decode_tp >= prefill_tp:
        if decode_tp % prefill_tp:
            raise DraftKVLayoutError(_tp_pair_message(prefill_tp, decode_tp))
        p = decode_rank // (decode_tp // prefill_tp)
        return range(p, p + 1)
    if prefill_tp % decode_tp:
        raise DraftKVLayoutError(_tp_pair_message(prefill_tp, decode_tp))
    k = prefill_tp // decode_tp
    return range(decode_rank * k, (decode_rank + 1) * k)


def _tp_pair_message(prefill_tp: int, decode_tp: int) -> str:
    return (
        f"prefill attention TP {prefill_tp} and decode attention TP {decode_tp} must divide one "
        "another for PD transfer; change one of the --tp-size values (or --dp-size with "
        "attention data parallelism)."
    )


def _shared_heads(a: range, b: range) -> range:
    return range(max(a.start, b.start), max(max(a.start, b.start), min(a.stop, b.stop)))


@dataclass(frozen=True)
class DraftKVPairPlan:
    """What prefill rank ``src.tp_rank`` sends of the draft KV to decode rank ``dst.tp_rank``."""

    src: DraftKVGeometry
    dst: DraftKVGeometry
    heads: range  # global draft heads held by both
    writer: bool  # elected to write them

    @property
    def regime(self) -> Regime:
        if self.src.heads_per_rank == self.dst.heads_per_rank:
            return Regime.WHOLE_PAGES
        if self.dst.heads_per_rank < self.src.heads_per_rank:
            return Regime.PACK_SOURCE
        return Regime.PER_TOKEN

    def src_offset(self, c: KVComponent) -> int:
        """Bytes from the start of a source token row to the first shared head."""
        return (self.heads.start - self.src.head_start) * self.src.head_bytes(c)

    def dst_offset(self, c: KVComponent) -> int:
        return (self.heads.start - self.dst.head_start) * self.dst.head_bytes(c)

    def width(self, c: KVComponent) -> int:
        """Bytes per token row this pair moves."""
        return len(self.heads) * self.src.head_bytes(c)

    def bytes_per_page(self, c: KVComponent) -> int:
        return self.src.page_size * self.width(c)

    def describe(self) -> str:
        if not self.writer:
            return (
                f"prefill rank {self.src.tp_rank} -> decode rank {self.dst.tp_rank}: "
                "no draft entries (another prefill rank writes these heads)"
            )
        return (
            f"prefill rank {self.src.tp_rank} -> decode rank {self.dst.tp_rank}: draft "
            f"{format_heads(self.heads)} ({self.regime.value})"
        )


def plan_pair(src: DraftKVGeometry, dst: DraftKVGeometry) -> DraftKVPairPlan:
    """The plan for one prefill rank and one decode rank it is mapped to (else a refusal)."""
    if not src.same_shape(dst):
        raise DraftKVLayoutError(
            f"prefill and decode describe different drafts ({src.shape.describe()}, page size "
            f"{src.page_size} vs {dst.shape.describe()}, page size {dst.page_size}); both "
            "servers must load the same draft with the same --page-size and --kv-cache-dtype."
        )
    group = prefill_ranks_for(dst.tp_rank, prefill_tp=src.tp_size, decode_tp=dst.tp_size)
    if src.tp_rank not in group:
        raise DraftKVLayoutError(
            f"decode rank {dst.tp_rank} of {dst.tp_size} receives from prefill ranks "
            f"{list(group)} in sglang's rank mapping, not from prefill rank {src.tp_rank} of "
            f"{src.tp_size}; a mode that pairs every prefill rank with every decode rank (e.g. "
            "--enable-kv-cache-sharding) is not supported with a DFLASH draft."
        )
    heads = _shared_heads(src.owned_heads, dst.owned_heads)
    # The lowest rank of the group holding the same heads writes them.
    writer = bool(len(heads)) and src.tp_rank == next(
        q
        for q in group
        if _shared_heads(replace(src, tp_rank=q).owned_heads, dst.owned_heads) == heads
    )
    plan = DraftKVPairPlan(src=src, dst=dst, heads=heads, writer=writer)
    if writer and len(heads) != min(src.heads_per_rank, dst.heads_per_rank):
        # Nested sharding guarantees one side's heads contain the other's.
        raise DraftKVLayoutError(
            f"{src.describe()} and {dst.describe()} share only part of a head range; this "
            "sharding cannot be transferred head by head."
        )
    return plan


# -- descriptors ------------------------------------------------------------------------------


class Descriptors(NamedTuple):
    """Transfer descriptors as three parallel int64 arrays."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    @classmethod
    def empty(cls) -> "Descriptors":
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z)

    @classmethod
    def concat(cls, parts: Sequence["Descriptors"]) -> "Descriptors":
        return concat_columns(cls, parts)

    @property
    def count(self) -> int:
        return int(self.src.size)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def batches(self, max_per_batch: int) -> Iterator["Descriptors"]:
        """Consecutive slices of at most ``max_per_batch`` (<= 0: one batch)."""
        n = self.count
        step = n if max_per_batch <= 0 else max_per_batch
        for start in range(0, n, max(step, 1)):
            yield Descriptors(*(a[start : start + step] for a in self))

    def as_blocks(self) -> list:
        """``[(src, dst, length), ...]``, sglang's ``_transfer_data`` input."""
        return list(zip(self.src.tolist(), self.dst.tolist(), self.length.tolist()))


def _pages(pages) -> np.ndarray:
    return np.asarray(pages, dtype=np.int64).reshape(-1)


def page_runs(src_pages, dst_pages) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of pages consecutive on both sides: (src starts, dst starts, lengths)."""
    s, d = _pages(src_pages), _pages(dst_pages)
    if s.size != d.size:
        raise ValueError(f"page lists differ in length: {s.size} source, {d.size} destination")
    if s.size == 0:
        return s, d, s
    breaks = np.flatnonzero((s[1:] - s[:-1] != 1) | (d[1:] - d[:-1] != 1)) + 1
    starts = np.concatenate((np.zeros(1, np.int64), breaks))
    lengths = np.concatenate((breaks, [s.size])) - starts
    return s[starts], d[starts], lengths


def dst_page_runs(dst_pages) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of consecutive destination pages: (list positions, dst starts, lengths)."""
    d = _pages(dst_pages)
    if d.size == 0:
        return d, d, d
    ends = np.flatnonzero(d[1:] - d[:-1] != 1) + 1
    starts = np.concatenate((np.zeros(1, np.int64), ends))
    return starts, d[starts], np.concatenate((ends, [d.size])) - starts


def require_writer(plan: DraftKVPairPlan) -> None:
    if not plan.writer:
        raise ValueError(f"not a writer: {plan.describe()}")


def whole_page_descriptors(
    plan: DraftKVPairPlan, c: KVComponent, src_base: int, dst_base: int, src_pages, dst_pages
) -> Descriptors:
    require_writer(plan)
    if plan.regime is not Regime.WHOLE_PAGES:
        raise ValueError(f"whole pages need equal heads per rank: {plan.describe()}")
    item = plan.dst.page_bytes(c)
    s0, d0, n = page_runs(src_pages, dst_pages)
    return Descriptors(src_base + s0 * item, dst_base + d0 * item, n * item)


def token_rows(src_pages, page_size: int) -> np.ndarray:
    """Source token rows of ``src_pages``, page after page in request order (a pack's order)."""
    return (_pages(src_pages)[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)


def pack_source_rows(plan: DraftKVPairPlan, src_pages) -> np.ndarray:
    """Source token rows to gather for one decode rank."""
    return token_rows(src_pages, plan.src.page_size)


def packed_descriptors(
    plan: DraftKVPairPlan, c: KVComponent, pack_base: int, dst_base: int, dst_pages
) -> Descriptors:
    """Page runs from a packed slab (``len(dst_pages)`` pages of ``width`` bytes per row)."""
    require_writer(plan)
    if plan.regime is not Regime.PACK_SOURCE:
        raise ValueError(f"packing serves decode ranks with fewer heads: {plan.describe()}")
    item = plan.dst.page_bytes(c)  # == page_size * width(c): the decode rank's whole row
    return packed_run_descriptors([item], [pack_base], [dst_base], dst_page_runs(dst_pages))


def packed_run_descriptors(item_bytes, pack_bases, dst_bases, runs) -> Descriptors:
    """:func:`packed_descriptors` of several entries at once, entry after entry: entry ``e``'s
    slab at ``pack_bases[e]`` holds the pages of ``runs`` (:func:`dst_page_runs`) in order, each
    ``item_bytes[e]`` long, for its decode entry at ``dst_bases[e]``. One broadcast instead of a
    pass per entry: the send path builds a chunk's descriptors for every decode rank with it."""
    pos, d0, n = runs
    item = np.asarray(item_bytes, dtype=np.int64)[:, None]
    src = np.asarray(pack_bases, dtype=np.int64)[:, None] + pos[None, :] * item
    dst = np.asarray(dst_bases, dtype=np.int64)[:, None] + d0[None, :] * item
    return Descriptors(src.reshape(-1), dst.reshape(-1), (n[None, :] * item).reshape(-1))


def per_token_descriptors(
    plan: DraftKVPairPlan, c: KVComponent, src_base: int, dst_base: int, src_pages, dst_pages
) -> Descriptors:
    """One descriptor per token row: the head slice straight from pool to pool, any regime."""
    require_writer(plan)
    s, d = _pages(src_pages), _pages(dst_pages)
    if s.size != d.size:
        raise ValueError(f"page lists differ in length: {s.size} source, {d.size} destination")
    S = plan.src.page_size
    t = np.arange(S, dtype=np.int64)
    src = src_base + s[:, None] * plan.src.page_bytes(c) + t * plan.src.row_bytes(c)
    dst = dst_base + d[:, None] * plan.dst.page_bytes(c) + t * plan.dst.row_bytes(c)
    src = (src + plan.src_offset(c)).reshape(-1)
    dst = (dst + plan.dst_offset(c)).reshape(-1)
    return Descriptors(src, dst, np.full(src.size, plan.width(c), dtype=np.int64))


def pages_per_send(
    plan: DraftKVPairPlan,
    components: Sequence[KVComponent],
    num_pages: int,
    *,
    max_batch_pages: int = 0,
    pack_slot_bytes: Optional[int] = None,
) -> int:
    """Pages one send covers: all of them, bounded by sglang's ``max_transfer_batch_indices``
    and, when packing, by what one pack slot holds for every entry."""
    step = num_pages
    if max_batch_pages > 0:
        step = min(step, max_batch_pages)
    if plan.regime is Regime.PACK_SOURCE and pack_slot_bytes:
        step = min(step, pack_slot_bytes // sum(plan.bytes_per_page(c) for c in components))
    return max(step, 1)


def entry_descriptors(
    plan: DraftKVPairPlan, c: KVComponent, src_base: int, dst_base: int, src_pages, dst_pages
) -> Descriptors:
    """One entry's descriptors in the pair's regime. For :attr:`Regime.PACK_SOURCE` ``src_base``
    is the entry's packed slab, which holds ``src_pages`` in order."""
    if plan.regime is Regime.WHOLE_PAGES:
        return whole_page_descriptors(plan, c, src_base, dst_base, src_pages, dst_pages)
    if plan.regime is Regime.PACK_SOURCE:
        return packed_descriptors(plan, c, src_base, dst_base, dst_pages)
    return per_token_descriptors(plan, c, src_base, dst_base, src_pages, dst_pages)
