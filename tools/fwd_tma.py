"""The wgmma prefill forward's producer (VarlenSpec tma, the paged page ids) layout by layout.

bf16 8 x 4096 tokens, D*H = 2048 (D128 x 16 heads, D256 x 8), full and causal: TFLOP/s with K/V
contiguous, contiguous with seqused_k, and in a page pool (page 16 and 256, pages a random
permutation of the pool), for each variant of the producer shapes ("default", "tma=0", "tma=1"),
beside SDPA (cuDNN) on the contiguous keys, in one run. First a float64-reference check of each
variant: ragged causal batches with empty and 1-row sequences, windows, GQA, splits, seqused_k
with slack, pages 1..256, every unread K/V row NaN. Also host time per call of a small
prefill call (what encoding the two tensor maps per call costs).
  PYTHONPATH=<checkout> python tools/fwd_tma.py [--quick] [--variants default tma=0 tma=1] [--tag main]
The checkout on PYTHONPATH is the one measured (nothing here puts this file's own on sys.path),
so another checkout's kernels can be timed in the same job ("default" is all an older one knows).
Variants, layouts and SDPA are timed in interleaved rounds (--rounds; the clocks drift over a job).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch.nn.functional as F

import jitattn
from bench_util import host_us_per_call, interleaved_us, median_spread, page_pools, sets_needed, time_us

BF16 = torch.bfloat16


def use_variant(variant: str) -> None:
    """Later varlen calls run the producer shapes (wgmma, head_dim >= 128) with `variant`'s fields."""
    from jitattn.varlen import forward, spec

    forward._kernels.clear()
    overrides = {}
    if variant != "default":
        for item in variant.split(","):
            name, value = item.split("=")
            overrides[name] = bool(int(value))

    def make(*args, **kwargs):
        made = spec.VarlenSpec(*args, **kwargs)
        return dataclasses.replace(made, **overrides) if made.has_producer else made

    forward.VarlenSpec = make if overrides else spec.VarlenSpec


