"""Plain-MHA targets (Llama, Qwen3, ...) with a DFLASH draft: how a PP prefill stage's transfer
entries pair with the decode's (``disaggregation/mha_layer_ids``), and the registration verdict
when sglang's head-sliced copy carries the target (``draft_kv_peer.TargetPath.HEAD_SLICED``).

The oracle for pairing is by name: every entry is labelled with what it holds (``K2``, ``V2``,
``dK0``, ...) on each side, from the order sglang registers them in (target pool K per layer then
V per layer, then the draft pool's K then V); a correct pairing maps every prefill entry to the
decode entry with the same label.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVLayoutError, DraftKVShape
from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import (
    DecodePeer,
    PeerAction,
    PrefillSide,
    TargetPath,
    peer_verdict,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import Regime

N, DRAFT_LAYERS = 4, 2


@pytest.fixture(autouse=True)
def _no_published_layer_ids_leak():
    """``mha_layer_ids`` records, per process, that this prefill published synthesized ids (a
    server does it once at startup); a test that publishes must not leave it to later modules,
    whose registrations would then be paired by id."""
    from sglang_dflash_pp.srt.disaggregation import mha_layer_ids

    saved = mha_layer_ids._target_num_layers
    yield
    mha_layer_ids._target_num_layers = saved


def labels(layers, draft: bool):
    target = [f"K{i}" for i in layers] + [f"V{i}" for i in layers]
    band = [f"dK{i}" for i in range(DRAFT_LAYERS)] + [f"dV{i}" for i in range(DRAFT_LAYERS)]
    return target + (band if draft else [])


DECODE = labels(range(N), draft=True)


def test_decode_ids_describe_the_layout_a_pp1_decode_registers():
    from sglang_dflash_pp.srt.disaggregation.mha_layer_ids import decode_mha_layer_ids

    ids = decode_mha_layer_ids(N, [256] * 8 + [128] * 4, len(DECODE))
    assert ids == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 4, 5]
    with pytest.raises(ValueError, match="not 8 target entries"):
        decode_mha_layer_ids(N, [], 7)
    with pytest.raises(ValueError, match="--pp-size 1"):
        decode_mha_layer_ids(N, [], 6)
    with pytest.raises(ValueError, match="not one plain-MHA target layout"):
        decode_mha_layer_ids(N, [256] * 7 + [128] * 5, 12)


@pytest.mark.parametrize("stage_layers, draft", [((0, 1), False), ((2, 3), True)])
def test_layer_ids_pair_every_pp_stage_entry_with_its_decode_entry(stage_layers, draft):
    """With our ids sglang's own ``build_transfer_entry_pairs`` pairs each label to itself;
    sglang's positional K/V split (what 0.5.23 does without ids) does not."""
    from sglang.srt.disaggregation.utils import build_transfer_entry_pairs

    from sglang_dflash_pp.srt.disaggregation.mha_layer_ids import (
        decode_mha_layer_ids,
        draft_band,
    )

    prefill = labels(stage_layers, draft)
    src_ids = list(stage_layers) * 2 + (draft_band(N, 2 * DRAFT_LAYERS) if draft else [])
    dst_ids = decode_mha_layer_ids(N, [], len(DECODE))
    pairs = build_transfer_entry_pairs(src_ids, dst_ids, len(prefill), len(DECODE))
    assert [(prefill[i], DECODE[j]) for i, j in pairs] == [(x, x) for x in prefill]

    # 0.5.23 without ids: CommonKVManager.get_mha_kv_ptrs_with_pp splits both lists in halves.
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    shell = SimpleNamespace(kv_args=SimpleNamespace(prefill_start_layer=stage_layers[0]))
    src_k, src_v, dst_k, dst_v, n = CommonKVManager.get_mha_kv_ptrs_with_pp(
        shell, prefill, DECODE
    )
    stock = list(zip(src_k[:n] + src_v[:n], dst_k[:n] + dst_v[:n]))
    assert any(a != b for a, b in stock), stock  # the 0.5.23 bug this module fixes


def _mha_pool(start_layer: int, layers: int, heads: int):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=16, page_size=1, dtype=torch.float32, head_num=heads,
                            head_dim=16, layer_num=layers, device="cpu",
                            enable_memory_saver=False, start_layer=start_layer)  # fmt: skip


def test_build_kv_layer_ids_is_stock_outside_a_dflash_pp_prefill(sglang_with_plugin):
    from sglang.srt.disaggregation import utils
    from sglang.srt.runtime_context import get_context, get_parallel

    target, draft = _mha_pool(2, 2, 4), _mha_pool(0, DRAFT_LAYERS, 2)
    call = dict(token_to_kv_pool=target, draft_token_to_kv_pool=draft,
                num_draft_entries=2 * DRAFT_LAYERS, num_hidden_layers=N)  # fmt: skip
    stock = utils.build_kv_layer_ids.__wrapped__(**call)
    assert stock == []  # 0.5.23 publishes no ids for a plain MHA pool
    cases = [
        (dict(speculative_algorithm="DFLASH", disaggregation_mode="prefill"), 2, [2, 3, 2, 3, 4, 5, 4, 5]),
        (dict(speculative_algorithm="DFLASH", disaggregation_mode="prefill"), 1, stock),
        (dict(speculative_algorithm="DFLASH", disaggregation_mode="decode"), 2, stock),
        (dict(speculative_algorithm="EAGLE", disaggregation_mode="prefill"), 2, stock),
    ]
    for overrides, pp_size, expected in cases:
        override = get_context().override_server_args(**overrides)
        override.install()
        group = SimpleNamespace(world_size=pp_size, rank_in_group=pp_size - 1,
                                is_first_rank=pp_size == 1, is_last_rank=True)  # fmt: skip
        try:
            with get_parallel().override(pp_size=pp_size, pp_rank=pp_size - 1, pp_group=group):
                assert utils.build_kv_layer_ids(**call) == expected, (overrides, pp_size)
        finally:
            override.restore()


