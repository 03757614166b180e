"""Sending one decode rank its DFLASH draft KV entries head-aware, by the registration's verdict.

sglang's Mooncake ``send_kvcache`` copies whole pages of every entry with the prefill's item
length, and ``send_kvcache_slice`` slices every entry with the target's head count; for a decode
that holds another number of draft heads per rank the draft entries must follow the pair plan
(``draft_kv_plan``) instead, each side addressed with its own item length, while the target
entries keep sglang's own copy. This module holds what that needs and nothing of how it is
wired: the per-peer table computed once from the verdict (:class:`DraftSend`), the entry lists
without the draft band (:func:`target_entries`, :func:`decode_target_entries`), the send of the
draft entries straight from the pool (:func:`send_from_pool`: one descriptor per destination
page run when a rank's rows match, per token row otherwise) and the transfer engine calls.
``_get_dsa_cache_transfer_skip_flags`` asks :func:`sends_draft_despite_skip`: with a hybrid-MLA
target sglang lets one prefill rank of each group send the replicated target KV, but the draft
heads are sharded, so a DRAFT_ONLY rank must still send its own.

The plugin's send hook (``mooncake_draft_kv``) calls the same functions; nothing here registers
a hook, and sglang's manager and registration record are arguments.

``SGLANG_DFLASH_DRAFT_KV_MAX_BATCH_DESCRIPTORS`` (default 1024): most descriptors per
``batch_transfer_sync`` call for the draft entries; Mooncake's TCP transport refuses batches of
a few thousand, and per-token sends are split.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import check_page_ids
from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import DraftKVPeerPlan, PeerAction
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import (
    Descriptors,
    Regime,
    entry_descriptors,
    pages_per_send,
    per_token_descriptors,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_registration import PLAN_ATTR

logger = logging.getLogger(__name__)

MAX_BATCH_DESCRIPTORS_ENV = "SGLANG_DFLASH_DRAFT_KV_MAX_BATCH_DESCRIPTORS"
SEND_ATTR = "_dflash_draft_kv_send"  # on the decode's KVArgsRegisterInfo: its DraftSend


def env_int(name: str, default: Optional[int], minimum: int) -> Optional[int]:
    """An integer environment switch of the draft-KV send path (``default`` when unset)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}")
    return value


def max_batch_descriptors() -> int:
    return env_int(MAX_BATCH_DESCRIPTORS_ENV, 1024, 1)


