"""Timing helpers for the benchmarks: CUDA events, warm-up, cold L2, median.

Cold L2 comes from rotating inputs: each timed call reads a different input set, and the sets
together exceed the 60 MB L2 several times, so no call finds its inputs in L2. (Flushing by
writing a large buffer would leave L2 full of dirty lines whose write-back competes with the
timed kernel's reads, which no real decode step pays.)
"""
from __future__ import annotations

import statistics
import time

import torch

ROTATION_BYTES = 256 << 20  # input sets per shape cover at least this much memory


def sets_needed(bytes_per_set: int) -> int:
    return max(2, -(-ROTATION_BYTES // bytes_per_set))


def time_us(fns, warmup: int = 5, reps: int = 30, calls: int = 1, spin_x: int = 1) -> float:
    """Median device time of one call in microseconds; `fns` is a list of calls on distinct
    input sets, used round-robin.

    Before each start event the GPU spins ~100 us, so the host has enqueued the whole call by the
    time the start event is reached: this is device time (kernels and the gaps between them).
    Host time per call is measured separately (host_us_per_call).

    calls > 1 times that many calls issued back to back between the two events (each on the next
    input set, as a model's layers would) and reports device time per call: what a decode step
    costs inside a pipeline, where one kernel follows another with no event or host wait between
    them. The spin lasts 40 us per extra call, so the host stays ahead of the GPU.

    spin_x multiplies the spin, for calls whose host enqueue takes longer than ~100 us (an eager
    forward + backward): then the GPU no longer idles inside the events. A longer spin also lets
    a power-capped GPU cool between reps (tools/bwd_method.py shows both)."""
    if callable(fns):
        fns = [fns]
    for i in range(warmup):
        fns[i % len(fns)]()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    n = warmup
    for s, e in zip(starts, ends):
        torch.cuda._sleep((200_000 + 80_000 * (calls - 1)) * spin_x)  # ~100 us at 1.98 GHz, + 40 us per extra call
        s.record()
        for _ in range(calls):
            fns[n % len(fns)]()
            n += 1
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 / calls for s, e in zip(starts, ends))


def interleaved_us(timers: dict, rounds: int) -> dict:
    """Time every entry of `timers` (name -> a no-argument function that times once and returns
    microseconds, e.g. a time_us call) once per round, in turn, for `rounds` rounds; name ->
    the sorted times. The H200's clocks drift over a job (power, heat: the same kernel measured
    639 then 564 TFLOP/s minutes apart), so variants timed one after another differ by the drift;
    interleaved, each round meets every variant at about the same clock, and the median over
    rounds with the spread says how far apart two variants really are."""
    times = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            times[name].append(timer())
    return {name: sorted(t) for name, t in times.items()}


def median_spread(times: list) -> tuple:
    """(median, min, max) of one entry of interleaved_us."""
    return statistics.median(times), times[0], times[-1]


def host_us_per_call(fn, calls: int = 10000) -> float:
    """Wall time per call of a loop of `calls` calls, synchronizing once at the end."""
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def host_enqueue_us(fn, reps: int = 10, busy: bool = True) -> float:
    """Median wall time of one fn() in microseconds, each call alone: with `busy` while the GPU
    sleeps ~10 ms ahead of it (what enqueueing it costs the host, which never waits on the GPU),
    else after a synchronize (the GPU idle)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if busy:
            torch.cuda._sleep(20_000_000)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def host_us_rounds(fns: dict, calls: int = 10000, rounds: int = 5) -> dict:
    """host_us_per_call for each of `fns` (name -> callable), `rounds` times, interleaved so every
    function meets the same background load on a shared host; name -> sorted per-round us."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(host_us_per_call(fn, calls))
    return {name: sorted(t) for name, t in times.items()}


def page_pools(key, value, batch: int, seq: int, page_sizes=(16, 256)) -> dict:
    """{page size: (pool_k, pool_v, block_table)}: `batch` sequences of `seq` tokens of the
    packed (T, H, D) key/value in a page pool, pages a random permutation of the pool (logical
    page i of the batch lives at order[i])."""
    tokens, heads, head_dim = key.shape
    pools = {}
    for page in page_sizes:
        pages = tokens // page
        order = torch.randperm(pages, device=key.device)
        pool_k, pool_v = (torch.empty(pages, page, heads, head_dim, device=key.device, dtype=key.dtype) for _ in range(2))
        pool_k[order] = key.view(pages, page, heads, head_dim)
        pool_v[order] = value.view(pages, page, heads, head_dim)
        pools[page] = (pool_k, pool_v, order.to(torch.int32).view(batch, seq // page))
    return pools
