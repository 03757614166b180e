"""The patch to ``sglang/srt/disaggregation/mooncake/conn.py`` for DFlash draft KV (sglang 0.5.23).

A hybrid-MLA target (Kimi-K3) always sends its KV, with the draft KV appended, through
``MooncakeKVManager.send_kvcache``, which addresses source and destination pages with the
prefill's item length. When prefill and decode hold different numbers of draft heads per rank
(prefill TP4 = 2 of 8 heads per rank, decode TP32 = 1) this writes the wrong bytes to the wrong
decode pages, and no check rejects the layout; a plain-MHA target at another attention TP goes
through ``send_kvcache_slice``, which slices the draft with the target's head count. These hooks
fix it:

* AROUND ``MooncakeKVManager._validate_peer_state_layout``, which ``_publish_peer_registration``
  calls once per decode registration. After the stock checks pass, it decides the peer's draft
  KV verdict (``draft_kv_peer``) and what sending it needs (:class:`DraftSend`, computed once).
  A refusal is returned as the stock layout mismatch, so sglang caches it in
  ``state_layout_rejections`` and fails every request to that decode with the message before a
  byte is written, until the decode registers again. A failure of the check itself (a bug here,
  not the decode's layout) is never cached as a refusal: the verdict is left pending and decided
  again at the peer's next send, failing only that request if it fails again.
* AROUND ``MooncakeKVManager.update_status``: when a room's decode ranks have all bootstrapped
  (``WaitingForInput``) and one of them is refused, the room fails there, at bootstrap. Under PP
  only the last stage holds the draft and can refuse; the bootstrap poll is reduced over the
  stages, so no stage prefills a request the last stage would fail.
* AROUND ``MooncakeKVManager.send_kvcache``, the transfer worker's path for MLA and hybrid-MLA
  targets and for equal attention TP. For a stock verdict the original runs untouched. Otherwise
  the original runs on a view of the manager whose KV args end before the draft entries, so the
  target MLA entries take sglang's own path (its bounded index-batch branch and HiSparse device
  destinations included), and then this rank's draft entries follow the plan: none for a replica
  that lost the writer election, packed page runs or per-token descriptors otherwise. Draft
  pages go to the decode's device page ids when it sends them (HiSparse: the draft suffix is
  device-resident). KDA / Mamba state is sent by ``maybe_send_extra`` and is not touched.
* AROUND ``MooncakeKVManager.send_kvcache_slice``, the transfer worker's path for a plain-MHA
  target (Llama, Qwen3, ...) whose attention TP differs from the decode's. sglang slices every
  entry with the target's head count, wrong for a draft with other heads (and it refuses entries
  of unequal item lengths outright). The target entries keep sglang's slicing (the original on
  the target-entries view); the draft entries follow the plan as above.
* AROUND ``MooncakeKVManager._get_dsa_cache_transfer_skip_flags``: with a hybrid-MLA target and
  a decode of smaller attention TP, sglang lets only the first prefill rank of each group send
  KV, since the target KV is replicated. The draft heads are sharded, not replicated, so a rank
  elected to write heads no lower rank holds is let through (verdict DRAFT_ONLY) and sends
  only its draft entries; the target stays with the first rank.
* AROUND ``MooncakeKVManager.transfer_worker``: the worker runs on a view of its queue whose
  ``get`` records the chunk it hands out (on the worker thread), with the chunk's KV-write event
  (``kv_write_fence``), and ends the previous chunk's packs. sglang sends a chunk to each of its
  decode ranks in turn through ``send_kvcache``, which is not told the chunk; knowing it, the
  first send packs every distinct head slice the chunk's decode ranks need and the others send
  from the same slab (``draft_kv_chunk_packs``). The chunks, their order and every call sglang
  makes stay as they are.

**A local failure fails one request, never the decode.** sglang takes a non-zero return of a
send for a dead decode: it blacklists the session and fails every request to that decode until
its probe succeeds. So only what the transfer engine returns is returned; an exception of this
rank's own work (a pack, a bad page id, a descriptor) concludes the chunk's room as failed, with
the reason (the decode is told), and returns 0, and the room's remaining sends are skipped. A
transfer that failed from a pack slot quarantines the slot (``draft_kv_pack.QUARANTINE_S``).

Inert unless this prefill rank registered DFLASH draft entries (``prefill_draft_kv``).

Environment (read at startup on a DFLASH Mooncake prefill):

* ``SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB``: see ``draft_kv_staging`` (the pack staging is
  sized from the chunk by default).
* ``SGLANG_DFLASH_DRAFT_KV_MAX_BATCH_DESCRIPTORS`` (default 1024): most descriptors per
  ``batch_transfer_sync`` call for the draft entries. Mooncake's TCP transport refuses batches
  of a few thousand; packed sends stay far below it, per-token sends are split.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import ChunkPacks, HeadSlice
from sglang_dflash_pp.srt.disaggregation.draft_kv_digest import DigestEntries
from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVLayoutError
from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import DraftKVPeerPlan, PeerAction
from sglang_dflash_pp.srt.disaggregation.draft_kv_packed_send import (
    chunk_packs_for,
    head_slice_of,
    send_packed,
    skips_session,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import Regime
from sglang_dflash_pp.srt.disaggregation.draft_kv_registration import (
    PLAN_ATTR as _PLAN_ATTR,
    draft_kv_verdict as registration_verdict,
    refusal as _refusal,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_source import draft_kv_source_for
from sglang_dflash_pp.srt.disaggregation.draft_kv_staging import (
    PACK_BUFFER_MB_ENV,
    pack_buffer_mb_override,
)
from sglang_dflash_pp.srt.disaggregation import draft_kv_send, kv_digest_send, transfer_chunk
from sglang_dflash_pp.srt.disaggregation.mha_layer_ids import fill_decode_layer_ids

logger = logging.getLogger(__name__)

MAX_BATCH_DESCRIPTORS_ENV = draft_kv_send.MAX_BATCH_DESCRIPTORS_ENV
_SEND_ATTR = draft_kv_send.SEND_ATTR  # ... and what sending it needs (DraftSend)
_PENDING_ATTR = "_dflash_draft_kv_pending"  # ... or why the verdict could not be decided yet
_packs = threading.local()  # per transfer worker thread: the packs of its chunk (transfer_chunk)


max_batch_descriptors = draft_kv_send.max_batch_descriptors


def check_environment() -> None:
    pack_buffer_mb_override()
    max_batch_descriptors()


# -- registration ---------------------------------------------------------------------------


def draft_kv_verdict(self, registration) -> Optional[DraftKVPeerPlan]:
    """This prefill rank's verdict on a decode registration; None where we do not apply."""
    source = draft_kv_source_for(self.kv_args)
    plan = registration_verdict(self, registration, source)
    if plan is not None and plan.action.sends_draft and plan.pair.regime is Regime.PACK_SOURCE:
        staging = source.staging
        need = sum(plan.pair.bytes_per_page(e.component) for e in plan.entries)
        if staging is not None and staging.buffer.slot_bytes < need:
            raise DraftKVLayoutError(
                f"a draft KV pack slot holds {staging.buffer.slot_bytes} B, less than one page "
                f"of this decode's draft heads ({need} B); raise or unset {PACK_BUFFER_MB_ENV}."
            )
    return plan


