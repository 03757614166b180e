"""The startup-assertion rules ``check`` evaluates, against the stock code they mirror.

Each oracle is sglang 0.5.23's own code: ``DFlashAttention.__init__`` for the head rule,
``resolve_draft_parallel_layout`` for where the draft runs, ``_get_dflash_layer_attention_params``
for the layer types. Where that code reads the runtime context (published only inside a
running server), the test hands it a ``SimpleNamespace`` with the few widths it reads: a thin
stand-in, because nothing publishes a TP32 context on a CPU.
"""

from __future__ import annotations

import types

import pytest

from sglang_dflash_pp.srt.disaggregation.draft_kv_pool_kind import (
    draft_pool_kind,
    pool_transfer_refusal,
)
from sglang_dflash_pp.srt.speculative.attention_tp_rules import (
    DraftAttentionTP,
    DraftModelShape,
    draft_attention_tp,
    draft_tp_refusal,
    heads_over_tp_problem,
    width_over_tp_problem,
)
from sglang_dflash_pp.srt.speculative.draft_config_checks import draft_layer_types_refusal


def _draft_config(**kw):
    from transformers import PretrainedConfig

    base = dict(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=16,
        intermediate_size=256, num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512,
    )  # fmt: skip
    base.update(kw)
    return PretrainedConfig(**base)


def _stock_attention_refuses(monkeypatch, heads: int, kv: int, tp: int) -> bool:
    """Whether stock ``DFlashAttention`` raises its head assertion at draft TP ``tp``. Past the
    assertions it goes on to build ``QKVParallelLinear``, which needs a published TP group and
    fails otherwise: that is "not refused by the head rule"."""
    import sglang.srt.models.dflash as dflash

    monkeypatch.setattr(dflash, "get_parallel", lambda: types.SimpleNamespace(tp_size=tp))
    cfg = _draft_config(num_attention_heads=heads, num_key_value_heads=kv)
    try:
        dflash.DFlashAttention(cfg, 0)
    except AssertionError as e:
        assert "DFlashAttention requires" in str(e), e
        return True
    except Exception:
        return False
    return False


def test_head_rule_matches_stock_dflash_attention(sglang_with_plugin, monkeypatch):
    cases = [
        (h, kv, tp)
        for h in (8, 24, 32, 56, 64)
        for kv in (1, 2, 8)
        for tp in (1, 2, 3, 4, 8, 16, 32)
    ]
    refused = 0
    for h, kv, tp in cases:
        stock = _stock_attention_refuses(monkeypatch, h, kv, tp)
        assert (heads_over_tp_problem(h, kv, tp) is not None) == stock, (h, kv, tp)
        refused += stock
    assert 0 < refused < len(cases)
    # The deployment's case: 56 query heads at the decode's TP32 are refused, 64 are not.
    assert _stock_attention_refuses(monkeypatch, 56, 8, 32)
    assert not _stock_attention_refuses(monkeypatch, 64, 8, 32)


@pytest.mark.parametrize(
    "tp, attn_dp, attn_cp, expected",
    [(32, 1, 1, 32), (32, 4, 1, 8), (8, 1, 2, 8), (8, 2, 2, 2), (4, 1, 1, 4)],
)
def test_draft_tp_follows_stock_draft_placement(
    sglang_with_plugin, monkeypatch, tp, attn_dp, attn_cp, expected
):
    """Stock ``resolve_draft_parallel_layout`` for the DFlash draft's declared spec: the draft
    group's width when it gets its own group, else the target TP that DFlashAttention reads."""
    import sglang.srt.runtime_context as runtime_context
    import sglang.srt.speculative.draft_parallel as draft_parallel
    from sglang.srt.models.dflash import DFlashDraftModel

    attn_tp = tp // attn_dp // attn_cp
    parallel = types.SimpleNamespace(
        tp_size=tp, attn_tp_size=attn_tp, attn_dp_size=attn_dp, attn_cp_size=attn_cp,
        attn_dp_enabled=attn_dp > 1, enable_prefill_cp=False,
        tp_group=types.SimpleNamespace(world_size=tp),
        attn_tp_group=types.SimpleNamespace(world_size=attn_tp),
    )  # fmt: skip
    monkeypatch.setattr(draft_parallel, "get_parallel", lambda: parallel)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: parallel)
    layout = draft_parallel.resolve_draft_parallel_layout(
        DFlashDraftModel.draft_parallel_spec, collapse_cp=True
    )
    stock = layout.attn_tp_size if layout.tp_group is not None else tp
    ours = draft_attention_tp(
        tp_size=tp, attn_tp_size=attn_tp, attn_dp_size=attn_dp, attn_cp_size=attn_cp
    )
    assert ours.size == stock == expected


