"""The registration-time verdict on one decode peer: how to send it the draft KV, or why not.

Called once per decode registration, from the Mooncake prefill's peer validation
(``draft_kv_registration``), so a peer whose layout cannot be served is refused before any byte
is written and the send path only reads the cached verdict. Stdlib only.

What is checked, with the entry pairing sglang's send path will use:

* target entries: the decode item length equals the prefill's (sglang addresses both sides with
  the prefill's item length, so any difference writes to the wrong pages);
* draft entries: each side's item lengths describe a valid :class:`DraftKVGeometry` of the same
  draft (heads divide the TP sizes, page size, element size and head dims agree);
* the cases head-aware sending depends on: per-entry item lengths and layer ids published.

A peer that sglang's own path already serves exactly gets :attr:`PeerAction.STOCK`, so the send
path takes sglang's own copy for it, unchanged.

Two target paths exist (:class:`TargetPath`): sglang's whole-page copy (``send_kvcache``: MLA and
hybrid-MLA targets, and any target at equal attention TP), where the target entries must have
the same item length on both sides; and its head-sliced copy for a plain-MHA target whose
attention TP differs (``send_kvcache_slice``), which slices every entry with the *target's* head
count, right for the target and wrong for a draft with other heads. On that path the target
entries keep sglang's slicing and the draft entries always follow our plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
    DraftKVGeometry,
    DraftKVLayoutError,
    DraftKVShape,
    KVComponent,
    draft_entry_components,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import (
    DraftKVPairPlan,
    Regime,
    plan_pair,
)


class TargetPath(enum.Enum):
    WHOLE_PAGES = "whole pages (send_kvcache)"
    HEAD_SLICED = "head sliced (send_kvcache_slice)"


def target_path(target_is_mla: bool, p_attn_tp: int, d_attn_tp: int, staging: bool) -> TargetPath:
    """The copy sglang's transfer worker uses for a peer's target entries (its dispatch in
    ``MooncakeKVManager.transfer_worker``); raises for the one the draft KV cannot ride with:
    the staging copy of a head-sliced plain-MHA target (``staging``: both sides run with
    ``SGLANG_DISAGG_STAGING_BUFFER``)."""
    if target_is_mla or p_attn_tp == d_attn_tp:
        return TargetPath.WHOLE_PAGES
    if staging:
        raise DraftKVLayoutError(
            "with SGLANG_DISAGG_STAGING_BUFFER the KV of a plain-MHA target with another "
            f"attention TP (P {p_attn_tp}, D {d_attn_tp}) goes through the staging copy, which "
            "does not carry DFLASH draft KV head by head; unset SGLANG_DISAGG_STAGING_BUFFER on "
            "both servers."
        )
    return TargetPath.HEAD_SLICED


class PeerAction(enum.Enum):
    STOCK = "stock"  # sglang's own path is exact for this peer
    TARGET_ONLY = "target only"  # this rank writes no draft bytes to this peer
    HEAD_AWARE = "head aware"  # target entries the stock way, draft entries by the pair plan
    DRAFT_ONLY = "draft only"  # sglang skips this rank's (replicated) KV; send the draft heads

    @property
    def sends_draft(self) -> bool:
        return self in (PeerAction.HEAD_AWARE, PeerAction.DRAFT_ONLY)


@dataclass(frozen=True)
class DraftEntryPair:
    src_index: int  # into the prefill's kv_data_ptrs
    dst_index: int  # into the decode's dst_kv_ptrs
    component: KVComponent


@dataclass(frozen=True)
class DraftKVPeerPlan:
    action: PeerAction
    pair: Optional[DraftKVPairPlan] = None
    entries: Tuple[DraftEntryPair, ...] = ()

    def describe(self) -> str:
        if self.pair is None:
            return self.action.value
        return f"{self.action.value}: {self.pair.describe()}, {len(self.entries)} draft entries"


@dataclass(frozen=True)
class PrefillSide:
    """What this prefill rank registered, plus what it knows about its own draft."""

    tp_size: int
    tp_rank: int
    page_size: int
    item_lens: Sequence[int]  # every entry, target first, draft last
    num_draft_entries: int
    has_layer_ids: bool
    pp_size: int = 1
    pp_rank: int = 0
    shape: Optional[DraftKVShape] = None
    shape_unknown_reason: Optional[str] = None  # why ``shape`` is None

    @property
    def num_target_entries(self) -> int:
        return len(self.item_lens) - self.num_draft_entries


@dataclass(frozen=True)
class DecodePeer:
    """What a decode rank published in its registration."""

    tp_size: int
    tp_rank: int
    item_lens: Sequence[int]  # may be empty (no per-entry lengths published)
    num_entries: int
    has_layer_ids: bool


def _component(prefill: PrefillSide, i: int) -> KVComponent:
    return draft_entry_components(prefill.num_draft_entries)[i - prefill.num_target_entries]


def peer_verdict(
    prefill: PrefillSide,
    decode: DecodePeer,
    pairs: Sequence[Tuple[int, int]],
    *,
    stock_skips_kv: bool = False,
    target_path: TargetPath = TargetPath.WHOLE_PAGES,
) -> DraftKVPeerPlan:
    """The verdict for one decode peer; raises :class:`DraftKVLayoutError` to refuse it.

    ``stock_skips_kv``: sglang sends this peer no KV from this rank. It does so for a
    hybrid-MLA target when the decode has the smaller attention TP, because the target KV is
    replicated and one rank of each group suffices; the draft heads are not replicated there,
    so a rank holding heads no lower rank holds must still send them (DRAFT_ONLY).

    ``target_path``: which of sglang's copies carries the target entries (module docstring).
    """
    n_t = prefill.num_target_entries
    sliced = target_path is TargetPath.HEAD_SLICED
    if prefill.num_draft_entries == 0:
        return DraftKVPeerPlan(PeerAction.STOCK)
    has_lens = bool(decode.item_lens)
    if has_lens and len(decode.item_lens) != decode.num_entries:
        raise DraftKVLayoutError(
            f"the decode peer published {len(decode.item_lens)} item lengths for "
            f"{decode.num_entries} KV entries; its registration is malformed. Restart the "
            "decode server with the same sglang release as the prefill."
        )
    if not sliced:  # sliced: the decode's target entries hold fewer heads, by design
        _check_target_entries(prefill, decode, [(i, j) for i, j in pairs if i < n_t])
    draft_pairs = [(i, j) for i, j in pairs if i >= n_t]
    if prefill.pp_size > 1 and prefill.pp_rank != prefill.pp_size - 1:
        # Only the last stage owns the draft; an earlier stage's draft pool holds nothing useful.
        return _needs_layer_ids(prefill, decode, DraftKVPeerPlan(PeerAction.TARGET_ONLY))
    if not draft_pairs:
        return DraftKVPeerPlan(PeerAction.STOCK)
    if prefill.num_draft_entries % 2:
        raise DraftKVLayoutError(
            f"this prefill registered {prefill.num_draft_entries} draft KV entries; a DFlash "
            "draft registers a K and a V entry per layer."
        )
    same_lens = has_lens and all(
        prefill.item_lens[i] == decode.item_lens[j] for i, j in draft_pairs
    )
    same_rank = prefill.tp_size == decode.tp_size and prefill.tp_rank == decode.tp_rank
    if same_rank and (same_lens or not has_lens) and not sliced:
        # Same attention TP: the decode rank pairs with the same-numbered prefill rank, which
        # holds exactly its heads, and sglang's whole-page copy is exact.
        return DraftKVPeerPlan(PeerAction.STOCK)
    if prefill.shape is None:
        dst_lens = sorted({decode.item_lens[j] for _, j in draft_pairs}) if has_lens else "?"
        raise DraftKVLayoutError(
            f"this prefill cannot describe its draft KV pool ({prefill.shape_unknown_reason}), "
            f"so it serves only a decode with its own attention TP ({prefill.tp_size}) and "
            f"draft item lengths ({sorted({prefill.item_lens[i] for i, _ in draft_pairs})} B "
            f"per page); this decode runs attention TP {decode.tp_size} with {dst_lens}."
        )
    shape = prefill.shape
    src = DraftKVGeometry.from_item_lengths(
        shape,
        side="prefill",
        tp_size=prefill.tp_size,
        tp_rank=prefill.tp_rank,
        page_size=prefill.page_size,
        **_lens_by_component(prefill, [prefill.item_lens[i] for i, _ in draft_pairs], draft_pairs),
    )
    if has_lens:
        dst = DraftKVGeometry.from_item_lengths(
            shape,
            side="decode",
            tp_size=decode.tp_size,
            tp_rank=decode.tp_rank,
            page_size=prefill.page_size,
            **_lens_by_component(
                prefill, [decode.item_lens[j] for _, j in draft_pairs], draft_pairs
            ),
        )
    else:
        dst = DraftKVGeometry.for_rank(
            shape,
            side="decode",
            tp_size=decode.tp_size,
            tp_rank=decode.tp_rank,
            page_size=prefill.page_size,
        )
        if dst.heads_per_rank != src.heads_per_rank:
            raise DraftKVLayoutError(
                f"the decode peer published no per-entry KV item lengths, so its draft KV "
                f"layout cannot be checked, and {src.describe()} differs from "
                f"{dst.describe()}; a head-aware transfer is only safe against a known layout. "
                "Run the decode server on the same sglang release as the prefill (it publishes "
                f"the lengths), or give it attention TP {prefill.tp_size}."
            )
    pair = plan_pair(src, dst)
    entries = tuple(DraftEntryPair(i, j, _component(prefill, i)) for i, j in draft_pairs)
    if sliced:
        # sglang would slice the draft entries with the target's head count: never let it.
        # (The send hands sglang's slicing the target entries of both sides only, so its own
        # pairing, by layer id or by its K/V split, sees no draft entry.)
        action = PeerAction.HEAD_AWARE if pair.writer else PeerAction.TARGET_ONLY
        return DraftKVPeerPlan(action, pair, entries)
    if not pair.writer:
        # A replica that lost the election. Without layer ids (a pure-MLA target) sglang already
        # marks this rank a dummy sender for the decode, and stock sends nothing either.
        if stock_skips_kv or not (prefill.has_layer_ids and decode.has_layer_ids):
            return DraftKVPeerPlan(PeerAction.STOCK, pair, entries)
        return DraftKVPeerPlan(PeerAction.TARGET_ONLY, pair, entries)
    if stock_skips_kv:
        return DraftKVPeerPlan(PeerAction.DRAFT_ONLY, pair, entries)
    if pair.regime is Regime.WHOLE_PAGES:
        return DraftKVPeerPlan(PeerAction.STOCK, pair, entries)
    return _needs_layer_ids(prefill, decode, DraftKVPeerPlan(PeerAction.HEAD_AWARE, pair, entries))


def _lens_by_component(prefill: PrefillSide, lens, draft_pairs) -> dict:
    """``k_item_len``/``v_item_len`` of one side, after checking every entry of a kind agrees."""
    by = {}
    for (i, _), n in zip(draft_pairs, lens):
        c = _component(prefill, i)
        if by.setdefault(c, n) != n:
            raise DraftKVLayoutError(
                f"draft {c.value} entries differ in item length ({by[c]} vs {n} B per page); "
                "every draft layer must have the same KV layout."
            )
    if set(by) != set(KVComponent):
        raise DraftKVLayoutError("a DFlash draft must register both K and V entries")
    return {"k_item_len": by[KVComponent.K], "v_item_len": by[KVComponent.V]}


def _check_target_entries(prefill: PrefillSide, decode: DecodePeer, target_pairs) -> None:
    if not decode.item_lens:
        return
    for i, j in target_pairs:
        src_len = prefill.item_lens[i]
        if src_len == 0:
            continue  # elided on the prefill: nothing moves (sglang's is_elided_entry)
        if j >= len(decode.item_lens):
            raise DraftKVLayoutError(
                f"target KV entry {i} pairs with decode entry {j}, but the decode published "
                f"only {len(decode.item_lens)} item lengths; restart the decode with the same "
                "sglang release and model as the prefill."
            )
        if src_len != decode.item_lens[j]:
            raise DraftKVLayoutError(
                f"target KV entry {i} is {src_len} B per page on this prefill (page size "
                f"{prefill.page_size}) but {decode.item_lens[j]} B on the decode; pages would "
                "land at the wrong addresses. Run both servers with the same --page-size, "
                "--kv-cache-dtype and target model."
            )


def _needs_layer_ids(
    prefill: PrefillSide, decode: DecodePeer, plan: DraftKVPeerPlan
) -> DraftKVPeerPlan:
    if prefill.has_layer_ids and decode.has_layer_ids:
        return plan
    missing = " and ".join(
        side
        for side, has in (("prefill", prefill.has_layer_ids), ("decode", decode.has_layer_ids))
        if not has
    )
    raise DraftKVLayoutError(
        f"sending this decode its draft KV head by head needs KV layer ids from both "
        f"servers, but the {missing} published none (its KV pool has no per-entry layer ids, "
        "e.g. a plain MLA or MHA target pool). Give the decode the prefill's attention TP "
        f"({prefill.tp_size}) so sglang's own whole-page transfer applies."
    )