def _sides(d_rank: int, path_lens):
    shape = DraftKVShape(total_heads=2, k_head_dim=16, v_head_dim=16, dtype_bytes=4)
    prefill = PrefillSide(
        tp_size=1, tp_rank=0, page_size=1,
        item_lens=[4 * 64] * (2 * N) + [2 * 64] * (2 * DRAFT_LAYERS),
        num_draft_entries=2 * DRAFT_LAYERS, has_layer_ids=True, pp_size=2, pp_rank=1,
        shape=shape,
    )  # fmt: skip
    decode = DecodePeer(tp_size=2, tp_rank=d_rank, item_lens=path_lens,
                        num_entries=len(path_lens), has_layer_ids=True)  # fmt: skip
    return prefill, decode


def test_head_sliced_path_sends_the_draft_by_our_plan(sglang_with_plugin):
    """P TP1 (2 draft heads, 4 target heads per rank) -> D TP2: sglang slices the target; each
    decode rank gets its one draft head packed on P. The decode's target entries are smaller by
    design on this path, which the whole-page path must refuse."""
    from sglang.srt.disaggregation.utils import build_transfer_entry_pairs

    from sglang_dflash_pp.srt.disaggregation.mha_layer_ids import decode_mha_layer_ids

    d_lens = [2 * 64] * (2 * N) + [1 * 64] * (2 * DRAFT_LAYERS)
    src_ids = list(range(N)) * 2 + [4, 5, 4, 5]  # every target layer, then the draft band
    pairs = build_transfer_entry_pairs(src_ids, decode_mha_layer_ids(N, d_lens, len(d_lens)),
                                       len(src_ids), len(d_lens))
    for rank in (0, 1):
        prefill, decode = _sides(rank, d_lens)
        plan = peer_verdict(prefill, decode, pairs, target_path=TargetPath.HEAD_SLICED)
        assert plan.action is PeerAction.HEAD_AWARE
        assert plan.pair.regime is Regime.PACK_SOURCE
        assert sorted(e.dst_index for e in plan.entries) == list(range(2 * N, len(d_lens)))
        with pytest.raises(DraftKVLayoutError, match="target KV entry 0 is 256 B"):
            peer_verdict(prefill, decode, pairs, target_path=TargetPath.WHOLE_PAGES)


def test_target_path_follows_sglangs_dispatch_and_refuses_staging(sglang_with_plugin):
    from sglang_dflash_pp.srt.disaggregation import draft_kv_registration as m

    def manager(mla=False, staging=False, tp=1):
        return SimpleNamespace(is_mla_backend=mla, is_hybrid_mla_backend=False,
                               attn_tp_size=tp, enable_staging=staging)  # fmt: skip

    def peer(tp, staging_ptr=0):
        return SimpleNamespace(dst_attn_tp_size=tp, staging_base_ptr=staging_ptr,
                               staging_total_size=0)  # fmt: skip

    assert m.target_path_of(manager(), peer(1)) is TargetPath.WHOLE_PAGES
    assert m.target_path_of(manager(mla=True), peer(2)) is TargetPath.WHOLE_PAGES
    assert m.target_path_of(manager(), peer(2)) is TargetPath.HEAD_SLICED
    assert m.target_path_of(manager(staging=True), peer(2)) is TargetPath.HEAD_SLICED  # no slots
    with pytest.raises(DraftKVLayoutError, match="unset SGLANG_DISAGG_STAGING_BUFFER"):
        m.target_path_of(manager(staging=True), peer(2, staging_ptr=4096))


def test_send_kvcache_slice_hook_is_stock_without_a_draft_verdict(sglang_with_plugin):
    """No verdict on the peer's registration (no DFLASH draft on this rank, or a peer stock
    serves exactly): the original runs with exactly the arguments it was given."""
    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv as m

    calls = []

    def original(*args):
        calls.append(args)
        return 0

    registration = SimpleNamespace(dst_kv_ptrs=[1, 2, 3])
    self = SimpleNamespace(decode_kv_args_table={"s": registration})
    args = ("s", [0, 1], [1, 2, 3], [5, 6], 1, 2, 64, None, [0, 1, 2])
    assert m.send_kvcache_slice_around(original, self, *args) == 0
    assert calls == [(self, *args)]
    registration.dflash_draft_kv_plan = m.DraftKVPeerPlan(PeerAction.STOCK)
    assert m.send_kvcache_slice_around(original, self, *args) == 0
    assert calls[-1] == (self, *args)
