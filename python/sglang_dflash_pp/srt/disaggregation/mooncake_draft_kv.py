"""The patch to ``sglang/srt/disaggregation/mooncake/conn.py`` for DFlash draft KV (sglang 0.5.23).

A hybrid-MLA target (Kimi-K3) always sends its KV, with the draft KV appended, through
``MooncakeKVManager.send_kvcache``, which addresses source and destination pages with the
prefill's item length. When prefill and decode hold different numbers of draft heads per rank
(prefill TP4 = 2 of 8 heads per rank, decode TP32 = 1) this writes the wrong bytes to the wrong
decode pages, and no check rejects the layout; a plain-MHA target at another attention TP goes
through ``send_kvcache_slice``, which slices the draft with the target's head count. Four hooks fix
it, and a fifth lets the packed head slices be shared:

* AROUND ``MooncakeKVManager._validate_peer_state_layout``, which ``_publish_peer_registration``
  calls once per decode registration. After the stock checks pass, it decides the peer's draft
  KV verdict (``draft_kv_peer``). A refusal is returned as the stock layout mismatch, so sglang
  caches it in ``state_layout_rejections`` and fails every request to that decode with the
  message before a byte is written, until the decode registers again. An accepted verdict is
  attached to the registration record, so a re-registration replaces both together.
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
  ``get`` records the chunk it hands out (on the worker thread) and ends the previous chunk's
  packs. sglang sends a chunk to each of its decode ranks in turn through ``send_kvcache``, which
  is not told the chunk; knowing it, the first send packs every distinct head slice the chunk's
  decode ranks need (``transfer_infos[room]`` and their verdicts) and the others send from the
  same slab (``draft_kv_chunk_packs``). The chunks, their order and every call sglang makes stay
  as they are.

Inert unless this prefill rank registered DFLASH draft entries (``prefill_draft_kv``).

Environment (read at startup on a DFLASH Mooncake prefill):

* ``SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB`` (default 256): staging memory on the draft pool's
  device for packing head slices, allocated and registered with Mooncake on the first decode
  that needs it, split into one slot per transfer queue (``SGLANG_DISAGGREGATION_QUEUE_SIZE``,
  default 4). A slot holds a chunk's packed slices from the first send to the last decode rank
  that reads them. The default's 64 MB slot holds both head slices of an 8192-token chunk
  (Kimi-K3's ``--chunked-prefill-size``) of a 6-layer, 8-head, 128-dim bf16 draft at TP4 ->
  TP32 (48 MiB); a chunk whose slices do not fit together is packed one slice at a time, and one
  whose single slice does not fit is packed per decode rank in windows of whole pages.
* ``SGLANG_DFLASH_DRAFT_KV_MAX_BATCH_DESCRIPTORS`` (default 1024): most descriptors per
  ``batch_transfer_sync`` call for the draft entries. Mooncake's TCP transport refuses batches
  of a few thousand; packed sends stay far below it, per-token sends are split.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import List, Optional, Tuple

import numpy as np

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import (
    ChunkPacks,
    HeadSlice,
    readers_by_slice,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVLayoutError
from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import (
    DecodePeer,
    DraftKVPeerPlan,
    PeerAction,
    PrefillSide,
    TargetPath,
    peer_verdict,
    target_path,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import (
    Descriptors,
    Regime,
    entry_descriptors,
    pack_source_rows,
    packed_descriptors,
    pages_per_send,
)
from sglang_dflash_pp.srt.disaggregation.mha_layer_ids import (
    decode_mha_layer_ids,
    published_num_layers,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_source import draft_kv_source_for

logger = logging.getLogger(__name__)

PACK_BUFFER_MB_ENV = "SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB"
MAX_BATCH_DESCRIPTORS_ENV = "SGLANG_DFLASH_DRAFT_KV_MAX_BATCH_DESCRIPTORS"
_PLAN_ATTR = "dflash_draft_kv_plan"  # on the decode's KVArgsRegisterInfo
_PACK_ATTR = "_dflash_draft_kv_pack_buffer"  # on the MooncakeKVManager
_pack_lock = threading.Lock()
_worker = threading.local()  # per transfer worker thread: manager, chunk, packs


def _env_int(name: str, default: int, minimum: int) -> int:
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


def pack_buffer_bytes() -> int:
    return _env_int(PACK_BUFFER_MB_ENV, 256, 1) << 20


def max_batch_descriptors() -> int:
    return _env_int(MAX_BATCH_DESCRIPTORS_ENV, 1024, 1)


def check_environment() -> None:
    pack_buffer_bytes()
    max_batch_descriptors()


# -- registration ---------------------------------------------------------------------------


def _stock_entry_pairs(self, registration) -> List[Tuple[int, int]]:
    """The (prefill entry, decode entry) pairs sglang's ``send_kvcache`` will use for this peer."""
    from sglang.srt.disaggregation.utils import build_transfer_entry_pairs

    kv_args = self.kv_args
    n_src, n_dst = len(kv_args.kv_data_ptrs), len(registration.dst_kv_ptrs)
    src_ids, dst_ids = kv_args.kv_layer_ids or [], registration.dst_kv_layer_ids or []
    if src_ids or dst_ids:
        return build_transfer_entry_pairs(
            src_ids, dst_ids, n_src, n_dst, allow_positional_fallback=self.pp_size == 1
        )
    if n_src == n_dst:
        return [(i, i) for i in range(n_src)]
    # get_mla_kv_ptrs_with_pp: this stage's target slice, then the draft band at the end.
    n_draft = kv_args.num_draft_entries
    start, _ = self._mla_kv_entry_span_with_pp(n_src - n_draft)
    return [(i, start + i) for i in range(n_src - n_draft)] + [
        (n_src - n_draft + q, n_dst - n_draft + q) for q in range(n_draft)
    ]


