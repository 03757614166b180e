"""The fused Triton pack kernel moves exactly the bytes of the torch fallback.

The kernel is the GPU path; here it runs under Triton's interpreter (``TRITON_INTERPRET=1``, set
in a subprocess because Triton reads it when kernels are defined), on CPU tensors, against both
``pack_row_slices`` and an independent gather written with plain indexing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from sglang_dflash_pp.srt.disaggregation import draft_kv_pack_triton as fused
from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import as_byte_rows

CASES = r"""
import json, torch
from sglang_dflash_pp.srt.disaggregation import draft_kv_pack_triton as fused
from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import (
    as_byte_rows,
    pack_row_slices_index_select as pack_row_slices,
)

torch.manual_seed(0)
results = []
# (heads on the source rank, head dim, heads per slice, entries, rows)
for heads, dim, take, entries, rows in [
    (2, 128, 1, 12, [5, 6, 7, 64, 65, 66, 67, 3]),      # TP4 -> TP32: one of two heads
    (8, 64, 2, 3, list(range(40, 72))),                # TP1 -> TP4: two of eight heads
    (2, 128, 2, 2, [9]),                               # equal heads: the whole row
    (4, 32, 1, 5, [1, 1, 2, 200, 0]),                  # repeated and unordered rows
    (2, 128, 1, 3, []),                                # empty request
]:
    pools = [torch.randn(256, heads, dim).to(torch.bfloat16) for _ in range(entries)]
    sources = [as_byte_rows(p) for p in pools]
    slice_bytes = take * dim * 2
    r = torch.tensor(rows, dtype=torch.int64)
    for first in range(0, heads, take):
        offsets = [first * dim * 2] * entries
        widths = [slice_bytes] * entries
        a = torch.zeros(entries * len(rows) * slice_bytes + 8, dtype=torch.uint8)
        b = torch.zeros_like(a)
        sa = pack_row_slices(sources, r, offsets, widths, a)
        sb = fused.pack_row_slices_fused(sources, r, offsets, widths, b)
        reference = torch.cat(
            [p[r][:, first : first + take, :].contiguous().view(torch.uint8).reshape(-1) for p in pools]
            or [torch.zeros(0, dtype=torch.uint8)]
        )
        n = reference.numel()
        results.append(dict(
            case=[heads, dim, take, entries, len(rows), first],
            slabs_equal=sa == sb,
            fused_equals_fallback=bool(torch.equal(a, b)),
            fused_equals_reference=bool(torch.equal(b[:n], reference)),
            tail_untouched=bool((b[n:] == 0).all()),
            bytes=n,
        ))
# The send path's shape: every distinct head slice of a chunk in one call (the sources repeated,
# one offset per slice), then the same cached table for other rows at another output offset.
pools = [torch.randn(256, 2, 128).to(torch.bfloat16) for _ in range(12)]
sources = [as_byte_rows(p) for p in pools]
both = sources * 2
offsets = [0] * 12 + [256] * 12
for rows, at in (([5, 6, 7, 64], 0), ([100, 3, 3, 200, 9], 4096)):
    r = torch.tensor(rows, dtype=torch.int64)
    b = torch.zeros(at + 24 * len(rows) * 256 + 8, dtype=torch.uint8)
    sb = fused.pack_row_slices_fused(both, r, offsets, [256] * 24, b[at:])
    reference = torch.cat(
        [p[r][:, h, :].contiguous().view(torch.uint8).reshape(-1) for h in (0, 1) for p in pools]
    )
    n = reference.numel()
    results.append(dict(
        case=["both slices", len(rows), at],
        slabs_equal=sb == [e * len(rows) * 256 for e in range(24)],
        fused_equals_fallback=bool((b[:at] == 0).all()),
        fused_equals_reference=bool(torch.equal(b[at : at + n], reference)),
        tail_untouched=bool((b[at + n :] == 0).all()),
        bytes=n,
    ))
# The CUDA-graph form's launch: grid for a bucket of rows, the row count read on the device
# (the graph itself needs a GPU; its launch is this one).
pack = fused.FusedPack(both, offsets, [256] * 24, torch.device("cpu"))
rows = [7, 1, 250, 3, 3]
n_and_rows = torch.tensor([len(rows)] + rows + [0] * (64 - len(rows)), dtype=torch.int64)
b = torch.zeros(24 * 64 * 256, dtype=torch.uint8)
pack.launch(n_and_rows[1:], b, 64, n_ptr=n_and_rows)
r = torch.tensor(rows, dtype=torch.int64)
reference = torch.cat(
    [p[r][:, h, :].contiguous().view(torch.uint8).reshape(-1) for h in (0, 1) for p in pools]
)
n = reference.numel()
results.append(dict(
    case=["row count on the device", len(rows), 64],
    slabs_equal=True,
    fused_equals_fallback=True,
    fused_equals_reference=bool(torch.equal(b[:n], reference)),
    tail_untouched=bool((b[n:] == 0).all()),
    bytes=n,
))
print(json.dumps(results))
"""


def test_fused_kernel_bytes_equal_the_fallback_and_a_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", CASES], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 2 + 4 + 1 + 4 + 2 + 2 + 1
    for r in results:
        assert r["fused_equals_fallback"] and r["fused_equals_reference"], r
        assert r["slabs_equal"] and r["tail_untouched"], r
    assert sum(r["bytes"] for r in results) > 100_000


def test_kernel_is_offered_only_for_uniform_aligned_cuda_slices():
    pools = [as_byte_rows(torch.zeros(16, 2, 128, dtype=torch.bfloat16)) for _ in range(2)]
    out = torch.empty(1 << 16, dtype=torch.uint8)
    # CPU tensors never take the kernel outside the interpreter.
    assert not fused.available(out)
    assert not fused.eligible(pools, [0, 0], [256, 256], out)
    # The alignment rules, checked as the GPU path would see them.
    assert fused._aligned(pools, [0, 256], 256, out)
    assert not fused._aligned(pools, [2, 0], 256, out)  # a 2-byte offset
    assert not fused._aligned(pools, [0, 0], 250, out)  # a width that is not whole words


def test_pack_row_slices_takes_the_kernel_whenever_it_is_eligible(monkeypatch):
    from sglang_dflash_pp.srt.disaggregation import draft_kv_pack

    calls = []
    monkeypatch.setattr(fused, "eligible", lambda *a: True)
    monkeypatch.setattr(fused, "pack_row_slices_fused", lambda *a: calls.append(a) or [0])
    pools = [as_byte_rows(torch.zeros(4, 2, 8, dtype=torch.bfloat16))]
    assert draft_kv_pack.pack_row_slices(pools, torch.tensor([0]), [0], [16], torch.empty(64, dtype=torch.uint8)) == [0]
    assert len(calls) == 1