@dataclass(frozen=True)
class DraftSend(draft_kv_send.DraftSend):
    """What sending one decode registration its draft entries needs, computed at registration
    (the send path runs once per decode rank per chunk on the transfer thread, beside the
    scheduler: nothing here is rebuilt there), with the plugin's pack and digest parts."""

    staging: object = None  # the rank's pack staging (draft_kv_staging), where it packs
    head_slice: Optional[HeadSlice] = None  # what this rank packs for the peer (packed regime)
    digest: Optional[DigestEntries] = None  # the KV digest's view of the entries (kv_digest_send)

    @classmethod
    def of(cls, manager, plan: DraftKVPeerPlan, dst_kv_ptrs) -> "DraftSend":
        kv_args = manager.kv_args
        piece = head_slice_of(kv_args, plan)
        source = draft_kv_source_for(kv_args)
        return cls(
            **cls.fields_of(kv_args, plan, dst_kv_ptrs),
            staging=None if source is None else source.staging,
            head_slice=piece,
            digest=kv_digest_send.draft_digest_entries_of(kv_args, plan),
        )


def _attach(registration, plan: Optional[DraftKVPeerPlan], send: Optional[DraftSend]) -> None:
    setattr(registration, _PLAN_ATTR, plan)
    setattr(registration, _SEND_ATTR, send)
    setattr(registration, _PENDING_ATTR, None)