def draft_kv_verdict(self, registration) -> Optional[DraftKVPeerPlan]:
    """This prefill rank's verdict on a decode registration; None where we do not apply."""
    kv_args = self.kv_args
    source = draft_kv_source_for(kv_args)
    if source is None:
        return None  # no DFLASH draft entries on this rank
    if getattr(registration, "requires_dcp_relayout", False):
        return None  # send_kvcache_dcp slices the draft itself
    target_path = _target_path(self, registration)
    try:
        pairs = _stock_entry_pairs(self, registration)
    except (RuntimeError, ValueError) as e:
        raise DraftKVLayoutError(
            f"the prefill and decode KV entries cannot be paired ({e}). Both servers must run "
            "the same target and draft models and publish KV layer ids."
        ) from None
    prefill = PrefillSide(
        tp_size=self.attn_tp_size,
        tp_rank=self.attn_tp_rank,
        page_size=kv_args.page_size,
        item_lens=list(kv_args.kv_item_lens),
        num_draft_entries=kv_args.num_draft_entries,
        has_layer_ids=bool(kv_args.kv_layer_ids),
        pp_size=self.pp_size,
        pp_rank=self.pp_rank,
        shape=source.shape,
        shape_unknown_reason=source.shape_unknown_reason,
    )
    decode = DecodePeer(
        tp_size=registration.dst_attn_tp_size,
        tp_rank=registration.dst_tp_rank,
        item_lens=list(registration.dst_kv_item_lens or []),
        num_entries=len(registration.dst_kv_ptrs),
        has_layer_ids=bool(registration.dst_kv_layer_ids),
    )
    # Through our own hook, which answers stock while no verdict is attached to this record.
    stock_skips_kv, _ = self._get_dsa_cache_transfer_skip_flags(registration)
    plan = peer_verdict(
        prefill, decode, pairs, stock_skips_kv=stock_skips_kv, target_path=target_path
    )
    if plan.action.sends_draft and plan.pair.regime is Regime.PACK_SOURCE:
        need = sum(plan.pair.bytes_per_page(e.component) for e in plan.entries)
        buffer = _pack_buffer(self, source)
        if buffer.slot_bytes < need:
            raise DraftKVLayoutError(
                f"a draft KV pack slot holds {buffer.slot_bytes} B, less than one page of this "
                f"decode's draft heads ({need} B); raise {PACK_BUFFER_MB_ENV}."
            )
    return plan


