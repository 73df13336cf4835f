"""Decode benchmark: jitattn vs torch SDPA on the same shapes in the same run.

fp16, head_dim 128, MHA 32/32 and GQA 32/8, kv_len 1k..128k. CUDA-event timing, warm-up, cold
L2 (inputs rotated over >= 256 MB), host time hidden, median. TB/s counts K and V bytes read once.
Run: PYTHONPATH=. python tools/bench_decode.py [--quick]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jitattn  # noqa: E402
from bench_util import host_us_per_call, sets_needed, time_us  # noqa: E402


def bench_row(num_qo, num_kv, kv_len, head_dim=128, dtype=torch.float16):
    nbytes = 2 * kv_len * num_kv * head_dim * torch.finfo(dtype).bits // 8
    ours, sdpa = [], []
    for _ in range(sets_needed(nbytes)):
        q = torch.randn(num_qo, head_dim, device="cuda", dtype=dtype)
        k = torch.randn(kv_len, num_kv, head_dim, device="cuda", dtype=dtype)
        v = torch.randn(kv_len, num_kv, head_dim, device="cuda", dtype=dtype)
        # SDPA gets its natural (B, H, L, D) layout, contiguous, so it pays no copies.
        qs = q.view(1, num_qo, 1, head_dim)
        ks = k.permute(1, 0, 2).contiguous().unsqueeze(0)
        vs = v.permute(1, 0, 2).contiguous().unsqueeze(0)
        ours.append(lambda q=q, k=k, v=v: jitattn.single_decode_with_kv_cache(q, k, v))
        sdpa.append(lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=num_qo != num_kv))
    ours_us, sdpa_us = time_us(ours), time_us(sdpa)
    return ours_us, sdpa_us, nbytes / ours_us / 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer lengths")
    args = parser.parse_args()
    lengths = [1024, 4096, 32768] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("\n| decode fp16 D128 | kv_len | jitattn us | TB/s | SDPA us | speedup |")
    print("|---|---:|---:|---:|---:|---:|")
    for num_qo, num_kv in [(32, 32), (32, 8)]:
        for kv_len in lengths:
            ours, sdpa, tbs = bench_row(num_qo, num_kv, kv_len)
            print(f"| {num_qo}/{num_kv} | {kv_len} | {ours:.1f} | {tbs:.2f} | {sdpa:.1f} | {sdpa / ours:.2f}x |", flush=True)
    q = torch.randn(32, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(16, 32, 128, device="cuda", dtype=torch.float16)
    host_ours = host_us_per_call(lambda: jitattn.single_decode_with_kv_cache(q, k, k))
    qs, ks = q.view(1, 32, 1, 128), k.permute(1, 0, 2).contiguous().unsqueeze(0)
    host_sdpa = host_us_per_call(lambda: F.scaled_dot_product_attention(qs, ks, ks))
    print(f"\nhost time per call (kv_len 16, 32/32, 10k calls): jitattn {host_ours:.1f} us, SDPA {host_sdpa:.1f} us")


if __name__ == "__main__":
    main()
