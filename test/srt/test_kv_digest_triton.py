"""The GPU KV digest kernel gives exactly the host reference's per-slot sums.

The kernel is the GPU path; here it runs under Triton's interpreter (``TRITON_INTERPRET=1``, set
in a subprocess because Triton reads it when kernels are defined), on CPU tensors, through
:func:`kv_digest_triton.launch` and the host-side table preparation ``DeviceDigest`` uses
(:func:`kv_digest_triton.fill_table`), against :func:`kv_digest.digest_blocks_host` over the same
memory. ``DeviceDigest`` itself needs CUDA (its pinned buffers and stream); its H200 check is
``benchmark/gpu/kv_digest_cost.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sglang_dflash_pp.srt.disaggregation import kv_digest_triton as kt
from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks

CASES = r"""
import json
import numpy as np
import torch
from sglang_dflash_pp.srt.disaggregation import kv_digest as kd
from sglang_dflash_pp.srt.disaggregation import kv_digest_triton as kt

rng = np.random.default_rng(0)
KEYS = [kd.buffer_key(kd.BufferKind.KV, i) for i in range(6)] + [
    kd.buffer_key(kd.BufferKind.STATE, i) for i in range(2)]


def run(blocks, keys, *, split=None, row_major=False, status=False):
    # DeviceDigest's host side (fill_table: the column-major table and the shared blocks) and
    # its launch, on CPU tensors.
    n = blocks.count
    columns, shared = np.zeros(7 * max(n, 1), np.int64), np.zeros(max(n, 1), np.int64)
    plan = kt.fill_table(blocks, 0, n, columns, shared)
    if split is not None:  # every block shared by `split` programs: the sums must not change
        shared[:n] = np.arange(n)
        plan = kt.Plan(n, split, -1)
    table = kt.column_table(torch.from_numpy(columns), n)
    sums = torch.zeros(len(keys), dtype=torch.int64)
    flag = torch.zeros(1, dtype=torch.int64)
    k = torch.tensor(keys, dtype=torch.int64)
    if row_major:  # launch's plain form: Blocks.table(), one program per block
        kt.launch(torch.from_numpy(blocks.table()), k, sums, n, status=flag)
    else:
        kt.launch(table, k, sums, n, torch.from_numpy(shared), plan, flag)
    out = sums.numpy().view(np.uint64).copy()
    return (out, int(flag)) if status else out


def compare(name, blocks, keys=KEYS, **kw):
    want = kd.digest_blocks_host(blocks, keys)
    got = run(blocks, keys, **kw)
    return dict(case=name, equal=bool((want == got).all()), touched=int(np.count_nonzero(want)),
                blocks=blocks.count, bytes=blocks.total_bytes, want=[int(x) for x in want])


def words(n):
    return torch.from_numpy(rng.integers(0, 2**32, size=n, dtype=np.uint32).view(np.int32))


results = []
mem = words(1 << 18)  # 1 MiB of random words
base = mem.data_ptr()

# Stock descriptors: one row each, lengths that are and are not whole units / tiles, one of
# more than SPLIT_BYTES (shared by several programs), not first in the table.
lengths = [4, 252, 256, 260, 8192, 20000, 300 * 1024, 12, 37 * 256]
srcs = [base + 4 * int(rng.integers(0, 1000)) for _ in lengths]
contiguous = kd.Blocks.concat([
    kd.Blocks.of([s], [int(rng.integers(0, 1 << 20)) * 4], [n], [i % 4]) for i, (s, n) in
    enumerate(zip(srcs, lengths))])
results.append(compare("contiguous", contiguous))
results.append(compare("contiguous, every block split 3 ways", contiguous, split=3))
results.append(compare("contiguous, Blocks.table() as is", contiguous, row_major=True))

# Draft head slices: a bf16 pool [tokens, 2 heads, 128] of one entry; one decode head (the
# second) of each page, 64 strided rows of 256 B landing back to back at the page's offset.
pool = torch.randn(4 * 64, 2, 128).to(torch.bfloat16)
page, dim = 64, 128
heads = kd.Blocks.concat([
    kd.Blocks.of([pool.data_ptr() + (p * page * 2 + 1) * dim * 2], [(7 + p) * page * dim * 2],
                 dim * 2, [5], rows=page, src_stride=2 * dim * 2, dst_stride=dim * 2)
    for p in range(4)])