def _target_path(self, registration) -> TargetPath:
    """The copy sglang's transfer worker will use for this peer's target entries (the dispatch
    in ``MooncakeKVManager.transfer_worker``), or refuse the one we do not cover."""
    return target_path(
        bool(self.is_mla_backend or self.is_hybrid_mla_backend),
        self.attn_tp_size,
        registration.dst_attn_tp_size,
        staging=bool(
            self.enable_staging
            and (registration.staging_base_ptr != 0 or registration.staging_total_size != 0)
        ),
    )


def _pack_buffer(self, source):
    from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import PackStagingBuffer

    with _pack_lock:
        buffer = getattr(self, _PACK_ATTR, None)
        if buffer is None:

            def register(ptr: int, size: int) -> None:
                rc = self.engine.batch_register([ptr], [size])
                if rc not in (0, None):
                    raise DraftKVLayoutError(
                        f"Mooncake refused to register the {size}-byte draft KV pack buffer "
                        f"(rc={rc}); lower {PACK_BUFFER_MB_ENV} or check the transfer engine."
                    )

            buffer = PackStagingBuffer(
                pack_buffer_bytes(),
                max(1, len(getattr(self, "transfer_queues", None) or ())),
                source.entry_rows(0).device,
                register,
            )
            setattr(self, _PACK_ATTR, buffer)
            logger.info(
                "DFlash draft KV pack buffer: %.1f MB on %s, %d slot(s), registered with Mooncake",
                buffer.nbytes / (1 << 20),
                buffer.device,
                buffer.nbytes // buffer.slot_bytes,
            )
        return buffer


def _fill_decode_layer_ids(self, registration) -> None:
    """A stock plain-MHA decode publishes no layer ids; when this prefill stage pairs by id
    (``mha_layer_ids``), give the record the ids of the layout the decode registered."""
    num_layers = published_num_layers()
    if num_layers is None or registration.dst_kv_layer_ids or not self.kv_args.kv_layer_ids:
        return
    try:
        registration.dst_kv_layer_ids = decode_mha_layer_ids(
            num_layers, registration.dst_kv_item_lens, len(registration.dst_kv_ptrs)
        )
    except ValueError as e:
        raise DraftKVLayoutError(str(e)) from None


def validate_peer_state_layout_around(original, self, registration_info, *args, **kwargs):
    fully_checked, mismatch = original(self, registration_info, *args, **kwargs)
    if mismatch is not None:
        return fully_checked, mismatch
    try:
        _fill_decode_layer_ids(self, registration_info)
        plan = draft_kv_verdict(self, registration_info)
    except DraftKVLayoutError as e:
        return False, (
            f"DFlash draft KV cannot be sent to decode attention TP rank "
            f"{registration_info.dst_tp_rank} of {registration_info.dst_attn_tp_size} from "
            f"prefill rank {self.attn_tp_rank} of {self.attn_tp_size}: {e}"
        )
    except Exception as e:  # never let a check kill the bootstrap thread
        logger.exception(
            "DFlash draft KV check of decode %s failed", registration_info.mooncake_session_id
        )
        return False, (
            f"DFlash draft KV: could not check decode {registration_info.mooncake_session_id}'s "
            f"layout ({e!r}); refusing it rather than risk writing wrong bytes."
        )
    setattr(registration_info, _PLAN_ATTR, plan)
    if plan is not None and plan.action is not PeerAction.STOCK:
        logger.info(
            "DFlash draft KV to decode %s: %s",
            registration_info.mooncake_session_id,
            plan.describe(),
        )
    return fully_checked, None