@dataclass(frozen=True)
class DraftSend:
    """What sending one decode registration its draft entries needs, computed once per
    registration (the send runs once per decode rank per chunk on the transfer thread)."""

    plan: DraftKVPeerPlan
    dst_kv_ptrs: list  # the registration's pointers the verdict was made for
    regime: Optional[Regime]
    max_batch: int  # SGLANG_DFLASH_DRAFT_KV_MAX_BATCH_DESCRIPTORS
    src_bases: np.ndarray  # per draft entry of the plan
    dst_bases: np.ndarray
    dst_item: np.ndarray  # decode bytes per page, per entry
    src_pages: np.ndarray  # pages of each source entry (page ids must stay below)
    page_bound: Optional[int]  # source page ids stay below this (the smallest entry pool)

    @classmethod
    def fields_of(cls, kv_args, plan: DraftKVPeerPlan, dst_kv_ptrs) -> dict:
        entries = plan.entries
        item = [kv_args.kv_item_lens[e.src_index] for e in entries]
        pages = [kv_args.kv_data_lens[e.src_index] // n for e, n in zip(entries, item)]
        return dict(
            plan=plan,
            dst_kv_ptrs=list(dst_kv_ptrs),
            regime=None if plan.pair is None else plan.pair.regime,
            max_batch=max_batch_descriptors(),
            src_bases=np.asarray([kv_args.kv_data_ptrs[e.src_index] for e in entries], np.int64),
            dst_bases=np.asarray([dst_kv_ptrs[e.dst_index] for e in entries], np.int64),
            dst_item=np.asarray(
                [plan.pair.dst.page_bytes(e.component) for e in entries]
                if plan.pair is not None
                else [],
                np.int64,
            ),
            src_pages=np.asarray(pages, np.int64),
            page_bound=min(pages, default=None),
        )

    @classmethod
    def of(cls, kv_args, plan: DraftKVPeerPlan, dst_kv_ptrs) -> "DraftSend":
        return cls(**cls.fields_of(kv_args, plan, dst_kv_ptrs))

    def check_pages(self, src_pages: np.ndarray) -> None:
        if self.page_bound is not None:
            check_page_ids(src_pages, self.page_bound)

    def matches(self, dst_kv_ptrs) -> bool:
        """The decode still has the buffers the verdict was made for."""
        return self.dst_kv_ptrs is dst_kv_ptrs or self.dst_kv_ptrs == list(dst_kv_ptrs)


def draft_send_of(manager, session: str) -> Optional[DraftSend]:
    """The head-aware send of decode ``session``, or None where sglang's own copy is exact (a
    STOCK verdict, or no DFLASH draft). Built at the first send after the registration's
    verdict and kept with the record, so a re-registration replaces it."""
    registration = (getattr(manager, "decode_kv_args_table", None) or {}).get(session)
    plan = getattr(registration, PLAN_ATTR, None)
    if plan is None or plan.action is PeerAction.STOCK:
        return None
    send = getattr(registration, SEND_ATTR, None)
    if send is None:
        send = DraftSend.of(manager.kv_args, plan, registration.dst_kv_ptrs)
        setattr(registration, SEND_ATTR, send)
    return send


class KVEntries(NamedTuple):
    """The entries one of sglang's copies sends: pointers, item lengths, layer ids."""

    ptrs: list
    item_lens: list
    layer_ids: list


def target_entries(kv_args, send: Optional[DraftSend]) -> KVEntries:
    """The entries sglang's own copy sends: every entry, or, for a head-aware peer, the entries
    before the draft band."""
    ptrs, lens, ids = kv_args.kv_data_ptrs, kv_args.kv_item_lens, kv_args.kv_layer_ids
    if send is None:
        return KVEntries(ptrs, lens, ids)
    n = len(ptrs) - kv_args.num_draft_entries
    return KVEntries(list(ptrs[:n]), list(lens[:n]), list(ids[:n]) if ids else ids)


def decode_target_entries(send: DraftSend, dst_kv_ptrs, dst_layer_ids):
    """``(pointers, layer ids)`` of the decode's entries before its draft band, the ones
    sglang's head-sliced copy (``send_kvcache_slice``, sliced with the *target's* head count)
    may see; None, logged, when the plan's draft entries are not the decode's last entries."""
    entries = send.plan.entries
    n = len(dst_kv_ptrs) - len(entries)
    if sorted(e.dst_index for e in entries) != list(range(n, len(dst_kv_ptrs))):
        logger.error("DFlash draft KV: a decode's draft entries are not its last entries")
        return None
    ids = list(dst_layer_ids[:n]) if dst_layer_ids else dst_layer_ids
    return list(dst_kv_ptrs[:n]), ids


def sends_draft_despite_skip(info) -> bool:
    """sglang skips this rank's replicated target KV for ``info``, but this rank holds draft
    heads no lower rank of its group holds (verdict DRAFT_ONLY): it must send them."""
    plan = getattr(info, PLAN_ATTR, None)
    return plan is not None and plan.action is PeerAction.DRAFT_ONLY


def draft_dst_pages(dst_kv_indices, dst_device_kv_indices):
    """sglang's HiSparse rule: the appended draft entries live in device pages on the decode."""
    return dst_kv_indices if dst_device_kv_indices is None else dst_device_kv_indices


def send_draft_entries(
    manager, send: DraftSend, session: str, dst_kv_ptrs, src_pages, dst_pages, room=None
) -> int:
    """Send this rank's draft entries to one decode rank (none for TARGET_ONLY): 0, or the
    transfer engine's failure code, never an exception (one would end the transfer worker
    thread, and the prefill with it). A failure of this rank's own work (a page id out of
    range, a decode that re-registered other buffers since the verdict) is no sign that the
    decode is dead: it fails ``room`` (:func:`fail_room`), and the session stays healthy."""
    if not send.plan.action.sends_draft:
        return 0
    try:
        if not send.matches(dst_kv_ptrs):
            raise ValueError("the decode re-registered with other KV buffers during a transfer")
        src_pages = np.asarray(src_pages, dtype=np.int64).reshape(-1)
        dst_pages = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
        if src_pages.size != dst_pages.size:
            raise ValueError(f"{src_pages.size} prefill pages for {dst_pages.size} decode pages")
        return send_from_pool(manager, send, session, src_pages, dst_pages)
    except Exception as e:
        logger.exception("DFlash draft KV send to decode %s failed on this prefill", session)
        return fail_room(manager, room, session, e)


def room_failed(manager, room) -> bool:
    """Whether ``room`` has failed already (a local failure of its draft send, or any other):
    the rest of its sends to this decode rank are skipped."""
    if room is None:
        return False
    from sglang.srt.disaggregation.base.conn import KVPoll

    return manager.request_status.get(room) == KVPoll.Failed


def fail_room(manager, room, session: str, error) -> int:
    """A local failure of the draft send of ``room`` to ``session``: the room fails with the
    reason (``conclude_failure``: Failed is terminal, and the decode is told) and 0 is returned,
    so sglang's transfer worker does not count it against the session; without a room, -1."""
    if room is None:
        return -1
    manager.conclude_failure(
        bootstrap_room=room,
        failure_reason=(
            f"DFlash draft KV send of room {room} to decode {session} failed on prefill rank "
            f"{getattr(manager, 'attn_tp_rank', '?')} (pp rank {getattr(manager, 'pp_rank', '?')}): "
            f"{error}"
        ),
    )
    return 0


def send_from_pool(manager, send: DraftSend, session: str, src_pages, dst_pages) -> int:
    """The draft entries straight from the pool, in sglang's bounded index batches: whole
    destination page runs where a token row of both sides is the same heads, one descriptor per
    token row otherwise."""
    build = per_token_descriptors if send.regime is Regime.PACK_SOURCE else entry_descriptors
    return send_in_windows(
        manager, send, src_pages, dst_pages,
        lambda s, d: transfer(manager, session, pool_descriptors(send, s, d, build), send.max_batch),
    )  # fmt: skip


def send_in_windows(manager, send: DraftSend, src_pages, dst_pages, send_window,
                    pack_slot_bytes: Optional[int] = None) -> int:  # fmt: skip
    """``send_window(src, dst)`` over the pages in windows of sglang's bounded index batches
    (and, packing, of what one pack slot holds for every entry); the first failure ends it."""
    send.check_pages(src_pages)
    step = pages_per_send(
        send.plan.pair,
        [e.component for e in send.plan.entries],
        src_pages.size,
        max_batch_pages=manager.max_transfer_batch_indices,
        pack_slot_bytes=pack_slot_bytes,
    )
    for start in range(0, src_pages.size, step):
        ret = send_window(src_pages[start : start + step], dst_pages[start : start + step])
        if ret != 0:
            return ret
    return 0


def pool_descriptors(send: DraftSend, src_pages, dst_pages, build) -> Descriptors:
    """Descriptors straight from the pool's entries (``build`` is a ``draft_kv_plan`` builder)."""
    return Descriptors.concat(
        [
            build(send.plan.pair, e.component, int(sb), int(db), src_pages, dst_pages)
            for e, sb, db in zip(send.plan.entries, send.src_bases, send.dst_bases)
        ]
    )


def transfer(manager, session: str, descriptors: Descriptors, max_batch: int) -> int:
    """The transfer engine's calls; what it returns (or raises) is the transport's verdict."""
    for batch in descriptors.batches(max_batch):
        try:
            ret = manager._transfer_data(session, batch.as_blocks())
        except Exception:
            logger.exception("Mooncake transfer of DFlash draft KV to %s raised", session)
            ret = -1
        if ret != 0:
            return ret
    return 0
