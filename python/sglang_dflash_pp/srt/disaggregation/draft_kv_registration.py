"""The draft KV verdict of one decode registration, from what a Mooncake prefill manager holds.

The verdict itself is pure (``draft_kv_peer``); this module reads its inputs off sglang's
``MooncakeKVManager`` and the decode's ``KVArgsRegisterInfo``: the entry pairs sglang's send path
will use for the peer, the copy sglang's transfer worker picks for its target entries, and
whether sglang skips this rank's KV for it. It is called with the manager and the registration
as arguments, so the plugin (its ``_validate_peer_state_layout`` hook, ``mooncake_draft_kv``)
and an in-tree ``MooncakeKVManager._validate_peer_state_layout`` share it: sglang is imported
lazily and nothing here registers a hook.

``draft_kv_layout_mismatch`` is the registration check as a ``_validate_peer_state_layout``
caller wants it, a refusal message or None. Its ``head_aware`` argument exists for an in-tree
series that adds the registration check before the head-aware sends: where no send carries the
draft entries by their plan beside a target copy, every verdict but STOCK (equal heads per
rank, or a layout sglang's own path copies exactly) must be refused, because stock writes those
peers wrong bytes silently.
"""

from __future__ import annotations

import logging
from typing import Collection, List, Optional, Tuple

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

logger = logging.getLogger(__name__)

PLAN_ATTR = "dflash_draft_kv_plan"  # on the decode's KVArgsRegisterInfo: its verdict


def stock_entry_pairs(manager, registration) -> List[Tuple[int, int]]:
    """The (prefill entry, decode entry) pairs sglang's ``send_kvcache`` uses for this peer."""
    from sglang.srt.disaggregation.utils import build_transfer_entry_pairs

    kv_args = manager.kv_args
    n_src, n_dst = len(kv_args.kv_data_ptrs), len(registration.dst_kv_ptrs)
    src_ids, dst_ids = kv_args.kv_layer_ids or [], registration.dst_kv_layer_ids or []
    if src_ids or dst_ids:
        return build_transfer_entry_pairs(
            src_ids, dst_ids, n_src, n_dst, allow_positional_fallback=manager.pp_size == 1
        )
    if n_src == n_dst:
        return [(i, i) for i in range(n_src)]
    # get_mla_kv_ptrs_with_pp: this stage's target slice, then the draft band at the end.
    n_draft = kv_args.num_draft_entries
    start, _ = manager._mla_kv_entry_span_with_pp(n_src - n_draft)
    return [(i, start + i) for i in range(n_src - n_draft)] + [
        (n_src - n_draft + q, n_dst - n_draft + q) for q in range(n_draft)
    ]


def target_path_of(manager, registration) -> TargetPath:
    """The copy sglang's transfer worker uses for this peer's target entries (its dispatch in
    ``MooncakeKVManager.transfer_worker``), or refuse the one we do not cover."""
    return target_path(
        bool(manager.is_mla_backend or manager.is_hybrid_mla_backend),
        manager.attn_tp_size,
        registration.dst_attn_tp_size,
        staging=bool(
            manager.enable_staging
            and (registration.staging_base_ptr != 0 or registration.staging_total_size != 0)
        ),
    )


def draft_kv_verdict(manager, registration, source) -> Optional[DraftKVPeerPlan]:
    """The verdict of this prefill rank on a decode registration; None where the draft KV is not
    ours to decide: no DFLASH draft pool behind the entries (``source`` is its
    ``draft_kv_source.DraftKVSource``), or a DCP relayout (``send_kvcache_dcp`` slices the draft
    itself). Raises :class:`DraftKVLayoutError` to refuse the peer."""
    if source is None or not getattr(manager.kv_args, "num_draft_entries", 0):
        return None
    if getattr(registration, "requires_dcp_relayout", False):
        return None
    kv_args = manager.kv_args
    path = target_path_of(manager, registration)
    try:
        pairs = stock_entry_pairs(manager, registration)
    except (RuntimeError, ValueError) as e:
        raise DraftKVLayoutError(
            f"the prefill and decode KV entries cannot be paired ({e}). Both servers must run "
            "the same target and draft models and publish KV layer ids."
        ) from None
    prefill = PrefillSide(
        tp_size=manager.attn_tp_size,
        tp_rank=manager.attn_tp_rank,
        page_size=kv_args.page_size,
        item_lens=list(kv_args.kv_item_lens),
        num_draft_entries=kv_args.num_draft_entries,
        has_layer_ids=bool(kv_args.kv_layer_ids),
        pp_size=manager.pp_size,
        pp_rank=manager.pp_rank,
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
    # Asked before a verdict is attached to the record: sglang's own answer for this peer.
    stock_skips_kv, _ = manager._get_dsa_cache_transfer_skip_flags(registration)
    return peer_verdict(prefill, decode, pairs, stock_skips_kv=stock_skips_kv, target_path=path)


def refusal(manager, registration, reason) -> str:
    """The rejection message of a refused decode peer, naming both ranks."""
    return (
        f"DFlash draft KV cannot be sent to decode attention TP rank "
        f"{registration.dst_tp_rank} of {registration.dst_attn_tp_size} from "
        f"prefill rank {manager.attn_tp_rank} of {manager.attn_tp_size}: {reason}"
    )


def unserved(manager, plan: DraftKVPeerPlan) -> str:
    """Why a non-STOCK verdict is refused where only sglang's own copy sends the draft KV."""
    if plan.pair is not None:
        src, dst = plan.pair.src, plan.pair.dst
        heads = (
            f"this prefill holds {src.heads_per_rank} draft KV heads per rank and the decode "
            f"{dst.heads_per_rank}"
        )
    else:
        heads = f"it needs a {plan.action.value} send"
    return (
        f"{heads}, and sending each decode rank its own draft heads is not supported here. "
        f"Give the decode the prefill's attention TP ({manager.attn_tp_size}, --tp-size) so "
        "sglang's whole-page transfer applies."
    )


def draft_kv_layout_mismatch(
    manager, registration, source, *, head_aware: Collection[TargetPath] = tuple(TargetPath)
) -> Optional[str]:
    """The draft KV part of ``_validate_peer_state_layout``: the verdict, attached to the
    registration record (``PLAN_ATTR``, replaced with the record on re-registration), or the
    reason the peer is refused. ``head_aware``: the target copies (``TargetPath``) beside which
    this prefill sends the draft entries by their plan; a non-STOCK verdict on any other copy is
    refused."""
    setattr(registration, PLAN_ATTR, None)
    try:
        plan = draft_kv_verdict(manager, registration, source)
        path = target_path_of(manager, registration)
    except DraftKVLayoutError as e:
        return refusal(manager, registration, e)
    except Exception as e:  # a failure of the check, not of the decode's layout: fail closed
        logger.exception("DFlash draft KV check of decode %s failed",
                         registration.mooncake_session_id)  # fmt: skip
        return refusal(manager, registration, f"the draft KV check failed ({e!r})")
    if plan is not None and plan.action is not PeerAction.STOCK and path not in head_aware:
        return refusal(manager, registration, unserved(manager, plan))
    setattr(registration, PLAN_ATTR, plan)
    return None
