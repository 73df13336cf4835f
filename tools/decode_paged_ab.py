"""Paged decode against packed keys, template trees side by side: interleaved rounds in one process.

The issue-21 decode shape (bf16 D128, 64 x 4096 keys, 32 query / 8 KV heads, page 16, pages a
random permutation of the pool), default decode tile. Each variant is a templates directory
(name=DIR; `tree` = this checkout's): its paged, packed and packed + seqused_k calls are timed
in every round beside SDPA on the dense keys (enable_gqa), so the H200's clock drift within a
job (5-10%) hits every row alike (bench_util.interleaved_us). Before timing, each variant's paged
output is checked against its packed output (bit for bit) and SDPA (0.1): a mismatch fails the run.

  PYTHONPATH=. python3 tools/decode_paged_ab.py [--variant base=/path/templates ...] [--rounds 7]
  PYTHONPATH=. python3 tools/decode_paged_ab.py --prewarm   # build every variant's kernels (no GPU)
  ncu ... python3 tools/decode_paged_ab.py --ncu            # one paged and one packed call per variant
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import jitattn  # noqa: E402
from jitattn.jit import render  # noqa: E402
from bench_util import interleaved_us, median_spread, page_pools, sets_needed, time_us  # noqa: E402

BF16 = torch.bfloat16
B, L, H_Q, H_KV, D, PAGE = 64, 4096, 32, 8, 128, 16


def variant_kernels(root: Path | None, build_only: bool = False) -> dict:
    """kernel_key -> forward._kernels entry of the default bf16 D128 decode tile, paged and packed,
    rendered from the templates under `root` (None: this checkout's)."""
    from jitattn.jit import loader
    from jitattn.jit.loader import get_module
    from jitattn.varlen import forward
    from jitattn.varlen.spec import VarlenSpec

    from jitattn.kernel import OpKernel

    saved = render.templates_dir
    if root is not None:
        render.templates_dir = lambda: root
    try:
        entries = {}
        for paged in (True, False):
            spec = VarlenSpec(D, "bfloat16", paged, True)
            loader._modules.pop(spec, None)  # the per-process memo is keyed by spec, not by templates
            module = get_module(spec)
            loader._modules.pop(spec, None)
            if not build_only:
                entries[forward.kernel_key(D, BF16, paged, True, False, False)] = (
                    OpKernel(module), spec.block_m, spec.block_n)
        return entries
    finally:
        render.templates_dir = saved


def make_sets(n: int):
    sets = []
    for _ in range(n):
        q = torch.randn(B, H_Q, D, device="cuda", dtype=BF16)
        k = torch.randn(B, L, H_KV, D, device="cuda", dtype=BF16)
        v = torch.randn(B, L, H_KV, D, device="cuda", dtype=BF16)
        k_pool, v_pool, table = page_pools(k.view(-1, H_KV, D), v.view(-1, H_KV, D), B, L, (PAGE,))[PAGE]
        dense = tuple(t.permute(0, 2, 1, 3).contiguous() for t in (k, v))  # SDPA's (B, H_kv, L, D)
        sets.append(dict(q=q, k_pool=k_pool, v_pool=v_pool, table=table, k=k.view(-1, H_KV, D),
                         v=v.view(-1, H_KV, D), dense=dense))
    return sets


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=TEMPLATES_DIR")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prewarm", action="store_true")
    parser.add_argument("--ncu", action="store_true")
    args = parser.parse_args()
    variants = {"tree": None}
    for item in args.variant:
        name, _, path = item.partition("=")
        variants[name] = Path(path).resolve()
    if args.prewarm:
        for root in variants.values():
            variant_kernels(root, build_only=True)
        return 0

    from jitattn.varlen import forward
    kernels = {name: variant_kernels(root) for name, root in variants.items()}
    sets = make_sets(1 if args.ncu else sets_needed(2 * B * L * H_KV * D * 2))
    cu_q = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(0, (B + 1) * L, L, device="cuda", dtype=torch.int32)
    used = torch.full((B,), L, device="cuda", dtype=torch.int32)

    def use(name):
        forward._kernels.update(kernels[name])

    def paged(s):
        return jitattn.varlen_attn(s["q"], s["k_pool"], s["v_pool"], cu_q, None, 1, L, enable_gqa=True,
                                   seqused_k=used, block_table=s["table"])

    def packed(s, seqused=None):
        return jitattn.varlen_attn(s["q"], s["k"], s["v"], cu_q, cu_k, 1, L, enable_gqa=True, seqused_k=seqused)

    def sdpa(s):
        return F.scaled_dot_product_attention(s["q"].view(B, H_Q, 1, D), *s["dense"], enable_gqa=True)

    if args.ncu:  # one call each, in this order: the ncu launch order
        for name in variants:
            use(name)
            paged(sets[0])
            packed(sets[0])
        torch.cuda.synchronize()
        return 0

    failures = 0
    peer = sdpa(sets[0]).view(B, H_Q, D).float()
    for name in variants:
        use(name)
        a, b = paged(sets[0]), packed(sets[0])
        err = (a.float() - peer).abs().max().item()
        ok = torch.equal(a, b) and err < 0.1 and not torch.isnan(a).any()
        failures += not ok
        print(f"{name}: paged == packed bits {torch.equal(a, b)}, max |paged - SDPA| {err:.3g}"
              f"{'' if ok else '  FAILED'}", flush=True)

    def timer(name, call):
        def run():
            use(name)
            return time_us([lambda s=s: call(s) for s in sets], warmup=3, reps=20)
        return run

    timers = {}
    for name in variants:
        timers[f"{name} paged"] = timer(name, paged)
        timers[f"{name} packed"] = timer(name, packed)
        timers[f"{name} packed + seqused_k"] = timer(name, lambda s: packed(s, used))
    timers["SDPA dense (enable_gqa)"] = lambda: time_us([lambda s=s: sdpa(s) for s in sets], warmup=3, reps=20)
    times = interleaved_us(timers, args.rounds)
    io_bytes = 2 * B * L * H_KV * D * 2 + 2 * B * H_Q * D * 2
    print(f"\n### paged decode A/B: bf16 D{D}, {B} x {L} keys, {H_Q}/{H_KV} heads, page {PAGE} (random), "
          f"{args.rounds} interleaved rounds, median of 20 each, cold L2\n")
    print("| row | us median (min-max) | TB/s |")
    print("|---|---:|---:|")
    for name, t in times.items():
        med, lo, hi = median_spread(t)
        print(f"| {name} | {med:.1f} ({lo:.1f}-{hi:.1f}) | {io_bytes / med / 1e6:.2f} |", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
