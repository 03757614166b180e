"""The decode's draft KV as the test-only readout (``cpu_support/draft_kv_readout``) saved it, and
the bound two fp32 prefills of the same request may differ by."""

from __future__ import annotations

import glob
import os

import torch

import e2e_models as models


def read_dumps(dump_dir: str, prefix: str, tp_rank: int = 0) -> dict:
    """``{rid: record}`` of one decode TP rank for the requests whose rid starts ``prefix-``."""
    out = {}
    for path in glob.glob(os.path.join(dump_dir, f"tp{tp_rank}-{prefix}-*.pt")):
        record = torch.load(path)
        out[record["rid"]] = record
    return out


def fp32_draft_kv_tolerance(reference: torch.Tensor) -> float:
    """The largest |difference| accepted between D's draft K (or V) after a PP1 and a PP2
    prefill of the tiny fp32 Llama pair.

    The two prefills differ only in how the context projection ``C = sum_j h_j W_j^T`` is
    summed: one GEMM of ``n = K*H = 192`` terms on PP1, partial sums across stages on PP2
    (everything after it, the hidden norm, the K/V projection, K-norm and RoPE, is the same code
    on the same kind of input). Rounding errors of an n-term fp32 sum grow like ``sqrt(n) * u``
    (``u = 2^-24``) times ``sum|h_i w_i|``; the two orders differ by at most twice that. For
    zero-mean random weights ``sum|h_i w_i|`` is about ``sqrt(n)`` times ``|C|`` (the
    cancellation of n random terms); the hidden RMSNorm and the per-head K RMSNorm each at most
    double a relative error, and the V projection does not amplify it. Relative to the largest
    element: ``2 * sqrt(n) * u * sqrt(n) * 4 = 8 * n * u``, about 9.2e-5 (seen: 4.5e-7). A wrong
    head, token or layer gives an O(1) relative difference.
    """
    n = len(models.TARGET_LAYER_IDS) * models.HIDDEN
    return 8 * n * 2.0**-24 * float(reference.abs().max())