def _fill_decode_layer_ids(self, registration) -> None:
    """A stock plain-MHA decode publishes no layer ids; when this prefill stage pairs by id
    (``mha_layer_ids``), give the record the ids of the layout the decode registered."""
    reason = fill_decode_layer_ids(self.kv_args, registration)
    if reason is not None:
        raise DraftKVLayoutError(reason)


def _decide(self, registration) -> Optional[DraftKVPeerPlan]:
    """Verdict and send table for ``registration``, attached to it; raises to refuse."""
    _fill_decode_layer_ids(self, registration)
    plan = draft_kv_verdict(self, registration)
    send = None
    if plan is not None and plan.action is not PeerAction.STOCK:
        send = DraftSend.of(self, plan, registration.dst_kv_ptrs)
    _attach(registration, plan, send)
    return plan


def validate_peer_state_layout_around(original, self, registration_info, *args, **kwargs):
    fully_checked, mismatch = original(self, registration_info, *args, **kwargs)
    if mismatch is not None:
        return fully_checked, mismatch
    refusal = kv_digest_send.peer_refusal(self, registration_info)
    if refusal is not None:
        return False, refusal
    try:
        plan = _decide(self, registration_info)
    except DraftKVLayoutError as e:
        return False, _refusal(self, registration_info, e)
    except Exception as e:  # our check failed, not the decode's layout: decide at its next send
        logger.exception(
            "DFlash draft KV check of decode %s failed; deciding again at its next request",
            registration_info.mooncake_session_id,
        )
        _attach(registration_info, None, None)
        setattr(registration_info, _PENDING_ATTR, repr(e))
        return False, None
    if plan is not None and plan.action is not PeerAction.STOCK:
        logger.info(
            "DFlash draft KV to decode %s: %s",
            registration_info.mooncake_session_id,
            plan.describe(),
        )
    return fully_checked, None


def update_status_around(original, self, bootstrap_room, status, *args, **kwargs):
    """A room whose decode is refused fails when its bootstrap completes (module docstring)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if status == KVPoll.WaitingForInput and getattr(self.kv_args, "num_draft_entries", 0):
        infos = (getattr(self, "transfer_infos", None) or {}).get(bootstrap_room) or {}
        rejections = getattr(self, "state_layout_rejections", None) or {}
        refused = [rejections[s] for s in infos if s in rejections]
        if refused and draft_kv_source_for(self.kv_args) is not None:
            return self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=refused[0])
    return original(self, bootstrap_room, status, *args, **kwargs)


# -- the worker's current chunk ---------------------------------------------------------------


def begin_chunk(manager, chunk) -> None:
    """This thread now sends ``chunk`` (a ``TransferKVChunk``, or None) for ``manager``."""
    end_chunk()
    transfer_chunk.begin(manager, chunk)
    kv_digest_send.begin_chunk(manager, chunk)


def end_chunk() -> None:
    """Give back the pack slot of this thread's previous chunk, whatever its sends did."""
    packs = getattr(_packs, "value", None)
    _packs.value = None
    manager = transfer_chunk.chunk_manager()
    if manager is not None:
        kv_digest_send.end_chunk(manager)
    transfer_chunk.end()
    if packs is not None:
        packs.release()