results.append(compare("strided head slices", heads))
shifted = kd.Blocks(*(a[:3] for a in heads))._replace(src=heads.src[:3] + 4)  # in bounds
results.append(compare("strided head slices, 4-byte aligned sources", shifted))
results.append(compare("strided head slices, split 2 ways", heads, split=2))
# Rows back to back on both sides (the whole token row): taken as one long row.
whole = kd.Blocks.of([pool.data_ptr()], [0], 2 * dim * 2, [6], rows=page, src_stride=2 * dim * 2,
                     dst_stride=2 * dim * 2)
results.append(compare("contiguous rows", whole))
# A narrow strided block (rows shorter than a unit) and a wide one (rows of several units).
narrow = kd.Blocks.of([base + 64], [4096], 36, [7], rows=50, src_stride=200, dst_stride=40)
wide = kd.Blocks.of([base + 128], [1 << 22], 1000, [1], rows=9, src_stride=1200, dst_stride=1004)
results.append(compare("narrow and wide strided rows", kd.Blocks.concat([narrow, wide])))

# Mixed: all of the above in random order, random slots, some blocks sharing slots, plus
# blocks of zero bytes or rows (nothing).
mixed = kd.Blocks.concat([contiguous, heads, whole, narrow, wide,
                          kd.Blocks.of([base, base], [0, 64], [0, 64], [2, 3], rows=[5, 0])])
perm = rng.permutation(mixed.count)
mixed = kd.Blocks(*(getattr(mixed, f)[perm] for f in kd.Blocks._fields))
mixed = mixed._replace(slot=rng.integers(0, len(KEYS), size=mixed.count))
results.append(compare("mixed slots, random order", mixed))

# The empty table: nothing launched, nothing added.
results.append(compare("empty", kd.Blocks.empty()))

# Decode offsets above 16 GiB (word offsets >= 2**32), one block crossing the 2**32-word line
# inside a unit (the high half's two candidate hashes), one far above.
high = kd.Blocks.concat([
    kd.Blocks.of([base], [(1 << 34) + 4096], 8192, [0]),
    kd.Blocks.of([base + 512], [(1 << 34) - 100], 1000, [1]),
    kd.Blocks.of([base + 8], [(1 << 34) - 1024], 256, [2], rows=8, src_stride=512,
                 dst_stride=256),
    kd.Blocks.of([base + 4], [(5 << 40) + 12], 4000, [3]),
])
results.append(compare("word offsets >= 2**32", high))
# The same words 16 GiB lower are other terms: the sums differ.
low = high._replace(dst=high.dst - (1 << 34) + (1 << 20))
results.append(dict(case="offsets matter", equal=bool(
    (run(low, KEYS) != run(high, KEYS))[:4].all()), touched=4, blocks=4, bytes=0, want=[]))

# One flipped byte in the middle of a head slice changes its slot's sum (and only that).
before = run(heads, KEYS)
view = pool.view(torch.uint8).reshape(-1)
at = (2 * page * 2 + 1) * dim * 2 + 5 * 2 * dim * 2 + 77  # page 2, row 5, byte 77 of head 1
view[at] ^= 0x10
after = run(heads, KEYS)
flipped = compare("after a flipped byte", heads)
flipped["changed"] = bool(before[5] != after[5]) and bool((np.delete(before, 5) == np.delete(after, 5)).all())
results.append(flipped)

# Refused blocks add nothing and are reported (the status: 1 + the greatest refused index).
good = kd.Blocks.of([base], [0], 256, [0])
for name, bad in (("slot outside the keys", kd.Blocks.of([base], [0], 256, [len(KEYS)])),
                  ("negative slot", kd.Blocks.of([base], [0], 256, [-1])),
                  ("half a word", kd.Blocks.of([base + 2], [0], 256, [1])),
                  ("8 GiB of rows", kd.Blocks.of([base], [0], 1 << 20, [1], rows=1 << 13,
                                                 src_stride=0, dst_stride=1 << 20))):
    table = kd.Blocks.concat([good, bad, good])
    sums, flag = run(table, KEYS, status=True)
    results.append(dict(case="refused: " + name, equal=bool(
        (sums == kd.digest_blocks_host(kd.Blocks.concat([good, good]), KEYS)).all()), status=flag,
        touched=1, blocks=3, bytes=0, want=[]))
