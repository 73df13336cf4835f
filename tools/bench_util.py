"""Timing helpers for the benchmarks: CUDA events, warm-up, cold L2, median."""
from __future__ import annotations

import statistics

import torch

_flush_buffer: torch.Tensor | None = None


def flush_l2() -> None:
    """Overwrite 256 MB so no input stays in the 60 MB L2 between timed calls."""
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _flush_buffer.zero_()


def time_us(fn, warmup: int = 5, reps: int = 30) -> float:
    """Median device time of fn() in microseconds, L2 flushed before each call.

    After the flush the GPU also spins ~100 us, so the host has enqueued the whole call before
    the start event is reached: the time is the device's (kernels and the gaps between them),
    not the host's. Host time per call is measured separately (host_us_per_call)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush_l2()
        torch.cuda._sleep(200_000)  # ~100 us at 1.98 GHz
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def host_us_per_call(fn, calls: int = 10000) -> float:
    """Wall time per call of a loop of `calls` calls, synchronizing once at the end."""
    import time

    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6