# -- the worker's current chunk ---------------------------------------------------------------


def begin_chunk(manager, chunk) -> None:
    """This thread now sends ``chunk`` (a ``TransferKVChunk``, or None) for ``manager``."""
    end_chunk()
    _worker.manager, _worker.chunk, _worker.packs = manager, chunk, None


def end_chunk() -> None:
    """Give back the pack slot of this thread's previous chunk, whatever its sends did."""
    packs = getattr(_worker, "packs", None)
    _worker.manager = _worker.chunk = _worker.packs = None
    if packs is not None:
        packs.release()


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


def _head_slice(self, plan: DraftKVPeerPlan) -> HeadSlice:
    n_target = len(self.kv_args.kv_data_ptrs) - self.kv_args.num_draft_entries
    pair = plan.pair
    return HeadSlice(
        heads=pair.heads,
        src_entries=tuple(e.src_index - n_target for e in plan.entries),
        byte_offsets=tuple(pair.src_offset(e.component) for e in plan.entries),
        byte_widths=tuple(pair.width(e.component) for e in plan.entries),
    )


def _packed_slice_of(self, session: str) -> Optional[HeadSlice]:
    """The head slice this rank packs for decode ``session``, or None (it packs nothing for it)."""
    if session in getattr(self, "failed_sessions", ()) or session in getattr(
        self, "state_layout_rejections", {}
    ):
        return None  # sglang's loop stops at such a session
    plan = getattr(self.decode_kv_args_table.get(session), _PLAN_ATTR, None)
    if plan is None or not plan.action.sends_draft or plan.pair.regime is not Regime.PACK_SOURCE:
        return None
    return _head_slice(self, plan)


def _chunk_packs(self, buffer) -> Optional[ChunkPacks]:
    """The packs of the chunk this worker thread is sending, or None outside a worker chunk."""
    chunk = getattr(_worker, "chunk", None)
    if chunk is None or getattr(_worker, "manager", None) is not self:
        return None
    packs = _worker.packs
    if packs is None:
        infos = (getattr(self, "transfer_infos", None) or {}).get(chunk.room) or {}
        readers = readers_by_slice(
            (session, _packed_slice_of(self, session))
            for session, info in infos.items()
            if not getattr(info, "is_dummy", False)
        )
        n = self.kv_args.num_draft_entries
        key = (tuple(self.kv_args.kv_data_ptrs[-n:]), tuple(self.kv_args.kv_item_lens[-n:]))
        packs = _worker.packs = ChunkPacks(
            buffer, readers, lambda: _draft_sources(self), self.kv_args.page_size, key=key
        )
    return packs


def _draft_sources(self):
    source = draft_kv_source_for(self.kv_args)
    if source is None:
        raise RuntimeError("the draft KV pool behind this rank's draft entries is gone")
    return [source.entry_rows(q) for q in range(self.kv_args.num_draft_entries)]


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


def _cached_plan(self, session: str, dst_kv_ptrs) -> Tuple[Optional[DraftKVPeerPlan], bool]:
    """(plan, consistent): the verdict attached to the peer's current registration."""
    table = getattr(self, "decode_kv_args_table", None) or {}
    registration = table.get(session)
    plan = getattr(registration, _PLAN_ATTR, None)
    if plan is None:
        return None, True
    published = registration.dst_kv_ptrs
    return plan, published is dst_kv_ptrs or list(published) == list(dst_kv_ptrs)