print(json.dumps(results))
"""

# DeviceDigest's own call path (one pinned buffer [sums | keys | columns | shared], pieces of
# max_blocks, the sums zeroed by the upload) on CPU tensors under the interpreter: CUDA's
# streams, events, pinned memory and device placement stood in for, nothing else.
DEVICE_DIGEST = r"""
import contextlib, json
import numpy as np
import torch


class Stream:
    def wait_event(self, e):
        pass

    def synchronize(self):
        pass


class Event:
    def __init__(self, **kw):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


zeros = torch.zeros
torch.zeros = lambda *a, pin_memory=False, device=None, **k: zeros(*a, **k)
torch.cuda.Stream, torch.cuda.Event = (lambda *a, **k: Stream()), Event
torch.cuda.stream = lambda s: contextlib.nullcontext()
torch.cuda.current_device = lambda: 0

from sglang_dflash_pp.srt.disaggregation import kv_digest as kd
from sglang_dflash_pp.srt.disaggregation import kv_digest_triton as kt

rng = np.random.default_rng(2)
mem = torch.from_numpy(rng.integers(0, 2**32, size=1 << 17, dtype=np.uint32).view(np.int32))
base = mem.data_ptr()
keys = [kd.buffer_key(kd.BufferKind.KV, i) for i in range(5)]
n = 23
blocks = kd.Blocks.of(
    base + 16 * rng.integers(0, 4000, n), 4 * rng.integers(0, 1 << 30, n),
    4 * rng.integers(1, 200, n), rng.integers(0, 5, n), rows=rng.integers(1, 5, n),
    src_stride=1024, dst_stride=800)
blocks = kd.Blocks.concat([blocks, kd.Blocks.of([base], [1 << 34], 300 * 1024, [4])])
want = kd.digest_blocks_host(blocks, keys)
out = {}
for max_blocks in (5, 64):
    d = kt.DeviceDigest(torch.device("cuda"), max_blocks=max_blocks, max_slots=8)
    d.warm()
    got = [d.digest(blocks, keys, wait_events=(Event(),)) for _ in range(2)]
    two = blocks._replace(slot=blocks.slot % 2)  # fewer keys than the last call
    out[max_blocks] = dict(equal=all(bool((g == want).all()) for g in got),
                           empty=d.digest(kd.Blocks.empty(), keys).tolist(),
                           fewer_keys=bool((d.digest(two, keys[:2])
                                            == kd.digest_blocks_host(two, keys[:2])).all()))
# keys as a tuple (the send path's, known again by identity), then another tuple of as many
tk, other = tuple(keys), tuple(reversed(keys))
by_tuple = [bool((d.digest(blocks, k) == kd.digest_blocks_host(blocks, list(k))).all())
            for k in (tk, tk, other, tk)]
try:
    d.digest(kd.Blocks.of([base], [0], 256, [5]), keys)
    raised = None
except ValueError as e:
    raised = str(e)
after = bool((d.digest(blocks, keys) == want).all())  # a refused call leaves nothing behind
# Submitted calls outnumbering the lanes, read later in reverse order, one refused among them:
# each reads its own sums (a lane taken again reads out its unread sums first).
d = kt.DeviceDigest(torch.device("cuda"), max_blocks=64, max_slots=8, lanes=2)
d.warm()
calls = []
for i in range(5):
    b = blocks._replace(slot=blocks.slot % (i + 1))
    calls.append((d.submit(b, keys[: i + 1]), kd.digest_blocks_host(b, keys[: i + 1])))
refused = d.submit(kd.Blocks.of([base], [0], 256, [5]), keys)
calls.append((d.submit(blocks, keys), want))
late = []
for sums, reference in reversed(calls):
    late.append(bool(sums.done()) and bool((sums.result() == reference).all()))
try:
    refused.result()
    late_raised = None
except ValueError as e:
    late_raised = str(e)
print(json.dumps(dict(out=out, touched=int(np.count_nonzero(want)), raised=raised, after=after,
                      late=late, late_raised=late_raised, by_tuple=by_tuple)))
