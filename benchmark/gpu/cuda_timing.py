"""Wall time of a GPU callable, measured with CUDA events (shared by the GPU benchmarks)."""

from __future__ import annotations

import statistics
from typing import List

import torch


def samples_ms(fn, iters: int = 50, warmup: int = 10) -> List[float]:
    """Every timed call's milliseconds, after ``warmup`` untimed calls (the raw samples a result
    file records)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def median_ms(fn, iters: int = 50, warmup: int = 10) -> float:
    return statistics.median(samples_ms(fn, iters, warmup))
