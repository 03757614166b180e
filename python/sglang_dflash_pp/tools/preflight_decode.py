"""Every decode rank of ``preflight``, in one process: pools, one Mooncake engine, the byte check.

    python -m sglang_dflash_pp.tools.preflight_decode SPEC.json

For each decode rank, each draft layer gets one allocation laid out as sglang's
``MHATokenToKVPool`` makes it (the K half, then the V half, ``size + page_size`` token rows of
the rank's heads each) with a guard region before and after, all registered with the engine
(guards included, so a stray write would land rather than fail) and filled with a sentinel. The
rank publishes what a decode registration carries: its entry pointers and per-entry item lengths.

Verification is independent of the plan and geometry modules under test: the heads a decode rank
must hold are read from sglang's own ``QKVParallelLinear`` (``qkv_kv_heads``), and the expected
bytes from the last stage's saved pools. Every byte of every allocation is compared (the sent
pages hold exactly the rank's heads of the prefill pools' bytes; guards and every other page
keep the sentinel), and the received values are compared with the single-process reference.

Imports numpy, torch, ``mooncake.engine`` and ``sglang.srt.layers.linear`` (for the head oracle).
"""

from __future__ import annotations

import sys
import time

from sglang_dflash_pp.tools import peer_process as proc
from sglang_dflash_pp.tools.preflight_spec import KV_FILE, PreflightSpec
from sglang_dflash_pp.tools.qkv_kv_heads import kv_heads_by_rank

GUARD = 4096
SENTINEL = 0xA5


def owned_heads(spec: PreflightSpec, rank: int) -> range:
    return kv_heads_by_rank(spec.draft_heads, spec.d_tp)[rank]


class DecodePools:
    def __init__(self, spec: PreflightSpec, engine):
        import numpy as np

        self.spec = spec
        self.rows = spec.d_pool_pages * spec.page_size + spec.page_size  # sglang: size + page_size
        self.elem = spec.torch_dtype(spec.dtype).itemsize
        self.buffers = {}  # rank -> [per layer uint8 array]
        for r in range(spec.d_tp):
            row = len(owned_heads(spec, r)) * spec.head_dim * self.elem
            self.buffers[r] = [
                np.full(GUARD + 2 * self.rows * row + GUARD, SENTINEL, np.uint8)
                for _ in range(spec.draft_layers)
            ]
        arrays = [a for bufs in self.buffers.values() for a in bufs]
        rc = engine.batch_register_memory([a.ctypes.data for a in arrays], [a.size for a in arrays])
        if rc != 0:
            raise RuntimeError(f"Mooncake refused to register the decode pools (rc={rc})")
        self.registered = len(arrays)
        self.nbytes = sum(a.size for a in arrays)

    def row_bytes(self, rank: int) -> int:
        return len(owned_heads(self.spec, rank)) * self.spec.head_dim * self.elem

    def published(self, rank: int) -> dict:
        """Entry pointers K0..K(L-1), V0..V(L-1) and per-page item lengths, as registered."""
        row = self.row_bytes(rank)
        bufs = self.buffers[rank]
        k = [a.ctypes.data + GUARD for a in bufs]
        v = [a.ctypes.data + GUARD + self.rows * row for a in bufs]
        item = self.spec.page_size * row
        return dict(kv_ptrs=k + v, item_lens=[item] * (2 * self.spec.draft_layers))

    def verify(self) -> dict:
        import numpy as np
        import torch

        spec = self.spec
        kv = torch.load(spec.path(KV_FILE), weights_only=True)
        S, dtype = spec.page_size, spec.torch_dtype(spec.dtype)
        src_rows = (np.asarray(spec.src_pages)[:, None] * S + np.arange(S)).reshape(-1)
        dst_rows = (np.asarray(spec.dst_pages)[:, None] * S + np.arange(S)).reshape(-1)
        valid = np.arange(src_rows.size) < spec.tokens  # the request's tokens (last page partial)
        checked = mismatched = 0
        bad, err, scale = [], 0.0, 0.0
        for r, bufs in self.buffers.items():
            heads, row = owned_heads(spec, r), self.row_bytes(r)
            for layer, buf in enumerate(bufs):
                want = np.full(buf.size, SENTINEL, np.uint8)
                for half, name in enumerate(("k", "v")):
                    sent = kv["pp"][name][layer][:, heads.start : heads.stop].contiguous()
                    sent_bytes = sent.view(torch.uint8).reshape(sent.shape[0], -1).numpy()
                    lo = GUARD + half * self.rows * row
                    body = want[lo : lo + self.rows * row].reshape(self.rows, row)
                    body[dst_rows] = sent_bytes[src_rows]
                    got = buf[lo : lo + self.rows * row].reshape(self.rows, row)[dst_rows[valid]]
                    got = torch.from_numpy(got.copy()).view(dtype).float()
                    ref = kv["ref"][name][layer][src_rows[valid], heads.start : heads.stop]
                    ref = ref.reshape(got.shape).float()
                    err = max(err, (got - ref).abs().max().item())
                    scale = max(scale, ref.abs().max().item())
                diff = int(np.count_nonzero(buf != want))
                checked += buf.size
                if diff:
                    mismatched += diff
                    first = int(np.flatnonzero(buf != want)[0])
                    where = "guard" if first < GUARD or first >= buf.size - GUARD else "pool"
                    bad.append(
                        f"decode rank {r} layer {layer}: {diff} bytes differ, first at "
                        f"{first} ({where})"
                    )
        return dict(
            checked_bytes=checked,
            mismatched_bytes=mismatched,
            bad=bad[:20],
            max_abs_error=err,
            ref_absmax=scale,
        )


def main() -> None:
    spec = PreflightSpec.load(sys.argv[1])
    import torch

    torch.set_num_threads(1)
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(
            "the Mooncake transfer engine could not start (install libibverbs1 and libnuma1, and "
            "mooncake-transfer-engine-non-cuda on a machine without CUDA; scripts/setup-dev.sh)"
        )
    pools = DecodePools(spec, engine)
    proc.send(
        "ready",
        session=f"127.0.0.1:{engine.get_rpc_port()}",
        ranks={str(r): pools.published(r) for r in range(spec.d_tp)},
        registered=pools.registered,
        pool_bytes=pools.nbytes,
    )
    proc.read_command()  # verify, after the last stage has sent everything
    t0 = time.perf_counter()
    result = pools.verify()
    proc.send("verified", verify_s=time.perf_counter() - t0, **result)
    proc.read_command()  # exit


if __name__ == "__main__":
    proc.run_child(main)