def _current_room(self) -> Optional[int]:
    return transfer_chunk.room_of(self)


class _ChunkQueue:
    """sglang's transfer queue as its worker sees it: ``get`` marks the chunk it hands out."""

    def __init__(self, manager, queue):
        self._manager, self._queue = manager, queue

    def get(self, *args, **kwargs):
        end_chunk()
        chunk = self._queue.get(*args, **kwargs)
        begin_chunk(self._manager, chunk)
        return chunk

    def __getattr__(self, name):
        return getattr(self._queue, name)


def transfer_worker_around(original, self, queue, *args, **kwargs):
    try:
        return original(self, _ChunkQueue(self, queue), *args, **kwargs)
    finally:
        end_chunk()


def _draft_send_of(self, session: str) -> Optional[DraftSend]:
    registration = self.decode_kv_args_table.get(session)
    return getattr(registration, _SEND_ATTR, None)


def _packed_slice_of(self, session: str) -> Optional[HeadSlice]:
    """The head slice this rank packs for decode ``session``, or None (it packs nothing for it)."""
    if skips_session(self, session):
        return None  # sglang's loop stops at such a session
    send = _draft_send_of(self, session)
    return None if send is None else send.head_slice


def _chunk_packs(self, staging) -> Optional[ChunkPacks]:
    """The packs of the chunk this worker thread is sending, or None outside a worker chunk."""
    chunk = transfer_chunk.chunk_of(self)
    if chunk is None:
        return None
    packs = getattr(_packs, "value", None)
    if packs is None:
        packs = _packs.value = chunk_packs_for(
            self, staging, chunk.room, lambda session: _packed_slice_of(self, session),
            transfer_chunk.written(),
        )  # fmt: skip
    return packs


# -- sending --------------------------------------------------------------------------------


class _KVArgsWithoutDraft:
    """``kv_args`` whose entry lists end before the draft entries; everything else delegates."""

    _PER_ENTRY = ("kv_data_ptrs", "kv_data_lens", "kv_item_lens", "kv_layer_ids")

    def __init__(self, kv_args):
        n = len(kv_args.kv_data_ptrs) - kv_args.num_draft_entries
        object.__setattr__(self, "_kv_args", kv_args)
        for name in self._PER_ENTRY:
            value = getattr(kv_args, name, None)
            object.__setattr__(self, name, list(value[:n]) if value else value)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_kv_args"), name)


class _TargetEntriesOnly:
    """The manager as sglang's send path sees it, minus the draft entries (one per call)."""

    def __init__(self, manager):
        object.__setattr__(self, "_manager", manager)
        object.__setattr__(self, "kv_args", _KVArgsWithoutDraft(manager.kv_args))

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_manager"), name)


class _LocalFailure(Exception):
    """This rank's own work for one request failed (not the transport, not the decode)."""


def _send_plan(self, session: str, registration, dst_kv_ptrs) -> Tuple[Optional[DraftSend], int]:
    """(send, failure code) for one send: no send table where sglang's own path is exact; a
    failure if the decode re-registered other buffers since the verdict. Raises
    :class:`_LocalFailure` when a pending verdict cannot be decided."""
    if getattr(registration, _PENDING_ATTR, None) is not None:
        _decide_pending(self, session, registration)
    send = getattr(registration, _SEND_ATTR, None)
    if send is None:
        return None, 0
    if not (send.dst_kv_ptrs is dst_kv_ptrs or send.dst_kv_ptrs == list(dst_kv_ptrs)):
        logger.error(
            "Decode %s re-registered with other KV buffers during a transfer; failing it.", session
        )
        return None, -1
    return send, 0