def _send_plan(self, session: str, dst_kv_ptrs) -> Tuple[Optional[DraftKVPeerPlan], int]:
    """(plan, failure code) for one send: no plan where sglang's own path is exact; a failure
    if the decode re-registered other buffers since the verdict."""
    plan, consistent = _cached_plan(self, session, dst_kv_ptrs)
    if plan is None or plan.action is PeerAction.STOCK:
        return None, 0
    if not consistent:
        logger.error(
            "Decode %s re-registered with other KV buffers during a transfer; failing it.", session
        )
        return None, -1
    return plan, 0


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
        return original(
            manager,
            mooncake_session_id,
            prefill_kv_indices,
            dst_kv_ptrs,
            dst_kv_indices,
            executor,
            dst_layer_ids=dst_layer_ids,
            dst_device_kv_indices=dst_device_kv_indices,
            dst_kv_item_len=dst_kv_item_len,
            dst_attn_tp_size=dst_attn_tp_size,
        )

    plan, failed = _send_plan(self, mooncake_session_id, dst_kv_ptrs)
    if failed:
        return failed
    if plan is None:
        return stock(self)
    if plan.action is not PeerAction.DRAFT_ONLY:
        ret = stock(_TargetEntriesOnly(self))
        if ret != 0 or plan.action is PeerAction.TARGET_ONLY:
            return ret
    # sglang's HiSparse rule: the appended draft entries live in device pages on the decode.
    dst_pages = dst_device_kv_indices if dst_device_kv_indices is not None else dst_kv_indices
    return send_draft_entries(
        self, plan, mooncake_session_id, prefill_kv_indices, dst_pages, dst_kv_ptrs
    )


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
        return original(
            manager,
            mooncake_session_id,
            prefill_kv_indices,
            dst_ptrs,
            dst_kv_indices,
            dst_tp_rank,
            dst_attn_tp_size,
            dst_kv_item_len,
            executor,
            dst_ids,
        )

    plan, failed = _send_plan(self, mooncake_session_id, dst_kv_ptrs)
    if failed:
        return failed
    if plan is None:
        return stock(self, dst_kv_ptrs, dst_layer_ids)
    # sglang slices the target heads, seeing the target entries of both sides only: its
    # K/V split (no layer ids) and its id pairing are then both exact.
    n_target_dst = len(dst_kv_ptrs) - len(plan.entries)
    if sorted(e.dst_index for e in plan.entries) != list(range(n_target_dst, len(dst_kv_ptrs))):
        logger.error("DFlash draft KV: decode %s's draft entries are not its last entries",
                     mooncake_session_id)
        return -1
    ids = list(dst_layer_ids[:n_target_dst]) if dst_layer_ids else dst_layer_ids
    ret = stock(_TargetEntriesOnly(self), list(dst_kv_ptrs[:n_target_dst]), ids)
    if ret != 0 or plan.action is PeerAction.TARGET_ONLY:
        return ret
    return send_draft_entries(
        self, plan, mooncake_session_id, prefill_kv_indices, dst_kv_indices, dst_kv_ptrs
    )


def send_draft_entries(
    self, plan: DraftKVPeerPlan, session: str, src_pages, dst_pages, dst_kv_ptrs
) -> int:
    """Send this rank's draft entries to one decode rank; 0 or a failure code.

    A failure fails this transfer (sglang then concludes the room and marks the session);
    an exception would instead end the transfer worker thread, so none escapes.
    """
    try:
        return _send_draft_entries(self, plan, session, src_pages, dst_pages, dst_kv_ptrs)
    except Exception:
        logger.exception("DFlash draft KV send to decode %s failed", session)
        return -1


