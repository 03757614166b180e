"""The DFlash context as a sum of per-stage partial projections.

``fc(concat(h_0..h_{K-1})) = sum_j h_j W_j^T`` with ``W_j`` the j-th ``[H, H]`` column block of
``fc.weight``. Stage s sends ``P_s = P_{s-1} + sum_{j in J_s} h_j W_j^T`` (one ``[T, H]`` tensor,
whatever the number of features), and only the last stage applies the non-linear ``hidden_norm``.

Numerics. The stock single GEMM accumulates in fp32 and rounds ``C`` once to the model dtype before
the norm. Here every partial is produced in fp32 directly (no rounding of a stage's contribution),
the carry between stages is ``SGLANG_DFLASH_PP_CARRY_DTYPE`` (``float32`` by default: a bf16 carry
rounds the running sum once per hop), and the last stage adds its own partial in fp32 and normalises
the fp32 sum before handing the model dtype to the stock KV writer.

Pure: torch only, so the same code runs in the GPU benchmarks where sglang is not installed.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

CARRY_DTYPE_ENV = "SGLANG_DFLASH_PP_CARRY_DTYPE"
CARRY_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_CARRY_DTYPE = "float32"


def carry_dtype_from_env() -> torch.dtype:
    name = os.environ.get(CARRY_DTYPE_ENV, DEFAULT_CARRY_DTYPE).strip().lower()
    if name not in CARRY_DTYPES:
        raise ValueError(
            f"{CARRY_DTYPE_ENV}={name!r} is not supported; use one of "
            f"{sorted(CARRY_DTYPES)} (default {DEFAULT_CARRY_DTYPE})."
        )
    return CARRY_DTYPES[name]


def feature_columns(features: Sequence[int], hidden: int) -> slice:
    """The ``fc.weight`` columns of ``features``. A stage captures a run of consecutive layers and
    the ids are ascending, so its features are always consecutive: one slice, no copy."""
    features = list(features)
    if not features:
        raise ValueError("a stage without features has no fc columns")
    if features != list(range(features[0], features[0] + len(features))):
        raise ValueError(f"features {features} are not consecutive fc column blocks")
    return slice(features[0] * hidden, (features[-1] + 1) * hidden)


def fc_column_block(fc_weight: torch.Tensor, features: Sequence[int], hidden: int) -> torch.Tensor:
    """``[H, k*H]`` view of the column blocks of ``fc.weight`` for ``features``."""
    return fc_weight[:, feature_columns(features, hidden)]


def project_fp32(
    local: torch.Tensor, w_block: torch.Tensor, add_to: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``add_to + local @ w_block^T`` accumulated and returned in fp32, never rounded to the model
    dtype.

    On CUDA the half-precision GEMM writes fp32 directly (``out_dtype``) and adds ``add_to`` in its
    epilogue, so a stage costs one GEMM at half-precision speed and no extra pass over the carry;
    elsewhere the operands are upcast."""
    if local.is_cuda and local.dtype in (torch.bfloat16, torch.float16) and _gemm_writes_fp32():
        if add_to is None:
            return torch.mm(local, w_block.t(), out_dtype=torch.float32)
        return torch.addmm(add_to.float(), local, w_block.t(), out_dtype=torch.float32)
    total = F.linear(local.float(), w_block.float())
    return total if add_to is None else total + add_to.float()


@functools.lru_cache(maxsize=None)
def _gemm_writes_fp32() -> bool:
    """Whether this torch build has half-precision GEMMs with an fp32 output (CUDA only)."""
    a = torch.ones(2, 2, device="cuda", dtype=torch.bfloat16)
    c = torch.zeros(2, 2, device="cuda", dtype=torch.float32)
    try:
        return (
            torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
            and torch.addmm(c, a, a, out_dtype=torch.float32).dtype == torch.float32
        )
    except (TypeError, RuntimeError):
        return False


def accumulate_partial(
    partial_in: Optional[torch.Tensor],
    local: Optional[torch.Tensor],
    w_block: Optional[torch.Tensor],
    carry_dtype: torch.dtype,
) -> Optional[torch.Tensor]:
    """``P_s`` in ``carry_dtype``; None when no stage up to this one owns a feature."""
    if local is None:
        if partial_in is None:
            return None
        return partial_in.to(carry_dtype)
    return project_fp32(local, w_block, add_to=partial_in).to(carry_dtype)


def finish_context(
    partial_in: Optional[torch.Tensor],
    local: torch.Tensor,
    w_block: torch.Tensor,
    hidden_norm: Callable[[torch.Tensor], torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Last stage: ``hidden_norm(P_in + local @ W_last^T)`` with the sum and the norm in fp32.

    ``partial_in`` may carry more rows than ``local`` (the stock writer trims trailing padding
    rows before projecting); the same leading rows are used."""
    n = local.shape[0]
    if partial_in is not None:
        if partial_in.shape[0] < n or partial_in.shape[1] != w_block.shape[0]:
            raise ValueError(
                f"DFLASH PP context partial has shape {tuple(partial_in.shape)}, but the last "
                f"stage projects {n} rows of width {w_block.shape[0]}."
            )
        partial_in = partial_in[:n]
    return hidden_norm(project_fp32(local, w_block, add_to=partial_in)).to(out_dtype)
