"""The fused Triton pack kernel moves exactly the bytes of the torch fallback.

The kernel is the GPU path; here it runs under Triton's interpreter (``TRITON_INTERPRET=1``, set
in a subprocess because Triton reads it when kernels are defined), on CPU tensors, against both
``pack_row_slices_index_select`` and an independent gather written with plain indexing.
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
        sb = fused.FusedPack(sources, offsets, widths, b.device)(r, b)
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
# one offset per slice), one prepared table for other rows at other output offsets of one slot
# (the kernel's row count and output offset are run-time arguments, not specialisations).
pools = [torch.randn(256, 2, 128).to(torch.bfloat16) for _ in range(12)]
sources = [as_byte_rows(p) for p in pools]
both = sources * 2
offsets = [0] * 12 + [256] * 12
pack = fused.FusedPack(both, offsets, [256] * 24, torch.device("cpu"))
slot = torch.zeros(4096 + 24 * 5 * 256 + 8, dtype=torch.uint8)
for rows, at in (([5, 6, 7, 64], 0), ([100, 3, 3, 200, 9], 4096), ([7], 8)):
    r = torch.tensor(rows, dtype=torch.int64)
    slot.zero_()
    sb = pack(r, slot, at)
    reference = torch.cat(
        [p[r][:, h, :].contiguous().view(torch.uint8).reshape(-1) for h in (0, 1) for p in pools]
    )
    n = reference.numel()
    results.append(dict(
        case=["both slices", len(rows), at],
        slabs_equal=sb == [at + e * len(rows) * 256 for e in range(24)],
        fused_equals_fallback=bool((slot[:at] == 0).all()),
        fused_equals_reference=bool(torch.equal(slot[at : at + n], reference)),
        tail_untouched=bool((slot[at + n :] == 0).all()),
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
    assert len(results) == 2 + 4 + 1 + 4 + 2 + 3
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


def test_a_prepared_pack_takes_the_kernel_whenever_it_is_eligible(monkeypatch):
    """The send path's packs (``PreparedPacks``) are the fused kernel where it applies and
    torch's gather otherwise (the CPU here: the torch pack writes the right bytes)."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import PreparedPacks
    from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVGeometry

    pools = [torch.arange(16 * 2 * 8, dtype=torch.int16).reshape(16, 2, 8) + 500 * e for e in (0, 1)]
    sources = [as_byte_rows(p) for p in pools]
    geometry = DraftKVGeometry("prefill", 1, 0, 2, 8, 8, 2, 4)
    out = torch.zeros(1024, dtype=torch.uint8)
    torch_packs = PreparedPacks(sources, geometry, out)
    partition = next(iter(torch_packs.partitions.values()))
    pack = torch_packs.pack(partition)
    assert not isinstance(pack, fused.FusedPack)
    offsets = pack(torch.tensor([3, 0]), out, 64)
    assert offsets == [64 + i * 2 * 16 for i in range(4)]  # (head, entry) slabs of 2 rows x 16 B
    got = out[64 : 64 + 32].view(torch.int16).reshape(2, 8)
    assert torch.equal(got, pools[0][[3, 0], 0, :])  # head 0 of K for rows 3 and 0

    made = []

    class Recording:
        def __init__(self, *args):
            made.append(args)

    monkeypatch.setattr(fused, "eligible", lambda *a: True)
    monkeypatch.setattr(fused, "FusedPack", Recording)
    fused_packs = PreparedPacks(sources, geometry, out)
    assert all(isinstance(p, Recording) for p in fused_packs._packs.values())
    assert len(made) == 3  # both heads at once, and each alone


def test_the_kernel_compiles_once_per_width_whatever_the_rows_and_offsets():
    """No pack may compile while serving: the row count and the slab offset are run-time
    arguments the JIT does not specialise on, so one compile per slice width and launch form
    (done at startup by ``PreparedPacks.warm``) serves every chunk."""
    params = {p.name: p for p in fused._pack_rows_kernel.params}
    assert params["n_rows"].do_not_specialize and params["out_word"].do_not_specialize
    constexprs = {name for name, p in params.items() if p.is_constexpr}
    # Fixed by the slice width, and whether the count comes from the device (the graphs).
    assert constexprs == {"WIDTH", "BLOCK_COLS", "BLOCK_ROWS", "ARGS_ON_DEVICE"}


DEVICE_ARGS = r"""
import json, torch
from sglang_dflash_pp.srt.disaggregation import draft_kv_pack_triton as fused
from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import as_byte_rows

torch.manual_seed(1)
pools = [torch.randn(128, 2, 64).to(torch.bfloat16) for _ in range(4)]
pack = fused.FusedPack([as_byte_rows(p) for p in pools], [128] * 4, [128] * 4, torch.device("cpu"))
out = []
for rows, at, bucket in (([3, 9, 9, 100], 64, 16), ([7], 0, 16), (list(range(20, 36)), 8, 16)):
    args = torch.tensor([len(rows), at // 8] + rows + [0] * (bucket - len(rows)), dtype=torch.int64)
    slot = torch.zeros(16 * 1024, dtype=torch.uint8)
    pack.launch(None, slot, bucket, args=args)  # the graphs' launch: grid for the bucket
    r = torch.tensor(rows)
    want = torch.cat([p[r][:, 1, :].contiguous().view(torch.uint8).reshape(-1) for p in pools])
    n = want.numel()
    out.append(dict(ok=bool(torch.equal(slot[at : at + n], want)),
                    untouched=bool((slot[:at] == 0).all() and (slot[at + n :] == 0).all())))
print(json.dumps(out))
"""


def test_the_graphs_launch_reads_the_count_offset_and_rows_on_the_device():
    """The form the CUDA graphs capture (``GraphedPack``): grid for a bucket of rows, the row
    count, the slab offset and the rows read from one device buffer, so one graph per bucket
    serves every chunk (the graph itself needs a GPU; its launch runs here under the
    interpreter)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", DEVICE_ARGS], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results == [dict(ok=True, untouched=True)] * 3