def _send_draft_entries(self, plan, session, src_pages, dst_pages, dst_kv_ptrs) -> int:
    src_pages = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    dst_pages = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if src_pages.size != dst_pages.size:
        logger.error(
            "DFlash draft KV: %d prefill pages for %d decode pages", src_pages.size, dst_pages.size
        )
        return -1
    pair = plan.pair
    buffer = getattr(self, _PACK_ATTR) if pair.regime is Regime.PACK_SOURCE else None
    packs = None if buffer is None else _chunk_packs(self, buffer)
    if packs is not None:
        piece = _head_slice(self, plan)
        try:
            slabs = packs.slab(piece, src_pages)
            if slabs is not None:
                return _send_from_slabs(self, plan, packs.slot, slabs, session, dst_pages, dst_kv_ptrs)
        finally:
            packs.done(piece, session)
    step = pages_per_send(
        pair,
        [e.component for e in plan.entries],
        src_pages.size,
        max_batch_pages=self.max_transfer_batch_indices,
        pack_slot_bytes=None if buffer is None else buffer.slot_bytes,
    )
    for start in range(0, src_pages.size, step):
        s, d = src_pages[start : start + step], dst_pages[start : start + step]
        if buffer is not None:
            ret = _send_packed(self, plan, buffer, session, s, d, dst_kv_ptrs)
        else:
            descriptors = Descriptors.concat(
                [
                    entry_descriptors(
                        pair,
                        e.component,
                        self.kv_args.kv_data_ptrs[e.src_index],
                        dst_kv_ptrs[e.dst_index],
                        s,
                        d,
                    )
                    for e in plan.entries
                ]
            )
            ret = _transfer(self, session, descriptors)
        if ret != 0:
            return ret
    return 0


def _send_from_slabs(self, plan, slot, slabs, session, dst_pages, dst_kv_ptrs) -> int:
    """Send this decode rank's pages from the chunk's packed slabs (entry order of ``plan``),
    in sglang's bounded index batches when it sets them."""
    pair = plan.pair
    step = pages_per_send(
        pair,
        [e.component for e in plan.entries],
        dst_pages.size,
        max_batch_pages=self.max_transfer_batch_indices,
    )
    for start in range(0, dst_pages.size, step):
        d = dst_pages[start : start + step]
        descriptors = Descriptors.concat(
            [
                packed_descriptors(
                    pair,
                    e.component,
                    slot.ptr + at + start * pair.bytes_per_page(e.component),
                    dst_kv_ptrs[e.dst_index],
                    d,
                )
                for e, at in zip(plan.entries, slabs)
            ]
        )
        ret = _transfer(self, session, descriptors)
        if ret != 0:
            return ret
    return 0


def _send_packed(self, plan, buffer, session, src_pages, dst_pages, dst_kv_ptrs) -> int:
    from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import pack_row_slices

    pair = plan.pair
    source = draft_kv_source_for(self.kv_args)
    if source is None:
        raise RuntimeError("the draft KV pool behind this rank's draft entries is gone")
    n_target = len(self.kv_args.kv_data_ptrs) - self.kv_args.num_draft_entries
    sources = [source.entry_rows(e.src_index - n_target) for e in plan.entries]
    with buffer.acquire() as slot:
        with slot.on_stream():
            rows = slot.rows(pack_source_rows(pair, src_pages))
            slabs = pack_row_slices(
                sources,
                rows,
                [pair.src_offset(e.component) for e in plan.entries],
                [pair.width(e.component) for e in plan.entries],
                slot.buffer,
            )
        descriptors = Descriptors.concat(
            [
                entry_descriptors(
                    pair, e.component, slot.ptr + at, dst_kv_ptrs[e.dst_index], src_pages, dst_pages
                )
                for e, at in zip(plan.entries, slabs)
            ]
        )
        return _transfer(self, session, descriptors)


def _transfer(self, session: str, descriptors: Descriptors) -> int:
    for batch in descriptors.batches(max_batch_descriptors()):
        ret = self._transfer_data(session, batch.as_blocks())
        if ret != 0:
            return ret
    return 0


def transfer_skip_flags_around(original, self, info, *args, **kwargs):
    skip_kv, skip_state = original(self, info, *args, **kwargs)
    plan = getattr(info, _PLAN_ATTR, None)
    if skip_kv and plan is not None and plan.action is PeerAction.DRAFT_ONLY:
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