def _decide_pending(self, session: str, registration) -> None:
    try:
        plan = _decide(self, registration)
    except DraftKVLayoutError as e:
        reason = _refusal(self, registration, e)
        with self.session_lock:
            self.state_layout_rejections[session] = reason
        raise _LocalFailure(reason) from None
    except Exception as e:
        raise _LocalFailure(f"the DFlash draft KV check of this decode failed again: {e!r}") from e
    logger.info("DFlash draft KV to decode %s (decided late): %s", session,
                "stock" if plan is None else plan.describe())  # fmt: skip


def _room_failed(self) -> bool:
    """This worker's chunk belongs to a room already failed (by an earlier local failure)."""
    room = _current_room(self)
    if room is None:
        return False
    from sglang.srt.disaggregation.base.conn import KVPoll

    return self.request_status.get(room, KVPoll.Failed) == KVPoll.Failed


def _fail_room(self, session: str, error: BaseException) -> int:
    """Conclude the chunk's room as failed for a local error and keep the session healthy
    (``draft_kv_send.fail_room``); outside a worker chunk (no room to fail) report a failure
    code."""
    logger.error("DFlash draft KV send to decode %s failed on this prefill: %r", session, error,
                 exc_info=not isinstance(error, _LocalFailure))  # fmt: skip
    return draft_kv_send.fail_room(self, _current_room(self), session, error)


def _managed_send(self, session, dst_kv_ptrs, send_all) -> int:
    """Run ``send_all(send)`` for a peer this plugin manages, with the failure rules of the
    module docstring; ``send_all(None)`` is sglang's own path, untouched."""
    registration = (getattr(self, "decode_kv_args_table", None) or {}).get(session)
    managed = getattr(registration, _SEND_ATTR, None) is not None or (
        getattr(registration, _PENDING_ATTR, None) is not None
    )
    if managed and _room_failed(self):
        return 0  # a local failure already failed this room: nothing more to send for it
    try:
        send, failed = _send_plan(self, session, registration, dst_kv_ptrs)
    except _LocalFailure as e:
        return _fail_room(self, session, e)
    if failed or send is None:
        return failed or send_all(None)
    return send_all(send)


def send_kvcache_around(
    original,
    self,
    mooncake_session_id,
    prefill_kv_indices,
    dst_kv_ptrs,
    dst_kv_indices,
    executor,
    dst_layer_ids=None,
    dst_device_kv_indices=None,
    dst_kv_item_len=None,
    dst_attn_tp_size=None,
):
    def stock(manager):
        with kv_digest_send.scope(self, mooncake_session_id, executor) as scoped:
            return original(
                manager,
                mooncake_session_id,
                prefill_kv_indices,
                dst_kv_ptrs,
                dst_kv_indices,
                scoped,
                dst_layer_ids=dst_layer_ids,
                dst_device_kv_indices=dst_device_kv_indices,
                dst_kv_item_len=dst_kv_item_len,
                dst_attn_tp_size=dst_attn_tp_size,
            )

    def send_all(send: Optional[DraftSend]) -> int:
        if send is None:
            return stock(self)
        if send.plan.action is not PeerAction.DRAFT_ONLY:
            ret = stock(_TargetEntriesOnly(self))
            if ret != 0 or send.plan.action is PeerAction.TARGET_ONLY:
                return ret
        dst_pages = draft_kv_send.draft_dst_pages(dst_kv_indices, dst_device_kv_indices)
        return send_draft_entries(self, send, mooncake_session_id, prefill_kv_indices, dst_pages)

    return _managed_send(self, mooncake_session_id, dst_kv_ptrs, send_all)


