"""Decode tuning aid (not a benchmark of record): host-time breakdown and a split-rule sweep.

PYTHONPATH=. python tools/profile_decode.py            # host breakdown + sweep table
PYTHONPATH=. python tools/profile_decode.py --ncu-case # one launch per shape, for ncu
PYTHONPATH=. python tools/profile_decode.py --idle-sms # what a 128-CTA split's idle SMs cost
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jitattn  # noqa: E402
import jitattn.decode.api as decode  # noqa: E402
from jitattn.decode import plan  # noqa: E402
from jitattn.kernel import LoadedKernel, fresh_memos  # noqa: E402  (capacity, patched by the sweep)
from bench_util import host_us_per_call, sets_needed, time_us  # noqa: E402

SHAPES = [(32, 32, 4096), (32, 32, 32768), (32, 8, 1024), (32, 8, 4096), (32, 8, 32768)]


def inputs(num_qo, num_kv, kv_len):
    q = torch.randn(num_qo, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(kv_len, num_kv, 128, device="cuda", dtype=torch.float16)
    v = torch.randn(kv_len, num_kv, 128, device="cuda", dtype=torch.float16)
    return q, k, v


def host_breakdown():
    q, k, v = inputs(32, 32, 16)
    jitattn.single_decode_with_kv_cache(q, k, v)
    kernel = next(iter(decode._kernels.values()))[0]
    out = torch.empty_like(q)
    # The C launch alone, with decode/api.py's arguments for this shape (one chunk, no lse).
    launch = (q, k, v, out, None, None, k.stride(), v.stride(), 0, 16, 1, 1, 32, 1, 0.1, 0.0, 1.0, 1e4, 1.0, 0)
    full = host_us_per_call(lambda: jitattn.single_decode_with_kv_cache(q, k, v))
    launch_only = host_us_per_call(lambda: kernel.launch(*launch))
    empty = host_us_per_call(lambda: torch.empty_like(q, memory_format=torch.contiguous_format))
    sdpa_q, sdpa_k = q.view(1, 32, 1, 128), k.view(1, 16, 32, 128).transpose(1, 2)
    sdpa = host_us_per_call(lambda: torch.nn.functional.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_k))
    print(f"host us/call: full {full:.1f}, C launch alone {launch_only:.1f}, one torch.empty_like {empty:.1f}, "
          f"SDPA {sdpa:.1f}")


def kernel_breakdown():
    """Device time per kernel (torch.profiler) vs the event-timed call, per shape."""
    from torch.profiler import ProfilerActivity, profile

    print("| shape | call us (events) | decode_chunk us | merge_chunks us |")
    print("|---|---:|---:|---:|")
    for num_qo, num_kv, kv_len in SHAPES:
        q, k, v = inputs(num_qo, num_kv, kv_len)
        call = time_us(lambda: jitattn.single_decode_with_kv_cache(q, k, v), reps=20)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                jitattn.single_decode_with_kv_cache(q, k, v)
            torch.cuda.synchronize()
        times = {"decode_chunk": [], "merge_chunks": []}
        for event in prof.events():
            for name in times:
                if name in event.name and event.device_type.name == "CUDA":
                    times[name].append(event.device_time)
        med = {n: sorted(t)[len(t) // 2] if t else 0.0 for n, t in times.items()}
        print(f"| {num_qo}/{num_kv} L={kv_len} | {call:.1f} | {med['decode_chunk']:.1f} | {med['merge_chunks']:.1f} |")


def sweep():
    print("| shape | min_tiles | capacity x | chunks | us |")
    print("|---|---:|---:|---:|---:|")
    original = LoadedKernel.capacity
    for num_qo, num_kv, kv_len in SHAPES:
        q, k, v = inputs(num_qo, num_kv, kv_len)
        for min_tiles in (1, 2, 4):
            for factor in (0.5, 1, 2):
                plan.MIN_CHUNK_TILES = min_tiles
                LoadedKernel.capacity = lambda self, dev, f=factor: int(original(self, dev) * f * 2)
                with fresh_memos():  # the entries hold the wave from capacity()
                    us = time_us(lambda: jitattn.single_decode_with_kv_cache(q, k, v), reps=20)
                    # The split this call made, from the kernel entry it used (group tiles, budget).
                    key = (128, torch.float16, torch.float16, "NONE", False, num_qo // num_kv, False, q.get_device())
                    kernel, group_tiles, budget, full_wave = decode._kernels[key]
                if full_wave is not None:
                    budget = plan.split_budget(*full_wave, -(-kv_len // kernel.tile_rows) * num_kv * group_tiles)
                chunks = plan.split(kv_len, num_kv * group_tiles, kernel.tile_rows, budget)[1]
                print(f"| {num_qo}/{num_kv} L={kv_len} | {min_tiles} | {factor} | {chunks} | {us:.1f} |", flush=True)
    LoadedKernel.capacity = original
    plan.MIN_CHUNK_TILES = 2


def idle_sms():
    """At 32k the split leaves the H200's 132 SMs unevenly loaded: 32/8 runs 128 CTAs (8 KV heads
    x 16 chunks), 4 SMs idle; 32/32 runs 256 (32 x 8), two on 124 SMs and one on 8. The same
    split over 31744 rows gives every CTA the 3% less work that a split loading all SMs evenly
    would: the time saved bounds what such a split could gain."""
    for num_qo, num_kv in [(32, 8), (32, 32)]:
        times = {}
        for _round in range(2):
            for kv_len in (32768, 31744):
                sets = [inputs(num_qo, num_kv, kv_len) for _ in range(sets_needed(4 * kv_len * num_kv * 128))]
                fns = [lambda s=s: jitattn.single_decode_with_kv_cache(*s) for s in sets]
                times.setdefault(kv_len, []).append(time_us(fns, reps=60))
                del sets, fns
        print(f"{num_qo}/{num_kv}: " + " | ".join(f"kv_len {n}: " + " / ".join(f"{t:.2f}" for t in ts) + " us"
                                                 for n, ts in times.items()))


def ncu_case():
    for num_qo, num_kv, kv_len in [(32, 32, 32768), (32, 8, 32768)]:
        q, k, v = inputs(num_qo, num_kv, kv_len)
        jitattn.single_decode_with_kv_cache(q, k, v)
        torch.cuda.synchronize()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ncu-case", action="store_true")
    parser.add_argument("--idle-sms", action="store_true")
    args = parser.parse_args()
    if args.ncu_case:
        ncu_case()
    elif args.idle_sms:
        idle_sms()
    else:
        host_breakdown()
        kernel_breakdown()
        sweep()