@pytest.mark.parametrize(
    "layer_types, window",
    [
        (None, None),
        (["sliding_attention"] * 2, 4096),
        (["sliding_attention"] * 2, None),
        (["full_attention"], None),
        (["full_attention", "linear_attention"], None),
        (["full_attention", "sliding_attention"], 128),
    ],
)
def test_layer_types_rule_matches_stock(sglang_with_plugin, layer_types, window):
    import sglang.srt.models.dflash as dflash

    # transformers validates len(layer_types) == num_hidden_layers; the draft has 2 layers
    # either way, and stock checks each layer id against layer_types itself.
    kw = {}
    if layer_types is not None:
        kw = dict(layer_types=layer_types, num_hidden_layers=len(layer_types))
    cfg = _draft_config(sliding_window=window, **kw)
    try:
        for layer in range(2):
            dflash._get_dflash_layer_attention_params(cfg, layer)
        stock_refuses = False
    except (ValueError, AssertionError):
        stock_refuses = True
    ours = draft_layer_types_refusal(layer_types, window, 2, where="/d")
    assert (ours is not None) == stock_refuses, ours
    if ours:
        assert "config.json" in ours


def test_draft_tp_refusal_names_the_file_and_the_flags():
    shape = DraftModelShape(num_heads=56, num_kv_heads=8, intermediate_size=18432)
    msg = draft_tp_refusal(
        shape, DraftAttentionTP(32, "the target's TP group"), side="decode",
        draft_config="/m/draft/config.json", tp_flag="--tp-size 32",
    )  # fmt: skip
    assert "56 query heads are not divisible by TP 32" in msg
    assert "/m/draft/config.json" in msg and "--tp-size 32" in msg
    # 8 divides 56 and the 8 KV heads; 56 has no divisor in 9..32 that 8 KV heads allow.
    assert "largest: 8" in msg and "--attn-dp-size 4" in msg
    ok = DraftModelShape(num_heads=64, num_kv_heads=8, intermediate_size=18432)
    assert draft_tp_refusal(ok, DraftAttentionTP(32, "g"), side="decode", draft_config="c",
                            tp_flag="f") is None  # fmt: skip
    assert width_over_tp_problem("intermediate_size", 18432, 32) is None  # 576 per rank
    narrow = DraftModelShape(num_heads=64, num_kv_heads=8, intermediate_size=100)
    assert "intermediate_size 100" in draft_tp_refusal(
        narrow, DraftAttentionTP(32, "g"), side="decode", draft_config="c", tp_flag="f"
    )


def test_draft_pool_kind_and_the_transfer_verdict(sglang_with_plugin):
    from sglang.srt.mem_cache import kv_cache_configurator  # the module that picks the class

    plain = draft_pool_kind(draft_kv_cache_dtype="bf16")
    assert plain.plain is True and plain.name.startswith("MHATokenToKVPool")
    cases = {
        "MHATokenToKVPoolMXFP8": dict(draft_kv_cache_dtype="mxfp8"),
        "NoOpMHATokenToKVPool": dict(draft_kv_cache_dtype="auto", prefill_only_disable_kv_cache=True),
        "PageMajorMHATokenToKVPool": dict(draft_kv_cache_dtype="auto", enable_page_major_kv_layout=True),
        "PageInterleaveMHATokenToKVPool": dict(draft_kv_cache_dtype="auto", enable_kv_cache_sharding=True),
        "MHATokenToKVPool with": dict(draft_kv_cache_dtype="nvfp4"),
        "MHATokenToKVPool in HND": dict(draft_kv_cache_dtype="auto", use_hnd_kv_cache=True),
    }  # fmt: skip
    for name, kw in cases.items():
        kind = draft_pool_kind(**kw)
        assert kind.plain is False and kind.name.startswith(name), kind
        assert isinstance(getattr(kv_cache_configurator, name.split()[0]), type), name
        assert pool_transfer_refusal(kind, prefill_draft_tp=4, decode_draft_tp=4) is None
        msg = pool_transfer_refusal(kind, prefill_draft_tp=4, decode_draft_tp=32)
        assert kind.setting in msg and "(4)" in msg and "32" in msg
    assert pool_transfer_refusal(plain, prefill_draft_tp=4, decode_draft_tp=32) is None
    unified = draft_pool_kind(draft_kv_cache_dtype="auto", enable_unified_memory=True)
    assert unified.plain is None
    assert pool_transfer_refusal(unified, prefill_draft_tp=4, decode_draft_tp=32) is None
