"""The one CUDA timer of the kernel benchmarks: CUDA events around each call, the median after warm-up calls."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def cuda_median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median over `reps` timed calls of `fn`, after `warmup` untimed ones, each timed with CUDA events and
    synchronized (so a call's kernels are all inside its own interval)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
