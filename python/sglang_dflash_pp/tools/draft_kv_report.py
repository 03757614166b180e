"""The draft-KV side of a P/D deployment, as the plugin's transfer path will see it.

For every decode rank and every prefill rank sglang's rank mapping pairs it with, this runs the
plugin's own registration verdict (``draft_kv_peer.peer_verdict``) on the item lengths each side
would register, and for the writers the plugin's own descriptor builders (``draft_kv_plan``) on
one request's pages. So the writer map, the refusals and the counts are the ones the prefill
would produce; nothing here re-derives a formula.

Assumptions, stated in the report: the last PP stage's ranks are the senders (earlier stages
register no draft entries); the target is hybrid-MLA (Kimi-K3), so sglang lets only the first
prefill rank of a group send the replicated target KV when the decode TP is smaller; a request's
pages are contiguous on both sides (each break in the decode page list adds one descriptor per
entry in the packed and whole-page regimes).

Pure: stdlib, numpy and our modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
    DraftKVGeometry,
    DraftKVShape,
    KVComponent,
    draft_entry_components,
    format_heads,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import (
    DecodePeer,
    DraftKVPeerPlan,
    PeerAction,
    PrefillSide,
    peer_verdict,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import (
    Descriptors,
    DraftKVPairPlan,
    entry_descriptors,
    pages_per_send,
    per_token_descriptors,
    plan_pair,
    prefill_ranks_for,
)


@dataclass(frozen=True)
class DraftKVTopology:
    shape: DraftKVShape
    num_layers: int  # draft layers: one K and one V transfer entry each
    page_size: int
    prefill_tp: int  # the prefill's draft attention TP
    decode_tp: int
    pp_size: int = 1

    @property
    def components(self) -> List[KVComponent]:
        """Entry order of sglang's MHA pool: K0..K(L-1), then V0..V(L-1)."""
        return draft_entry_components(2 * self.num_layers)

    def geometry(self, side: str, rank: int) -> DraftKVGeometry:
        tp = self.prefill_tp if side == "prefill" else self.decode_tp
        return DraftKVGeometry.for_rank(
            self.shape, side=side, tp_size=tp, tp_rank=rank, page_size=self.page_size
        )

    def item_lens(self, geometry: DraftKVGeometry) -> List[int]:
        return [geometry.page_bytes(c) for c in self.components]


def side_summary(topo: DraftKVTopology, side: str) -> dict:
    """Heads per rank, replication, per-page item lengths and every rank's heads."""
    tp = topo.prefill_tp if side == "prefill" else topo.decode_tp
    g0 = topo.geometry(side, 0)
    return dict(
        tp_size=tp,
        heads_per_rank=g0.heads_per_rank,
        replication=g0.replication,
        k_item_len=g0.page_bytes(KVComponent.K),
        v_item_len=g0.page_bytes(KVComponent.V),
        row_bytes=g0.row_bytes(KVComponent.K),
        ranks=[list(topo.geometry(side, q).owned_heads) for q in range(tp)],
    )


def verdict(topo: DraftKVTopology, prefill_rank: int, decode_rank: int) -> DraftKVPeerPlan:
    """The plugin's registration verdict of ``prefill_rank`` on ``decode_rank``'s registration
    (raises ``DraftKVLayoutError``: the refusal the decode would get)."""
    src, dst = topo.geometry("prefill", prefill_rank), topo.geometry("decode", decode_rank)
    n = 2 * topo.num_layers
    prefill = PrefillSide(
        tp_size=topo.prefill_tp,
        tp_rank=prefill_rank,
        page_size=topo.page_size,
        item_lens=topo.item_lens(src),
        num_draft_entries=n,
        has_layer_ids=True,  # hybrid-MLA pools publish per-entry layer ids
        pp_size=topo.pp_size,
        pp_rank=topo.pp_size - 1,
        shape=topo.shape,
    )
    decode = DecodePeer(
        tp_size=topo.decode_tp,
        tp_rank=decode_rank,
        item_lens=topo.item_lens(dst),
        num_entries=n,
        has_layer_ids=True,
    )
    group = prefill_ranks_for(decode_rank, prefill_tp=topo.prefill_tp, decode_tp=topo.decode_tp)
    # sglang (hybrid MLA): with a smaller decode TP only the group's first rank sends target KV.
    stock_skips_kv = topo.decode_tp < topo.prefill_tp and prefill_rank != group.start
    return peer_verdict(prefill, decode, [(q, q) for q in range(n)], stock_skips_kv=stock_skips_kv)


def writes_draft(
    plan: DraftKVPeerPlan, topo: DraftKVTopology, p: int, r: int
) -> Optional[DraftKVPairPlan]:
    """The pair plan when this prefill rank writes draft bytes to this decode rank, else None.
    A stock verdict with equal heads per rank is sglang's own whole-page copy, which is exact."""
    if plan.action.sends_draft:
        return plan.pair
    if plan.action is PeerAction.STOCK:
        pair = plan.pair or plan_pair(topo.geometry("prefill", p), topo.geometry("decode", r))
        return pair if pair.writer else None
    return None


