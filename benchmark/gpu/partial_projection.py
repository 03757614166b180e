"""Partial projection of the DFlash context at Kimi-K3 size on one GPU: numerics and GEMM time.

Production geometry: H = 7168, 6 features, one feature on each of PP stages 1, 3, 4, 5, 6, 7 (the
Kimi-K3 PP8 split), T in {1024, 8192}. Against an fp64 reference of ``RMSNorm(concat(h) W^T)`` and
of one draft layer's K (K-norm + neox RoPE) and V, for:

* ``stock``: the single bf16 GEMM (fp32 accumulate, one rounding of C), norm in fp32, bf16 out;
* ``pp_bf16_carry``: our path with ``SGLANG_DFLASH_PP_CARRY_DTYPE=bfloat16`` (running sum rounded
  to bf16 on every hop);
* ``pp_fp32_carry_bf16_partials``: each stage's partial rounded to bf16 by a bf16 GEMM, summed in
  fp32 (the first probe's variant);
* ``pp_fp32_carry``: our implementation (``accumulate_partial`` / ``finish_context``): partials
  produced in fp32 directly, fp32 carry, fp32 norm.

Times: the per-stage GEMMs (each stage's ``accumulate_partial`` plus the last stage's projection)
summed, against the single fused GEMM, in the same run. Needs only torch (no sglang):

    PYTHONPATH=python python3 benchmark/gpu/partial_projection.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch
from cuda_timing import samples_ms
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import provenance  # noqa: E402

from sglang_dflash_pp.srt.models.context_partial import (
    _gemm_writes_fp32,
    accumulate_partial,
    fc_column_block,
    finish_context,
)

H = 7168
K = 6
OWNERS = (1, 3, 4, 5, 6, 7)  # stage owning each feature (Kimi-K3, PP8, ids 19..90)
PP = 8
KV_HEADS, HEAD_DIM = 8, 128
EPS = 1e-6


def rms_norm(x, weight, out_dtype):
    """RMSNorm in fp32 with the weight multiply before the cast (sglang RMSNorm semantics)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return (x32 * weight.float()).to(out_dtype)