def send_kvcache_slice_around(
    original,
    self,
    mooncake_session_id,
    prefill_kv_indices,
    dst_kv_ptrs,
    dst_kv_indices,
    dst_tp_rank,
    dst_attn_tp_size,
    dst_kv_item_len,
    executor,
    dst_layer_ids=None,
):
    def stock(manager, dst_ptrs, dst_ids):
        with kv_digest_send.scope(self, mooncake_session_id, executor) as scoped:
            return original(
                manager,
                mooncake_session_id,
                prefill_kv_indices,
                dst_ptrs,
                dst_kv_indices,
                dst_tp_rank,
                dst_attn_tp_size,
                dst_kv_item_len,
                scoped,
                dst_ids,
            )

    def send_all(send: Optional[DraftSend]) -> int:
        if send is None:
            return stock(self, dst_kv_ptrs, dst_layer_ids)
        # sglang slices the target heads, seeing the target entries of both sides only: its
        # K/V split (no layer ids) and its id pairing are then both exact.
        target = draft_kv_send.decode_target_entries(send, dst_kv_ptrs, dst_layer_ids)
        if target is None:
            return -1
        ret = stock(_TargetEntriesOnly(self), *target)
        if ret != 0 or send.plan.action is PeerAction.TARGET_ONLY:
            return ret
        return send_draft_entries(
            self, send, mooncake_session_id, prefill_kv_indices, dst_kv_indices
        )

    return _managed_send(self, mooncake_session_id, dst_kv_ptrs, send_all)


def send_draft_entries(self, send: DraftSend, session: str, src_pages, dst_pages) -> int:
    """Send this rank's draft entries to one decode rank: 0, or the transfer engine's failure.

    A local failure fails the chunk's room and returns 0 (module docstring); an exception
    would instead end sglang's transfer worker thread, so none escapes."""
    try:
        return _send_draft_entries(self, send, session, src_pages, dst_pages)
    except Exception as e:
        return _fail_room(self, session, e)


def _send_draft_entries(self, send: DraftSend, session, src_pages, dst_pages) -> int:
    src_pages = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    dst_pages = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if src_pages.size != dst_pages.size:
        raise _LocalFailure(f"{src_pages.size} prefill pages for {dst_pages.size} decode pages")
    # the pool rows the plan writes (entries shared by decode ranks holding the same heads)
    kv_digest_send.add_draft_blocks(self, session, send, src_pages, dst_pages, send.digest)
    staging = send.staging
    packing = send.regime is Regime.PACK_SOURCE and staging is not None
    if not packing:  # a packed regime without staging (none could be built) goes per token row
        return draft_kv_send.send_from_pool(self, send, session, src_pages, dst_pages)
    packs = _chunk_packs(self, staging)
    return send_packed(self, send, staging, send.head_slice, session, src_pages, dst_pages,
                       packs, transfer_chunk.written())  # fmt: skip


def transfer_skip_flags_around(original, self, info, *args, **kwargs):
    skip_kv, skip_state = original(self, info, *args, **kwargs)
    if skip_kv and draft_kv_send.sends_draft_despite_skip(info):
        return False, skip_state
    return skip_kv, skip_state


_MANAGER = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"

HOOKS = (
    PluginHook(
        f"{_MANAGER}._validate_peer_state_layout",
        validate_peer_state_layout_around,
        "around",
        "refuse decode peers whose draft KV layout cannot be served, before any byte is written",
    ),
    PluginHook(
        f"{_MANAGER}.update_status",
        update_status_around,
        "around",
        "fail a request at bootstrap when its decode's draft KV layout was refused",
    ),
    PluginHook(
        f"{_MANAGER}.send_kvcache",
        send_kvcache_around,
        "around",
        "send each decode rank exactly its own draft KV heads",
    ),
    PluginHook(
        f"{_MANAGER}.send_kvcache_slice",
        send_kvcache_slice_around,
        "around",
        "plain-MHA target at another attention TP: slice the draft heads by the draft's plan",
    ),
    PluginHook(
        f"{_MANAGER}.transfer_worker",
        transfer_worker_around,
        "around",
        "know the chunk being sent, so each distinct draft head slice is packed once per chunk",
    ),
    PluginHook(
        f"{_MANAGER}._get_dsa_cache_transfer_skip_flags",
        transfer_skip_flags_around,
        "around",
        "let a prefill rank whose replicated target KV is skipped still send its own draft heads",
    ),
)
