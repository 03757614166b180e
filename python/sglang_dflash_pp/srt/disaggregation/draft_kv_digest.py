"""The KV digest's view (``kv_digest``) of what one draft-KV pair writes: the blocks a prefill
rank digests for a decode rank, from the pair's plan (``draft_kv_plan``).

Its own module, not the plan's: the plan is the head-aware transfer (PRs 4-7 of the upstream
stack), the digest the checksum on top of it (PR 16). Stdlib and numpy only.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import KVComponent
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import (
    DraftKVPairPlan,
    page_runs,
    require_writer,
)
from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks


class DigestEntries(NamedTuple):
    """What the KV digest (``kv_digest``) needs of each draft entry one pair writes, computed once
    per decode registration: per entry, the source address of its head slice in page 0, the
    source and destination bytes per page and per token row, the slice's destination offset in
    a row, its width and the decode slot it lands in."""

    src: np.ndarray
    src_page: np.ndarray
    src_row: np.ndarray
    dst: np.ndarray
    dst_page: np.ndarray
    dst_row: np.ndarray
    width: np.ndarray
    slot: np.ndarray
    page_size: int


def digest_entries(plan: DraftKVPairPlan, components: Sequence[KVComponent], src_bases,
                   slots) -> DigestEntries:  # fmt: skip
    require_writer(plan)

    def per(f):
        return np.asarray([f(c) for c in components], dtype=np.int64)

    return DigestEntries(
        src=np.asarray(src_bases, dtype=np.int64) + per(plan.src_offset),
        src_page=per(plan.src.page_bytes),
        src_row=per(plan.src.row_bytes),
        dst=per(plan.dst_offset),
        dst_page=per(plan.dst.page_bytes),
        dst_row=per(plan.dst.row_bytes),
        width=per(plan.width),
        slot=np.asarray(slots, dtype=np.int64),
        page_size=plan.src.page_size,
    )


def digest_blocks_of(entries: DigestEntries, src_pages, dst_pages) -> Blocks:
    """The KV digest's blocks of what a pair writes of its entries, read from the pool whatever
    the regime (a packed slab is a copy; digesting the pool also catches a pack that read stale
    rows), at the decode offsets :func:`per_token_descriptors` writes them to. One strided
    block per entry and run of pages consecutive on both sides: pages are token-major, so the
    rows of a run are evenly spaced on both sides."""
    s0, d0, n = page_runs(src_pages, dst_pages)
    runs, e = s0.size, entries.src.size
    src = entries.src[:, None] + s0[None, :] * entries.src_page[:, None]
    dst = entries.dst[:, None] + d0[None, :] * entries.dst_page[:, None]
    rows = np.broadcast_to(n[None, :] * entries.page_size, (e, runs))
    return Blocks(
        src.reshape(-1),
        dst.reshape(-1),
        np.repeat(entries.width, runs),
        rows.reshape(-1),
        np.repeat(entries.src_row, runs),
        np.repeat(entries.dst_row, runs),
        np.repeat(entries.slot, runs),
    )


def digest_blocks(
    plan: DraftKVPairPlan, c: KVComponent, src_base: int, slot: int, src_pages, dst_pages
) -> Blocks:
    """:func:`digest_blocks_of` for one entry."""
    return digest_blocks_of(digest_entries(plan, [c], [src_base], [slot]), src_pages, dst_pages)
