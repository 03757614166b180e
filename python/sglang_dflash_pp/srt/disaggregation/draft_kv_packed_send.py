"""Sending a decode rank that holds a slice of this prefill rank's draft heads its bytes packed.

When the decode TP is larger than the prefill's (``Regime.PACK_SOURCE``) a decode rank's heads
are a strided slice of every source token row, so straight from the pool each token row is one
descriptor (``draft_kv_send.send_from_pool``). Here the slice is gathered into the rank's
registered pack staging (``draft_kv_staging``, built and registered at startup) and sent one
descriptor per destination page run. sglang's transfer worker sends one chunk to each of its
decode ranks in turn; the chunk's packs (``draft_kv_chunk_packs.ChunkPacks``) gather every
distinct head slice its decode ranks need once, and each send of the chunk builds descriptors
into the packed slab. A decode rank sent outside a chunk's packs, or whose slice does not fit
the chunk's slot, is packed alone in page windows, or, with every slot held, sent per token row
from the pool. The bytes a decode receives are those of the unpacked send.

Where a pack fails (a page id out of range, a kernel error) the functions here raise; the
caller fails the send. A transfer that failed from a pack slot quarantines the slot
(``draft_kv_pack.QUARANTINE_S``).

:class:`ChunkDraftPacks` is the chunk's packs as sglang's ``transfer_worker`` holds them: made
for each chunk it takes, handed to every ``send_kvcache`` / ``send_kvcache_slice`` of the chunk,
released when its loop over the chunk's decode ranks ends.

The plugin's worker hook (``mooncake_draft_kv``) keeps the same packs per worker thread instead.

Numpy and torch at import; no sglang import.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import numpy as np

from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import (
    ChunkPacks,
    HeadSlice,
    readers_by_slice,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import (
    Regime,
    dst_page_runs,
    pack_source_rows,
    packed_run_descriptors,
    pages_per_send,
    per_token_descriptors,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_registration import PLAN_ATTR
from sglang_dflash_pp.srt.disaggregation.draft_kv_send import (
    pool_descriptors,
    send_from_pool,
    send_in_windows,
    transfer,
)

logger = logging.getLogger(__name__)


def head_slice_of(kv_args, plan) -> Optional[HeadSlice]:
    """What this rank packs for a decode of verdict ``plan``: None unless it packs for it."""
    if plan is None or plan.pair is None or not plan.action.sends_draft:
        return None
    if plan.pair.regime is not Regime.PACK_SOURCE:
        return None
    n_target = len(kv_args.kv_data_ptrs) - kv_args.num_draft_entries
    entries = plan.entries
    return HeadSlice.of(
        plan.pair.src,
        plan.pair.heads,
        [e.component for e in entries],
        [e.src_index - n_target for e in entries],
    )


def page_pack_bytes(plan) -> int:
    """Bytes one page of this decode's draft heads takes in a pack slot."""
    return sum(plan.pair.bytes_per_page(e.component) for e in plan.entries)


def skips_session(manager, session: str) -> bool:
    """sglang's loop over a chunk's decode ranks stops at such a session: it reads no pack."""
    return session in getattr(manager, "failed_sessions", ()) or session in getattr(
        manager, "state_layout_rejections", {}
    )


def chunk_packs_for(
    manager, staging, room, slice_of: Callable[[str], Optional[HeadSlice]], written: Sequence = ()
) -> ChunkPacks:
    """The packs of one chunk of ``room``: its readers are the room's decode sessions, by the
    head slice each needs (``slice_of(session)``)."""
    infos = (getattr(manager, "transfer_infos", None) or {}).get(room) or {}
    readers = readers_by_slice(
        (session, slice_of(session))
        for session, info in infos.items()
        if not getattr(info, "is_dummy", False)
    )
    return ChunkPacks(
        staging.buffer, staging.prepared, readers, manager.kv_args.page_size, written
    )


def send_packed(
    manager,
    send,
    staging,
    head_slice: HeadSlice,
    session: str,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    packs: Optional[ChunkPacks] = None,
    written: Sequence = (),
) -> int:
    """Send one decode rank its draft heads packed: from the chunk's slab (``packs``) when it
    has one, else packed alone in page windows. 0 or the transfer engine's failure; raises
    where this rank's own work fails."""
    if packs is not None:
        try:
            slabs = packs.slab(head_slice, src_pages)  # checks the pages it packs
            if slabs is not None:
                return send_from_slabs(manager, send, packs, slabs, session, dst_pages)
        finally:
            packs.done(head_slice, session)
    return send_in_windows(
        manager, send, src_pages, dst_pages,
        lambda s, d: send_window(manager, send, staging, head_slice, session, s, d, written),
        pack_slot_bytes=staging.buffer.slot_bytes,
    )  # fmt: skip


