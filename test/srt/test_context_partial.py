"""PP partial projection vs the stock single GEMM, on the real ``DFlashDraftModel``.

Every way to spread the draft's 6 features over 1..8 PP stages (non-decreasing owner per feature,
the last stage owning at least one, as the ownership rule guarantees) is simulated: the non-last
stages accumulate ``P_s`` with :func:`accumulate_partial`, the last stage stashes ``P_in`` and
calls the real (hooked) ``project_target_hidden`` with only its own features, and the result is
compared with the stock call on the full concat, then carried through each draft layer's
``kv_proj_only -> apply_k_norm -> apply_k_rope`` exactly as the stock sequential KV writer does.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import tiny_models
from sglang_dflash_pp.srt.models.context_partial import (
    accumulate_partial,
    fc_column_block,
)
from sglang_dflash_pp.srt.models.dflash import LastStageContext, stashed, stashed_context

NUM_FEATURES = 6
HIDDEN = tiny_models.HIDDEN
TOKENS = 12
BF16_UNIT_ROUNDOFF = 2.0**-8  # 8 significant bits


def spreads(max_stages=8):
    for num_stages in range(1, max_stages + 1):
        for owners in itertools.combinations_with_replacement(range(num_stages), NUM_FEATURES):
            if owners[-1] == num_stages - 1:
                yield num_stages, owners


ALL_SPREADS = list(spreads())


def test_spread_enumeration_is_complete():
    # Non-decreasing maps of 6 features onto S stages with the last stage used: C(S+4, 5).
    assert len(ALL_SPREADS) == sum(
        len(list(itertools.combinations_with_replacement(range(s), 5))) for s in range(1, 9)
    ) == 1716
    assert (8, (7,) * 6) in ALL_SPREADS  # all on the last stage
    assert (3, (0, 0, 0, 2, 2, 2)) in ALL_SPREADS  # a stage with none in between


@pytest.fixture(scope="module")
def draft_model(single_process_dist, tmp_path_factory):
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.utils.hf_transformers_utils import get_config

    path = tiny_models.write_model_dir(
        str(tmp_path_factory.mktemp("draft6")),
        tiny_models.dflash_draft_config((0, 1, 2, 3, 4, 5)),
    )
    torch.manual_seed(0)
    model = DFlashDraftModel(get_config(path, trust_remote_code=True))
    with torch.no_grad():
        for p in model.parameters():
            # Non-trivial norm gains; random projections.
            p.copy_(torch.randn_like(p) * (0.2 if p.ndim > 1 else 0.5) + (1.0 if p.ndim == 1 else 0))
    return model.eval()


def _features(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(TOKENS, HIDDEN, generator=g).to(dtype) * (1 + j) for j in range(NUM_FEATURES)]


def _pp_context(model, feats, owners, num_stages, carry_dtype):
    """Run the stage chain; returns (ctx, every partial that crossed a hop)."""
    partial, hops = None, []
    for stage in range(num_stages - 1):
        mine = [j for j in range(NUM_FEATURES) if owners[j] == stage]
        local = torch.cat([feats[j] for j in mine], dim=-1) if mine else None
        w = fc_column_block(model.fc.weight, mine, HIDDEN) if mine else None
        partial = accumulate_partial(partial, local, w, carry_dtype)
        if partial is not None:
            hops.append(partial)
    last = [j for j in range(NUM_FEATURES) if owners[j] == num_stages - 1]
    local = torch.cat([feats[j] for j in last], dim=-1)
    context = LastStageContext(fc_column_block(model.fc.weight, last, HIDDEN), partial)
    with stashed_context(model, context):
        ctx = model.project_target_hidden(local)
    assert stashed(model) is None
    return ctx, hops


def _draft_kv(model, ctx):
    positions = torch.arange(TOKENS)
    out = []
    for layer in model.layers:
        attn = layer.self_attn
        k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx))
        k = attn.apply_k_rope(positions, attn.apply_k_norm(k))
        out.append((k, v))
    return out


def _checks_kv(index, num_stages):
    """K/V are a fixed function of the context: check them on a spread sample that covers every
    stage count, and on every 2-stage spread."""
    return index % 11 == 0 or num_stages == 2


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@torch.no_grad()
def test_fp32_pp_path_equals_stock_for_every_spread(draft_model):
    model = draft_model.float()
    feats = _features(torch.float32)
    stock = model.project_target_hidden(torch.cat(feats, dim=-1))
    stock_kv = _draft_kv(model, stock)
    worst_ctx = worst_kv = 0.0
    checked_kv = 0
    for index, (num_stages, owners) in enumerate(ALL_SPREADS):
        ctx, _ = _pp_context(model, feats, owners, num_stages, torch.float32)
        worst_ctx = max(worst_ctx, _rel(ctx, stock))
        if _checks_kv(index, num_stages):
            for (k, v), (ks, vs) in zip(_draft_kv(model, ctx), stock_kv):
                worst_kv = max(worst_kv, _rel(k, ks), _rel(v, vs))
                checked_kv += 1
    assert checked_kv > 200
    assert worst_ctx < 1e-5, worst_ctx
    assert worst_kv < 1e-5, worst_kv


@torch.no_grad()
def test_inert_hook_is_bit_identical_to_stock(draft_model):
    """Nothing stashed: the hooked method returns exactly what the unhooked original does."""
    from sglang.srt.models.dflash import DFlashDraftModel

    hooked = DFlashDraftModel.project_target_hidden
    original = hooked.__wrapped__
    assert original is not hooked
    for dtype in (torch.float32, torch.bfloat16):
        model = draft_model.to(dtype)
        x = torch.cat(_features(dtype, seed=7), dim=-1)
        assert torch.equal(model.project_target_hidden(x), original(model, x))
    with pytest.raises(ValueError, match="feature dim mismatch"):
        draft_model.project_target_hidden(torch.zeros(3, HIDDEN, dtype=torch.bfloat16))


def test_stash_is_cleared_when_the_forward_raises(draft_model):
    ctx = LastStageContext(draft_model.fc.weight[:, :HIDDEN], None)
    with pytest.raises(RuntimeError):
        with stashed_context(draft_model, ctx):
            assert stashed(draft_model) is ctx
            raise RuntimeError("stage forward failed")
    assert stashed(draft_model) is None


# ---- bf16: error bounds derived from the rounding each path performs ------------------------
#
# Let C be the exact fp64 context sum and u = 2^-8. Every GEMM here accumulates in fp32 and its
# accumulation error (~K*H*2^-24 relative) is negligible against u; each rounding to bf16 perturbs
# an element by at most u*|value|. For y = g * x / rms(x) (RMSNorm), a perturbation dx gives, to
# first order, |dy_i| <= |g_i| * max|dx| * (1 + |x_i| / rms(x)) / rms(x).
#   stock:  C rounded to bf16 once (max|dC| <= u*max|C|), norm in fp32, output rounded (u*|y|).
#   PP:     the running sum is rounded once per bf16 hop (r hops: max|dP| <= u * sum_hops max|P_s|;
#           none for an fp32 carry), norm on the fp32 sum, output rounded (u*|y|).
# |ctx_pp - ctx_stock| <= E_stock + E_pp, element-wise; we allow 10% for second-order terms.
# Through a draft layer the difference propagates as: linear |dK| <= |dctx| @ |W|^T plus each
# side's output rounding; per-head K-norm by the RMSNorm rule above; RoPE mixes each rotated pair,
# |d out| <= |d x1| + |d x2| (plus each side's rounding).


def _norm_bound(x, g, dx_max):
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    return g.abs() * dx_max * (1 + x.abs() / rms) / rms


def _ctx_bound(model, feats, hops):
    w = model.fc.weight.double()
    exact = torch.cat([f.double() for f in feats], -1) @ w.t()
    g = model.hidden_norm.weight.double()
    y = g * exact / exact.pow(2).mean(-1, keepdim=True).sqrt()
    u = BF16_UNIT_ROUNDOFF
    e_stock = _norm_bound(exact, g, u * exact.abs().max(-1, keepdim=True).values) + u * y.abs()
    dp = sum((u * h.double().abs().max(-1, keepdim=True).values for h in hops if h.dtype == torch.bfloat16), torch.zeros(()))
    e_pp = _norm_bound(exact, g, dp) + u * y.abs()
    return 1.1 * (e_stock + e_pp) + 1e-6


def _kv_bounds(model, ctx_pp, ctx_stock, ctx_bound):
    """Element-wise bounds on |K_pp - K_stock| and |V_pp - V_stock| per layer."""
    u = BF16_UNIT_ROUNDOFF
    bounds = []
    for layer, (kp, vp), (ks, vs) in zip(model.layers, _draft_kv(model, ctx_pp), _draft_kv(model, ctx_stock)):
        attn = layer.self_attn
        w = attn.qkv_proj.weight.double()
        q_size, kv_size = attn.q_size, attn.kv_size
        w_k, w_v = w[q_size : q_size + kv_size], w[q_size + kv_size : q_size + 2 * kv_size]
        k_pre_s = ctx_stock.double() @ w_k.t()
        d_k_pre = ctx_bound @ w_k.abs().t() + 2 * u * k_pre_s.abs() * 1.01
        d_v = ctx_bound @ w_v.abs().t() + u * (vp.double().abs() + vs.double().abs())
        head_dim = attn.head_dim
        k_heads = k_pre_s.view(TOKENS, -1, head_dim)
        d_heads_max = d_k_pre.view(TOKENS, -1, head_dim).max(-1, keepdim=True).values
        g_k = attn.k_norm.weight.double()
        d_k_norm = _norm_bound(k_heads, g_k, d_heads_max) + 2 * u * (k_heads * g_k / k_heads.pow(2).mean(-1, keepdim=True).sqrt()).abs()
        # RoPE (neox): element i pairs with i +- rotary_dim/2 inside each head.
        half = attn.rotary_emb.rotary_dim // 2
        d_rot = d_k_norm.clone()
        pair = torch.cat([d_k_norm[..., half : 2 * half], d_k_norm[..., :half]], -1)
        d_rot[..., : 2 * half] = d_k_norm[..., : 2 * half] + pair
        d_k = d_rot.reshape(TOKENS, -1) + u * (kp.double().abs() + ks.double().abs())
        bounds.append((1.1 * d_k + 1e-6, 1.1 * d_v + 1e-6))
    return bounds


@pytest.mark.parametrize("carry", [torch.float32, torch.bfloat16], ids=["fp32-carry", "bf16-carry"])
@torch.no_grad()
def test_bf16_pp_path_within_derived_bound_for_every_spread(draft_model, carry):
    model = draft_model.to(torch.bfloat16)
    feats = _features(torch.bfloat16, seed=3)
    stock = model.project_target_hidden(torch.cat(feats, dim=-1))
    stock_kv = _draft_kv(model, stock)
    tightest = 0.0
    checked_kv = 0
    for index, (num_stages, owners) in enumerate(ALL_SPREADS):
        ctx, hops = _pp_context(model, feats, owners, num_stages, carry)
        assert ctx.dtype == torch.bfloat16
        bound = _ctx_bound(model, feats, hops)
        diff = (ctx.double() - stock.double()).abs()
        assert bool((diff <= bound).all()), (num_stages, owners, (diff - bound).max().item())
        tightest = max(tightest, (diff / bound).max().item())
        if _checks_kv(index, num_stages):
            for (kp, vp), (ks, vs), (bk, bv) in zip(_draft_kv(model, ctx), stock_kv, _kv_bounds(model, ctx, stock, bound)):
                assert bool(((kp.double() - ks.double()).abs() <= bk).all()), (num_stages, owners)
                assert bool(((vp.double() - vs.double()).abs() <= bv).all()), (num_stages, owners)
                checked_kv += 1
    assert checked_kv > 200
    # The bound is not vacuous: some spread uses a sizeable share of it.
    assert tightest > 0.02, tightest
