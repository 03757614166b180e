"""NCCL send/recv of the PP carry between two GPUs of one host, Kimi-K3 PP8 hop sizes, T = 8192.

Per hop: the partial (fp32 and bf16, [T, 7168]) against the concat payload stock DSpark relays
(``dspark_hidden_states``: 14,336 B per token per feature captured so far). All sizes in one run,
median of repeated blocking send/recv pairs. Needs torch with NCCL and 2 GPUs:

    python3 benchmark/gpu/nccl_carry.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import provenance  # noqa: E402

H, T = 7168, 8192
# Features captured up to each hop's sender (Kimi-K3 PP8, ids 19..90 on stages 1,3,4,5,6,7).
HOPS = {"1->2": 1, "2->3": 1, "3->4": 2, "4->5": 3, "5->6": 4, "6->7": 5}


def payloads():
    sizes = {"partial_fp32": (H, torch.float32), "partial_bf16": (H, torch.bfloat16)}
    for hop, k in HOPS.items():
        sizes[f"concat_{hop}_{k}feat"] = (k * H, torch.bfloat16)
    return sizes


def worker(rank, port, iters, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    results = {}
    for name, (width, dtype) in payloads().items():
        t = torch.ones(T, width, dtype=dtype, device="cuda")
        times = []
        for i in range(iters + 5):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if rank == 0:
                dist.send(t, dst=1)
            else:
                dist.recv(t, src=0)
            end.record()
            torch.cuda.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end))
        if rank == 1:
            ms = statistics.median(times)
            nbytes = t.numel() * t.element_size()
            results[name] = {
                "bytes": nbytes, "bytes_per_token": nbytes // T, "ms": ms, "GBps": nbytes / ms / 1e6,
                "samples_ms": times,
            }  # fmt: skip
    if rank == 1:
        fp32 = results["partial_fp32"]["ms"]
        bf16 = results["partial_bf16"]["ms"]
        for name, r in results.items():
            r["time_over_partial_fp32"] = r["ms"] / fp32
            r["time_over_partial_bf16"] = r["ms"] / bf16
        payload = {
            "provenance": provenance.record(
                repetitions=iters, warmup=5, timed="CUDA events around dist.send / dist.recv on rank 1"
            ),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "T": T,
            "hidden": H,
            "iters": iters,
            "payloads": results,
        }
        print(json.dumps(payload, indent=1))
        with open(out_path, "w") as f:
            json.dump(payload, f, indent=1)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--port", type=int, default=29555)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    mp.spawn(worker, args=(args.port, args.iters, args.out), nprocs=2, join=True)


if __name__ == "__main__":
    main()