def request_descriptors(
    pair: DraftKVPairPlan,
    components: List[KVComponent],
    n_pages: int,
    *,
    pack_slot_bytes: Optional[int] = None,
    max_batch_pages: int = 0,
    src_pages=None,
    dst_pages=None,
) -> Descriptors:
    """One request's draft descriptors for this pair (addresses relative to each entry's base;
    pages contiguous on both sides unless given), chunked by whole pages as the send path
    chunks them: by sglang's ``max_transfer_batch_indices`` and, when packing, by what one pack
    slot holds."""
    src = (
        np.arange(n_pages, dtype=np.int64) if src_pages is None else np.asarray(src_pages, np.int64)
    )
    dst = (
        np.arange(n_pages, dtype=np.int64) if dst_pages is None else np.asarray(dst_pages, np.int64)
    )
    step = pages_per_send(
        pair,
        components,
        n_pages,
        max_batch_pages=max_batch_pages,
        pack_slot_bytes=pack_slot_bytes,
    )
    parts = []
    for start in range(0, n_pages, step):
        s, d = src[start : start + step], dst[start : start + step]
        parts.extend(entry_descriptors(pair, c, 0, 0, s, d) for c in components)
    return Descriptors.concat(parts)


def report(
    topo: DraftKVTopology,
    prompt_tokens: int,
    *,
    pack_slot_bytes: Optional[int] = None,
    max_batch_pages: int = 0,
    src_pages=None,
    dst_pages=None,
) -> dict:
    """Writer map and one request's bytes and descriptors per decode and prefill rank (pages
    contiguous on both sides unless given).

    Raises ``DraftKVLayoutError`` with the refusal when the deployment cannot be served."""
    components = topo.components
    n_pages = -(-int(prompt_tokens) // topo.page_size)
    prefill = side_summary(topo, "prefill")
    decode = side_summary(topo, "decode")
    per_decode: List[dict] = []
    per_prefill: Dict[int, dict] = {
        p: dict(
            prefill_rank=p, heads=prefill["ranks"][p], writes=[], silent=[], descriptors=0, bytes=0
        )
        for p in range(topo.prefill_tp)
    }
    for r in range(topo.decode_tp):
        dst = topo.geometry("decode", r)
        minimum = n_pages * sum(dst.page_bytes(c) for c in components)
        row = dict(
            decode_rank=r,
            heads=list(dst.owned_heads),
            writers=[],
            descriptors=0,
            bytes=0,
            per_token_descriptors=0,
            physical_minimum_bytes=minimum,
        )
        for p in prefill_ranks_for(r, prefill_tp=topo.prefill_tp, decode_tp=topo.decode_tp):
            plan = verdict(topo, p, r)
            pair = writes_draft(plan, topo, p, r)
            if pair is None:
                per_prefill[p]["silent"].append(dict(decode_rank=r, action=plan.action.value))
                continue
            d = request_descriptors(
                pair,
                components,
                n_pages,
                pack_slot_bytes=pack_slot_bytes,
                max_batch_pages=max_batch_pages,
                src_pages=src_pages,
                dst_pages=dst_pages,
            )
            unpacked = sum(
                per_token_descriptors(pair, c, 0, 0, np.arange(n_pages), np.arange(n_pages)).count
                for c in components
            )
            row["writers"].append(p)
            row["descriptors"] += d.count
            row["bytes"] += d.total_bytes
            row["per_token_descriptors"] += unpacked
            per_prefill[p]["writes"].append(
                dict(
                    decode_rank=r,
                    heads=list(pair.heads),
                    regime=pair.regime.value,
                    action=plan.action.value,
                    descriptors=d.count,
                    bytes=d.total_bytes,
                )
            )
            per_prefill[p]["descriptors"] += d.count
            per_prefill[p]["bytes"] += d.total_bytes
        per_decode.append(row)
    return dict(
        page_size=topo.page_size,
        entries=len(components),
        shape=dict(
            total_heads=topo.shape.total_heads,
            k_head_dim=topo.shape.k_head_dim,
            v_head_dim=topo.shape.v_head_dim,
            dtype_bytes=topo.shape.dtype_bytes,
        ),
        prefill=prefill,
        decode=decode,
        prompt_tokens=int(prompt_tokens),
        pages=n_pages,
        pack_slot_bytes=pack_slot_bytes,
        decode_ranks=per_decode,
        prefill_ranks=list(per_prefill.values()),
    )


def writer_lines(rep: dict) -> List[str]:
    """One line per prefill rank: which heads go to which decode ranks, and how."""
    lines = []
    for p in rep["prefill_ranks"]:
        groups: Dict[tuple, List[int]] = {}
        regimes = set()
        for w in p["writes"]:
            groups.setdefault(tuple(w["heads"]), []).append(w["decode_rank"])
            regimes.add(w["regime"])
        parts = [
            f"{_ranks(ranks)} {format_heads(range(h[0], h[-1] + 1))}" for h, ranks in groups.items()
        ]
        head = f"P{p['prefill_rank']} ({format_heads(range(p['heads'][0], p['heads'][-1] + 1))})"
        body = ", ".join(parts) if parts else "no draft bytes"
        tail = f"  [{'; '.join(sorted(regimes))}]" if regimes else ""
        if p["silent"]:
            tail += f"  (silent towards {_ranks([s['decode_rank'] for s in p['silent']])})"
        lines.append(f"{head} -> {body}{tail}")
    return lines


def _ranks(ranks: List[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"D{ranks[0]}-{ranks[-1]}"
    return ",".join(f"D{r}" for r in ranks)