def send_from_slabs(manager, send, packs: ChunkPacks, slabs, session, dst_pages) -> int:
    """Send this decode rank's pages from the chunk's packed slabs (entry order of the plan),
    in sglang's bounded index batches when it sets them."""
    step = dst_pages.size
    if manager.max_transfer_batch_indices > 0:
        step = pages_per_send(
            send.plan.pair,
            [e.component for e in send.plan.entries],
            dst_pages.size,
            max_batch_pages=manager.max_transfer_batch_indices,
        )
    bases = packs.slot.ptr + np.asarray(slabs, dtype=np.int64)
    for start in range(0, dst_pages.size, max(step, 1)):
        runs = packs.dst_runs(dst_pages[start : start + step])
        descriptors = packed_run_descriptors(
            send.dst_item, bases + start * send.dst_item, send.dst_bases, runs
        )
        ret = transfer(manager, session, descriptors, send.max_batch)
        if ret != 0:
            packs.failed()
            return ret
    return 0


def send_window(
    manager, send, staging, head_slice: HeadSlice, session, src_pages, dst_pages, written=()
) -> int:
    """One window of pages packed for this decode rank alone (no chunk slab), or, with every
    slot held or quarantined, sent per token row straight from the pool."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import pack_slices

    slot = staging.buffer.take()
    if slot is None:
        logger.warning("DFlash draft KV: no free pack slot; sending %s per token row", session)
        descriptors = pool_descriptors(send, src_pages, dst_pages, per_token_descriptors)
        return transfer(manager, session, descriptors, send.max_batch)
    ok = False
    try:
        (slabs,) = pack_slices(
            slot,
            0,
            (head_slice,),
            staging.prepared,
            pack_source_rows(send.plan.pair, src_pages),
            written,
        )
        runs = dst_page_runs(dst_pages)
        bases = slot.ptr + np.asarray(slabs, dtype=np.int64)
        descriptors = packed_run_descriptors(send.dst_item, bases, send.dst_bases, runs)
        ret = transfer(manager, session, descriptors, send.max_batch)
        ok = ret == 0
        return ret
    finally:
        staging.buffer.give_back(slot, quarantine=not ok)


class ChunkDraftPacks:
    """One transfer chunk's draft packs, as sglang's transfer worker holds them (module
    docstring): built at the chunk's first packed send, its slot given back after the last
    decode rank that reads it, or at :meth:`release` (the worker's loop over the chunk's decode
    ranks ended, maybe early). The chunk's KV is written: the worker synchronised its
    ``wait_event`` before any send."""

    def __init__(self, manager, chunk):
        self.manager = manager
        self.room = chunk.room
        self.packs: Optional[ChunkPacks] = None
        self.sent = 0  # sends that took the pack path (for tests and logs)

    def _staging(self):
        source = getattr(self.manager.kv_args, "draft_kv_source", None)
        return None if source is None else source.staging

    def slice_of(self, session: str) -> Optional[HeadSlice]:
        if skips_session(self.manager, session):
            return None
        registration = (getattr(self.manager, "decode_kv_args_table", None) or {}).get(session)
        return head_slice_of(self.manager.kv_args, getattr(registration, PLAN_ATTR, None))

    def send(self, manager, send, session: str, src_pages, dst_pages) -> int:
        """``send_draft_entries``' send for one decode rank: packed where this rank packs for
        it and a page of its heads fits a slot, else straight from the pool."""
        staging = self._staging()
        head_slice = head_slice_of(manager.kv_args, send.plan)
        if (
            staging is None
            or head_slice is None
            or staging.buffer.slot_bytes < page_pack_bytes(send.plan)
        ):
            return send_from_pool(manager, send, session, src_pages, dst_pages)
        if self.packs is None:
            self.packs = chunk_packs_for(manager, staging, self.room, self.slice_of)
        self.sent += 1
        return send_packed(
            manager, send, staging, head_slice, session, src_pages, dst_pages, self.packs
        )

    def release(self) -> None:
        if self.packs is not None:
            packs, self.packs = self.packs, None
            packs.release()