"""


def test_device_digest_call_path_equals_the_host_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", DEVICE_DIGEST], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["touched"] == 5
    assert "slot 5, outside the 5 keys" in r["raised"] and r["after"], r
    assert r["late"] == [True] * 6 and "slot 5, outside the 5 keys" in r["late_raised"], r
    assert r["by_tuple"] == [True] * 4, r
    for max_blocks in ("5", "64"):  # in pieces of 5 blocks, and in one launch
        v = r["out"][max_blocks]
        assert v["equal"] and v["fewer_keys"] and v["empty"] == [0] * 5, v


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", CASES], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["case"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


def test_kernel_sums_equal_the_host_reference(interpreted):
    expected = [
        "contiguous", "contiguous, every block split 3 ways", "contiguous, Blocks.table() as is",
        "strided head slices", "strided head slices, 4-byte aligned sources",
        "strided head slices, split 2 ways",
        "contiguous rows", "narrow and wide strided rows", "mixed slots, random order", "empty",
        "word offsets >= 2**32", "after a flipped byte",
    ]  # fmt: skip
    for name in expected:
        r = interpreted[name]
        assert r["equal"], r
        assert (r["touched"] > 0) == (name != "empty"), r
    assert interpreted["empty"]["want"] == [0] * 8
    assert interpreted["contiguous"]["touched"] == 4
    assert interpreted["mixed slots, random order"]["bytes"] > 300 * 1024


def test_offsets_above_16_gib_are_hashed_as_such(interpreted):
    assert interpreted["word offsets >= 2**32"]["touched"] == 4
    assert interpreted["offsets matter"]["equal"]


def test_refused_blocks_add_nothing_and_are_reported(interpreted):
    refused = [r for name, r in interpreted.items() if name.startswith("refused: ")]
    assert len(refused) == 4
    for r in refused:
        assert r["equal"] and r["status"] == 2, r  # block 1 of 3


def test_a_flipped_byte_changes_its_slot_sum_only(interpreted):
    r = interpreted["after a flipped byte"]
    assert r["equal"] and r["changed"], r


def test_the_kernel_compiles_once_whatever_the_table():
    """No digest may compile while serving: block counts, the split, the slot count and the
    table's strides are run-time arguments the JIT does not specialise on; the tile shape is
    fixed per ``DeviceDigest`` (compiled by ``warm``)."""
    params = {p.name: p for p in kt._digest_kernel.params}
    unspecialised = ("n_blocks", "n_split", "split", "split_bytes", "n_slots", "row_stride",
                     "col_stride")  # fmt: skip
    assert all(params[n].do_not_specialize for n in unspecialised)
    assert {n for n, p in params.items() if p.is_constexpr} == {"BLOCK_R", "BLOCK_C"}


def test_large_blocks_are_shared_in_place():
    blocks = Blocks.of([0, 16, 32, 48], 0, [256, 10 << 20, 256, 3 << 20], [0, 1, 2, 3])
    columns, shared = np.zeros(28, np.int64), np.zeros(4, np.int64)
    plan = kt.fill_table(blocks, 0, 4, columns, shared)
    assert plan == kt.Plan(2, (10 << 20) // kt.PROGRAM_BYTES, kt.SPLIT_BYTES)
    assert shared[:2].tolist() == [1, 3]  # the table itself is not reordered
    assert columns.reshape(7, 4).T.tolist() == blocks.table().tolist()
    assert kt.fill_table(Blocks.of([4, 16], 0, 256, 0), 0, 2, columns, shared) == kt.NO_SPLIT


def test_the_host_names_what_the_kernel_refuses():
    ok = Blocks.of([0, 64], [0, 64], 64, [0, 1])
    assert kt.refusal(ok, 2) is None
    kt.check_table(ok, 2)
    assert "slot 1, outside the 1 keys" in kt.refusal(ok, 1)
    assert "4-byte words" in kt.refusal(Blocks.of([0], [2], 64, [0]), 1)
    assert "non-negative" in kt.refusal(Blocks.of([0], [0], 64, [0], rows=-1), 1)
    big = Blocks.of([0], [0], 1 << 20, [0], rows=1 << 13, src_stride=2 << 20)
    with pytest.raises(ValueError, match="under 8 GiB"):
        kt.check_table(big, 1)


def test_more_keys_than_slots_is_refused_before_any_work():
    d = object.__new__(kt.DeviceDigest)  # the check precedes every CUDA call
    d.max_slots = 4
    with pytest.raises(ValueError, match="5 slots exceeds this DeviceDigest's 4"):
        d.digest(Blocks.empty(), [1, 2, 3, 4, 5])


def test_a_digest_needs_a_cuda_device():
    assert kt.triton is not None  # the test environment installs Triton (with torch)
    with pytest.raises(ValueError, match="CUDA device"):
        kt.DeviceDigest(torch.device("cpu"))
