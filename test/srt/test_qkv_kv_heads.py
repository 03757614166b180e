"""The decode head-ownership oracle against sglang, and our geometry against the oracle.

``qkv_kv_heads`` reads which KV heads a TP rank holds by loading a head-labelled ``k_proj``
through sglang's real ``QKVParallelLinear``; the transfer tests and ``preflight`` verify decode
pools with it. Here: the oracle on hand-checked cases (so it cannot silently return what the
geometry returns), then ``DraftKVGeometry`` (the rule the send path uses) equal to it for every
TP size and head count where sglang builds the layer.
"""

from __future__ import annotations

import pytest

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVGeometry, DraftKVShape
from sglang_dflash_pp.tools.qkv_kv_heads import kv_heads_by_rank


def test_oracle_on_hand_checked_layouts():
    assert kv_heads_by_rank(8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    # TP32 over 8 heads: each head on 4 consecutive ranks (the Kimi-K3 decode).
    assert [h.start for h in kv_heads_by_rank(8, 32)] == [r // 4 for r in range(32)]
    assert all(len(h) == 1 for h in kv_heads_by_rank(8, 32))
    assert kv_heads_by_rank(2, 1) == (range(0, 2),)


LAYOUTS = [
    (heads, tp)
    for heads in range(1, 17)
    for tp in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
    if heads % tp == 0 or tp % heads == 0
]


@pytest.mark.parametrize("heads,tp", LAYOUTS, ids=[f"H{h}-TP{t}" for h, t in LAYOUTS])
def test_geometry_owns_what_sglang_loads(heads, tp):
    shape = DraftKVShape(heads, 128, 128, 2)
    oracle = kv_heads_by_rank(heads, tp)
    for side in ("prefill", "decode"):
        ours = [
            DraftKVGeometry.for_rank(shape, side=side, tp_size=tp, tp_rank=r, page_size=64)
            for r in range(tp)
        ]
        assert tuple(g.owned_heads for g in ours) == oracle
