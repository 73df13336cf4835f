"""The automatic KV split of decode-shaped varlen batches: device time per call, for comparing
two checkouts (the split counted per sequence on the device vs one count for the grid).

PYTHONPATH=<checkout> python tools/bench_varlen_split.py
bf16, head_dim 128, 32 query / 8 KV heads, one query token per sequence (the 16-row decode tile),
num_splits=None. Batches small enough that the split engages (fewer CTAs than half a wave), one
with mixed lengths (where a per-sequence count lets the short ones go unsplit), and the paged
form of one (page 16) with max_k at the slot size. CUDA events, cold L2 (rotating input sets),
median of 30 (tools/bench_util.py). Prints one row per shape.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jitattn  # noqa: E402
from bench_util import sets_needed, time_us  # noqa: E402

BF16 = torch.bfloat16
H_Q, H_KV, D = 32, 8, 128


def packed(lengths, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, total = len(lengths), sum(lengths)
    q = torch.randn(n, H_Q, D, device="cuda", dtype=BF16, generator=g)
    k = torch.randn(total, H_KV, D, device="cuda", dtype=BF16, generator=g)
    v = torch.randn(total, H_KV, D, device="cuda", dtype=BF16, generator=g)
    cu_q = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return lambda: jitattn.varlen_attn(q, k, v, cu_q, cu_k, 1, max(lengths), enable_gqa=True), total


def paged(lengths, slot, page, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, per = len(lengths), slot // page
    q = torch.randn(n, H_Q, D, device="cuda", dtype=BF16, generator=g)
    pool_k = torch.randn(n * per, page, H_KV, D, device="cuda", dtype=BF16, generator=g)
    pool_v = torch.randn_like(pool_k)
    table = torch.randperm(n * per, device="cuda", generator=g).to(torch.int32).view(n, per)
    used = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cu_q = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    return lambda: jitattn.varlen_attn(q, pool_k, pool_v, cu_q, None, 1, slot, enable_gqa=True, seqused_k=used,
                                       block_table=table), sum(lengths)


def main():
    shapes = [
        ("1 x 16k", lambda s: packed([16384], s)),
        ("4 x 8k", lambda s: packed([8192] * 4, s)),
        ("16 x 4k", lambda s: packed([4096] * 16, s)),
        ("mixed 16k/256/64/16", lambda s: packed([16384, 256, 64, 16], s)),
        ("paged 4 x 8k, slot 16k", lambda s: paged([8192] * 4, 16384, 16, s)),
    ]
    print(f"{'shape':26s} {'us':>8s} {'TB/s':>6s}")
    for name, make in shapes:
        fn, keys = make(0)
        sets = [fn] + [make(i)[0] for i in range(1, sets_needed(keys * H_KV * D * 2 * 2))]
        us = time_us(sets)
        print(f"{name:26s} {us:8.1f} {keys * H_KV * D * 2 * 2 / us / 1e6:6.2f}")


if __name__ == "__main__":
    main()