def check_variant(head_dim: int) -> str:
    from tests.varlen_utils import check, make_batch, reference, run

    cases = [  # (len_q, len_k, h_q, h_kv, paged, page, window, splits, seqused slack)
        ([1, 77, 300, 1024, 0, 513], [1, 77, 300, 1024, 5, 700], 8, 8, False, 0, (-1, 0), None, None),
        ([256, 1000, 64], [256, 1500, 64], 8, 2, True, 16, (128, 0), None, None),
        ([900, 33], [900, 2000], 16, 2, True, 16, (-1, -1), 2, None),
        ([640, 1], [640, 4096], 8, 8, False, 0, (37, 11), 1, None),
        ([500, 129, 3], [700, 129, 1030], 8, 8, False, 0, (-1, -1), None, [9, 100, 0]),
        ([700, 130], [1000, 300], 8, 8, False, 0, (-1, 0), None, [1, 7]),
    ]
    for page in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        cases.append(([300, 1, 999], [557, 4, 1281], 8, 4, True, page, (-1, 0), None, None))
        cases.append(([512, 128], [512, 2048], 8, 8, True, page, (-1, -1), None, None))
    worst = 0.0
    for i, (lq, lk, hq, hkv, paged, page, window, splits, slack) in enumerate(cases):
        b = make_batch(lq, lk, hq, hkv, head_dim, BF16, seed=i, paged=paged, page_size=page or 16,
                       slack=slack, use_seqused=slack is not None)
        out, lse = run(b, window=window, num_splits=splits, want_lse=True)
        ref = reference(b, window)
        check(b, out, lse, ref, f"d{head_dim} case {i}")  # raises on a wrong row
        err = ((out.double() - ref[0]).nan_to_num().norm() / ref[0].nan_to_num().norm().clamp_min(1e-30)).item()
        worst = max(worst, err)
    return f"ok ({len(cases)} cases), worst rel err {worst:.2e}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--variants", nargs="+", default=["default"])
    parser.add_argument("--tag", default="")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (bench_util.interleaved_us)")
    args = parser.parse_args()
    reps = 10 if args.quick else 30
    tag = f"{args.tag} " if args.tag else ""
    batch, seq = 8, 4096
    cu_seq = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device="cuda")
    used = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    if not args.no_check:
        for name in args.variants:
            use_variant(name)
            for d in args.head_dims:
                try:
                    print(f"check {tag}{name} d{d}: {check_variant(d)}", flush=True)
                except AssertionError as exc:
                    print(f"check {tag}{name} d{d}: FAILED {str(exc)[:400]}", flush=True)

    # Host time of a small prefill call on a producer shape (16 heads x 2 x 256 tokens, D128).
    q = torch.randn(512, 16, 128, device="cuda", dtype=BF16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu_small = torch.tensor([0, 256, 512], dtype=torch.int32, device="cuda")
    for name in args.variants:
        use_variant(name)
        us = host_us_per_call(lambda: jitattn.varlen_attn(q, k, v, cu_small, cu_small, 256, 256,
                                                          window_size=(-1, 0)), calls=3000)
        print(f"host {tag}{name}: {us:.2f} us per call (2 x 256 tokens, 16 heads, D128, causal)", flush=True)

    layouts = ["contiguous", "seqused_k", "page 16", "page 256"]
    print(f"\n{tag}bf16 8 x 4096, D*H = 2048, TFLOP/s, median of {reps}, cold L2 (rotating sets), median over "
          f"{args.rounds} interleaved rounds\n")
    print("| D | causal | variant | " + " | ".join(layouts) + " | page 16 / contiguous | page 256 / contiguous | SDPA |")
    print("|---:|---|---|" + "---:|" * (len(layouts) + 3))
    for head_dim in args.head_dims:
        heads, tokens = 2048 // head_dim, batch * seq
        sets = []
        for _ in range(sets_needed(8 * tokens * heads * head_dim * 2)):
            q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=BF16) for _ in range(3))
            sdpa = [t.view(batch, seq, heads, head_dim).transpose(1, 2).contiguous() for t in (q, k, v)]
            sets.append((q, k, v, sdpa, page_pools(k, v, batch, seq)))
        for causal in (False, True):
            window = (-1, 0) if causal else (-1, -1)
            flops = batch * 4 * seq * seq * head_dim * heads * (0.5 if causal else 1.0)
            calls = {
                "contiguous": lambda s: jitattn.varlen_attn(s[0], s[1], s[2], cu_seq, cu_seq, seq, seq, window_size=window),
                "seqused_k": lambda s: jitattn.varlen_attn(s[0], s[1], s[2], cu_seq, cu_seq, seq, seq, window_size=window,
                                                           seqused_k=used),
                "page 16": lambda s: jitattn.varlen_attn(s[0], s[4][16][0], s[4][16][1], cu_seq, None, seq, seq,
                                                         window_size=window, seqused_k=used, block_table=s[4][16][2]),
                "page 256": lambda s: jitattn.varlen_attn(s[0], s[4][256][0], s[4][256][1], cu_seq, None, seq, seq,
                                                          window_size=window, seqused_k=used, block_table=s[4][256][2]),
            }
            for name in args.variants:
                use_variant(name)
                base = calls["contiguous"](sets[0])
                for layout in layouts[1:]:  # every layout computes the same attention
                    err = ((calls[layout](sets[0]).float() - base.float()).norm() / base.float().norm()).item()
                    if not err < 1e-2:
                        print(f"MISMATCH {name} d{head_dim} causal={causal} {layout}: rel {err:.2e}", flush=True)

            def timer(name, layout):
                def run():
                    use_variant(name)
                    return time_us([lambda s=s, f=calls[layout]: f(s) for s in sets], warmup=5, reps=reps)
                return run
            # Every variant and layout, and SDPA, in interleaved rounds: the clocks drift over a job.
            timers = {(name, lay): timer(name, lay) for name in args.variants for lay in layouts}
            timers["SDPA"] = lambda: time_us([lambda s=s: F.scaled_dot_product_attention(*s[3], is_causal=causal)
                                              for s in sets], warmup=5, reps=reps)
            tf = {key: flops / median_spread(times)[0] / 1e6 for key, times in interleaved_us(timers, args.rounds).items()}
            for name in args.variants:
                row = [tf[name, lay] for lay in layouts]
                print(f"| {head_dim} | {causal} | {tag}{name} | " + " | ".join(f"{x:.1f}" for x in row) +
                      f" | {row[2] / row[0]:.2f}x | {row[3] / row[0]:.2f}x | {tf['SDPA']:.1f} |", flush=True)
        del sets
        torch.cuda.empty_cache()
    use_variant("default")


if __name__ == "__main__":
    sys.exit(main())
