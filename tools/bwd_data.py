"""Does the backward's time depend on the data it is given? (the same kernels, other values)

The relative-position backward measured ~10% faster than the built-in one (notes/variants-h100.md,
sixth and eighth sessions), though it does more per element. Either its code schedules better, or
its data is cheaper: with a bias of q_idx - kv_idx most of P^T and dS^T underflow to zero, and
tensor cores fed zeros draw less power, so a power-capped GPU holds a higher clock. This times
the built-in and the relative-bias backward on ordinary inputs (randn) and on peaked ones (q
scaled up: P^T almost one-hot per row, as the bias makes it), interleaved, with the SM clock
nvidia-smi reports after each round.

    python3 tools/bwd_data.py [--batch 8 --seqlen 4096 --heads 32 --head-dim 128 --rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jitattn  # noqa: E402
from bench_util import sets_needed, time_us  # noqa: E402
from bench_variants import shape_arguments  # noqa: E402
from jitattn.variants import gallery  # noqa: E402


def sm_clock() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out.splitlines()[0] if out else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peak", type=float, default=8.0, help="q's scale for the peaked inputs")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)
    b, n, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    tokens = b * n
    cu = torch.arange(0, tokens + 1, n, dtype=torch.int32, device="cuda")
    window = (-1, 0) if args.causal else (-1, -1)
    flops = 2.5 * 4 * b * n * n * h * d * (0.5 if args.causal else 1.0)
    per_set = 4 * tokens * h * d * 2

    def make_sets(scale: float):
        sets = []
        for _ in range(sets_needed(per_set)):
            q = (torch.randn(tokens, h, d, device="cuda") * scale).to(torch.bfloat16).requires_grad_()
            k, v = (torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
            sets.append((q, k, v, torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16)))
        return sets

    inputs = {"randn": make_sets(1.0), f"q x {args.peak:g}": make_sets(args.peak)}
    variants = {"built-in": None, "relative bias": gallery.relative_position}
    timers, zeros = {}, {}
    for data, sets in inputs.items():
        for name, score_mod in variants.items():
            graphs = []
            for q, k, v, do in sets:
                out = jitattn.varlen_attn(q, k, v, cu, cu, n, n, window_size=window, score_mod=score_mod)
                graphs.append((out, (q, k, v), do))
            grad = [lambda g=g: torch.autograd.grad(g[0], g[1], g[2], retain_graph=True) for g in graphs]
            timers[(name, data)] = grad
            with torch.no_grad():  # the share of P^T that is exactly zero in bf16 (one head's rows, first set)
                q, k = sets[0][0][:n, 0].float(), sets[0][1][:n, 0].float()
                s = q @ k.T * d ** -0.5
                if score_mod is not None:
                    idx = torch.arange(n, device="cuda")
                    s = s + (idx[:, None] - idx[None, :]).float()
                if args.causal:
                    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
                zeros[(name, data)] = (torch.softmax(s, -1).to(torch.bfloat16) == 0).float().mean().item()
    times = {key: [] for key in timers}
    clocks = []
    for _ in range(args.rounds):
        for key, fns in timers.items():
            times[key].append(time_us(fns, warmup=3, reps=10))
        clocks.append(sm_clock())
    print(f"\n### backward, bf16, {b} x {n} tokens, {h} heads, D{d}, causal={args.causal}; "
          f"median of {args.rounds} interleaved rounds ({torch.cuda.get_device_name()})\n")
    print("| variant | inputs | P^T zero (bf16) | ms | TFLOP/s |")
    print("|---|---|---:|---:|---:|")
    for key, t in times.items():
        med = statistics.median(t)
        print(f"| {key[0]} | {key[1]} | {zeros[key]:.1%} | {med / 1e3:.2f} | {flops / med / 1e6:.0f} |")
    print("\nSM clock, power after each round:", "; ".join(clocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