def rope_neox(k, positions, theta=1e6):
    """Rotate-half RoPE over the whole head dim."""
    d = k.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=k.device, dtype=torch.float64) / d))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(k.dtype), ang.sin().to(k.dtype)
    x1, x2 = k[..., : d // 2], k[..., d // 2 :]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def draft_kv(ctx, w_kv, k_norm_w, positions, dtype):
    """One draft layer's context K (K-norm, RoPE) and V, computed in ``dtype``."""
    kv = F.linear(ctx.to(dtype), w_kv.to(dtype))
    k, v = kv.split(KV_HEADS * HEAD_DIM, dim=-1)
    k = k.view(-1, KV_HEADS, HEAD_DIM)
    k = rms_norm(k, k_norm_w, dtype) if dtype != torch.float64 else _rms64(k, k_norm_w)
    return rope_neox(k, positions).reshape(k.shape[0], -1), v


def _rms64(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def stage_features(stage):
    return [j for j, s in enumerate(OWNERS) if s == stage]


def pp_context(feats, w, norm_w, variant):
    """Run the stage chain for one variant; returns the normalised context (bf16)."""
    partial = None
    for stage in range(PP - 1):
        mine = stage_features(stage)
        if variant == "pp_fp32_carry_bf16_partials":
            if mine:
                local = torch.cat([feats[j] for j in mine], -1)
                p = F.linear(local, fc_column_block(w, mine, H)).float()  # bf16 GEMM output
                partial = p if partial is None else partial + p
            continue
        carry = torch.bfloat16 if variant == "pp_bf16_carry" else torch.float32
        local = torch.cat([feats[j] for j in mine], -1) if mine else None
        w_s = fc_column_block(w, mine, H) if mine else None
        partial = accumulate_partial(partial, local, w_s, carry)
    last = stage_features(PP - 1)
    local = torch.cat([feats[j] for j in last], -1)
    w_last = fc_column_block(w, last, H)
    norm = lambda x: rms_norm(x, norm_w, torch.float32)  # noqa: E731  (fp32 in, fp32 out)
    if variant == "pp_fp32_carry_bf16_partials":
        total = partial + F.linear(local, w_last).float()
        return rms_norm(total, norm_w, torch.bfloat16)
    return finish_context(partial, local, w_last, norm, torch.bfloat16)


def errors(x, ref):
    d = (x.double() - ref).float()
    return {
        "rel_fro": (d.norm() / ref.float().norm()).item(),
        "max_abs": d.abs().max().item(),
    }


ITERS, WARMUP = 50, 10
SAMPLES: dict = {}  # label -> raw samples (ms) of the run in progress


def bench(fn, label):
    SAMPLES[label] = samples_ms(fn, iters=ITERS, warmup=WARMUP)
    return statistics.median(SAMPLES[label])


def make_data(T, g, data, dev="cuda"):
    """``independent``: feature j is N(0, (0.5 + j)^2), fc random. ``shared_stream``: the
    captures are one residual stream read at six depths (a shared component 8x larger than each
    layer's own part), and fc's blocks sum to ~0 on it, so the partial sums are much larger than the
    final context (the cancellation a trained fc can exhibit; it is what a low-precision carry
    amplifies)."""
    w = torch.randn(H, K * H, device=dev, generator=g) / math.sqrt(K * H)
    if data == "independent":
        feats = [torch.randn(T, H, device=dev, generator=g) * (0.5 + j) for j in range(K)]
    else:
        stream = torch.randn(T, H, device=dev, generator=g) * 8.0
        feats = [stream + torch.randn(T, H, device=dev, generator=g) for _ in range(K)]
        blocks = w.view(H, K, H)
        w = (blocks - 0.98 * blocks.mean(dim=1, keepdim=True)).reshape(H, K * H)
    return [f.to(torch.bfloat16) for f in feats], w.to(torch.bfloat16)


def run(T, data, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    feats, w = make_data(T, g, data)
    norm_w = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).to(torch.bfloat16)
    w_kv = (torch.randn(2 * KV_HEADS * HEAD_DIM, H, device=dev, generator=g) / math.sqrt(H)).to(torch.bfloat16)
    k_norm_w = (1 + 0.1 * torch.randn(HEAD_DIM, device=dev, generator=g)).to(torch.bfloat16)
    positions = torch.arange(T, device=dev)

    x = torch.cat(feats, -1)
    c64 = x.double() @ w.double().t()
    ctx64 = _rms64(c64, norm_w)
    k64, v64 = draft_kv(ctx64, w_kv.double(), k_norm_w, positions, torch.float64)

    out = {"T": T, "data": data, "variants": {}}
    stock = rms_norm(F.linear(x, w), norm_w, torch.bfloat16)
    variants = {"stock": stock}
    for name in ("pp_bf16_carry", "pp_fp32_carry_bf16_partials", "pp_fp32_carry"):
        variants[name] = pp_context(feats, w, norm_w, name)
    for name, ctx in variants.items():
        k, v = draft_kv(ctx, w_kv, k_norm_w, positions, torch.bfloat16)
        out["variants"][name] = {
            "ctx": errors(ctx, ctx64),
            "k": errors(k, k64),
            "v": errors(v, v64),
        }
    base = out["variants"]["stock"]
    for name, e in out["variants"].items():
        e["ratio_to_stock"] = {part: e[part]["rel_fro"] / base[part]["rel_fro"] for part in ("ctx", "k", "v")}

    # Time: the stages' projections (ours, as they run on each stage) vs the single GEMM.
    stage_inputs = []
    for stage in range(PP):
        mine = stage_features(stage)
        if mine:
            stage_inputs.append((torch.cat([feats[j] for j in mine], -1), fc_column_block(w, mine, H)))
    p_in = torch.zeros(T, H, device=dev, dtype=torch.float32)
    SAMPLES.clear()
    single = bench(lambda: F.linear(x, w), "single_gemm")
    # As the stages run: the first owner has no inbound partial, later ones add theirs to it.
    per_stage = [
        bench(
            lambda l=l, ws=ws, i=i: accumulate_partial(p_in if i else None, l, ws, torch.float32),
            f"per_stage_fp32_partials[{i}]",
        )
        for i, (l, ws) in enumerate(stage_inputs)
    ]
    per_stage_bf16_gemm = [
        bench(lambda l=l, ws=ws: F.linear(l, ws), f"per_stage_bf16_gemm[{i}]")
        for i, (l, ws) in enumerate(stage_inputs)
    ]
    # Alternatives for an fp32 carry: fp32-out GEMM then an in-place add; bf16 GEMM then fp32 add.
    per_stage_mm_then_add = [
        bench(lambda l=l, ws=ws, i=i: torch.mm(l, ws.t(), out_dtype=torch.float32).add_(p_in) if i else torch.mm(l, ws.t(), out_dtype=torch.float32), f"per_stage_fp32_mm_then_add[{i}]")
        for i, (l, ws) in enumerate(stage_inputs)
    ]
    per_stage_bf16_then_fp32_add = [
        bench(lambda l=l, ws=ws, i=i: F.linear(l, ws).float().add_(p_in) if i else F.linear(l, ws).float(), f"per_stage_bf16_gemm_then_fp32_add[{i}]")
        for i, (l, ws) in enumerate(stage_inputs)
    ]
    out["time_ms"] = {
        "single_gemm": single,
        "per_stage_fp32_partials": per_stage,
        "sum_per_stage_fp32_partials": sum(per_stage),
        "per_stage_bf16_gemm": per_stage_bf16_gemm,
        "sum_per_stage_bf16_gemm": sum(per_stage_bf16_gemm),
        "sum_per_stage_fp32_mm_then_add": sum(per_stage_mm_then_add),
        "sum_per_stage_bf16_gemm_then_fp32_add": sum(per_stage_bf16_then_fp32_add),
    }
    out["samples_ms"] = dict(SAMPLES)
    out["time_ratio_fp32_partials_vs_single"] = sum(per_stage) / single
    out["time_ratio_bf16_gemms_vs_single"] = sum(per_stage_bf16_gemm) / single
    out["time_ratio_fp32_mm_then_add_vs_single"] = sum(per_stage_mm_then_add) / single
    out["time_ratio_bf16_gemm_then_fp32_add_vs_single"] = sum(per_stage_bf16_then_fp32_add) / single
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {
        "provenance": provenance.record(
            repetitions=ITERS,
            warmup=WARMUP,
            timed_sources=["python/sglang_dflash_pp/srt/models/context_partial.py"],
            timed="CUDA events around each call; time_ms values are medians of samples_ms",
        ),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gemm_writes_fp32": _gemm_writes_fp32(),
        "runs": [
            run(int(t), data) for data in ("independent", "shared_stream") for t in args.tokens.split(",")
        ],
    }
    print(json.dumps(results, indent=1))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
