"""Backward variants A/B on one GPU: VarlenBackwardSpec field overrides timed in interleaved rounds
(the H200's clocks drift between rounds; bench_util.interleaved_us), each checked against the
float64 reference first, with torch's varlen_attn and SDPA in the same rounds.

bf16, 8 x 4096 tokens (--shape), D64 x 32 heads / D128 x 32, causal and full; backward = (forward +
backward) - forward, CUDA events, cold L2 (rotated input sets), median of `--reps` calls a round;
TFLOP/s with backward FLOPs = 2.5x forward (causal half), as tools/bench_varlen.py counts them.

  python3 tools/bwd_ab.py --dims 128 --variant base:consumer_regs=224 --variant new:consumer_regs=240
  python3 tools/bwd_ab.py --dims 128 --variant new:consumer_regs=240 --once   # one call each (ncu)

A variant is `name:field=value,field=value` applied (dataclasses.replace) to what
backward_launch.plan picks for the dims listed; `name:` alone is the default plan.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import jitattn  # noqa: E402
from bench_util import sets_needed, time_us  # noqa: E402
from bench_varlen import torch_varlen, torch_window_kwargs  # noqa: E402
from jitattn.reference import varlen_attn_reference  # noqa: E402
from jitattn.reference_backward import varlen_attn_backward  # noqa: E402
from jitattn.varlen import backward_launch as launch  # noqa: E402

BF16 = torch.bfloat16


def parse_variant(text: str):
    name, _, rest = text.partition(":")
    fields = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        fields[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.lstrip("-").isdigit() else value)
    return name, fields


@contextlib.contextmanager
def variant(fields: dict, dims):
    """backward_launch plans `fields` over its own choice at head_dims `dims`."""
    saved_plan, saved_kernels = launch.plan, dict(launch._kernels)

    def plan(head_dim, dtype, wgmma=False, soft_cap=False, deterministic=False):
        spec = saved_plan(head_dim, dtype, wgmma, soft_cap, deterministic)
        return dataclasses.replace(spec, **fields) if head_dim in dims and fields else spec

    launch.plan = plan
    launch._kernels.clear()
    try:
        yield
    finally:
        launch.plan = saved_plan
        launch._kernels.clear()
        launch._kernels.update(saved_kernels)


def training_sets(count, batch, seq, heads, head_dim):
    """`count` input sets of a training step, each ([q, k, v] packed (T, H, D) leaves, dout, the
    same q / k / v as SDPA's (B, H, S, D) leaves, SDPA's dout), bf16."""
    sets = []
    for _ in range(count):
        qkv = [torch.randn(batch * seq, heads, head_dim, device="cuda", dtype=BF16).requires_grad_() for _ in range(3)]
        do = torch.randn(batch * seq, heads, head_dim, device="cuda", dtype=BF16)
        sdpa = [t.detach().view(batch, seq, heads, head_dim).transpose(1, 2).contiguous().requires_grad_() for t in qkv]
        sets.append((qkv, do, sdpa, do.view(batch, seq, heads, head_dim).transpose(1, 2).contiguous()))
    return sets


def check(name, fields, head_dim, gen):
    """Max error of dq / dk / dv against float64, relative to each reference's largest entry
    (GQA 8 / 2 heads, varlen lengths, full, causal and a sliding window); NaN fails."""
    lengths = [int(x) for x in torch.randint(1, 1500, (4,), generator=gen).tolist()] + [2048]
    cu_seq = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, worst = sum(lengths), 0.0
    for window in ((-1, -1), (-1, 0), (200, 0)):
        q = torch.randn(total, 8, head_dim, device="cuda", dtype=BF16)
        k, v = (torch.randn(total, 2, head_dim, device="cuda", dtype=BF16) for _ in range(2))
        do = torch.randn(total, 8, head_dim, device="cuda", dtype=BF16)
        with variant(fields, {head_dim}):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = jitattn.varlen_attn(qq, kk, vv, cu_seq, cu_seq, max(lengths), max(lengths), window_size=window,
                                      enable_gqa=True)
            out.backward(do)
        ref_out, ref_lse = varlen_attn_reference(q, k, v, cu_seq, cu_seq, max(lengths), max(lengths),
                                                 window_size=window, enable_gqa=True)
        ref = varlen_attn_backward(do.double(), None, q.double(), k.double(), v.double(), ref_out, ref_lse, cu_seq,
                                   cu_seq, window_size=window, compute_dtype=torch.float64)
        for g, r in zip((qq.grad, kk.grad, vv.grad), ref):
            err = ((g.double() - r).abs().max() / r.abs().max()).item()
            worst = max(worst, err) if err == err else float("nan")
    ok = worst == worst and worst < 2e-2
    print(f"check {name} D{head_dim}: max error {worst:.2e} of the largest entry ({'ok' if ok else 'FAILED'})",
          flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", nargs="*", type=int, default=[128])
    ap.add_argument("--variant", action="append", default=[], help="name:field=value,...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--once", action="store_true", help="one forward + backward per variant and mask (for ncu)")
    ap.add_argument("--shape", default="8x4096", help="sequences x tokens each (same FLOPs: 2x16384, 1x32768)")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant] or [("default", {})]
    batch, seq = (int(x) for x in args.shape.split("x"))
    cu_seq = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seq
    gen = torch.Generator().manual_seed(20)
    failed = False
    for head_dim in args.dims:
        heads = 32
        if not args.no_check and not args.once:
            for name, fields in variants:
                failed |= not check(name, fields, head_dim, gen)
        tokens = batch * seq
        sets = training_sets(1 if args.once else sets_needed(5 * tokens * heads * head_dim * 2), batch, seq, heads,
                             head_dim)
        for causal in (False, True):
            window = (-1, 0) if causal else (-1, -1)
            flops = 2.5 * batch * 4 * seq * seq * head_dim * heads * (0.5 if causal else 1.0)
            ours = lambda s: jitattn.varlen_attn(*s[0], cu_seq, cu_seq, seq, seq, window_size=window)

            def calls(forward, grads_of):
                def fwd(s):
                    with torch.no_grad():
                        forward(s)

                def both(s):
                    for t in grads_of(s):
                        t.grad = None
                    forward(s).backward(s[1] if grads_of(s) is s[0] else s[3])

                return [lambda s=s: fwd(s) for s in sets], [lambda s=s: both(s) for s in sets]

            if args.once:
                for name, fields in variants:
                    with variant(fields, set(args.dims)):
                        calls(ours, lambda s: s[0])[1][0]()
                torch.cuda.synchronize()
                print(f"once D{head_dim} causal={causal}: {[n for n, _ in variants]}", flush=True)
                continue
            timers = {}
            fwd_only, _ = calls(ours, lambda s: s[0])
            timers["jitattn forward"] = lambda: time_us(fwd_only, args.warmup, args.reps)
            for name, fields in variants:
                def timer(fields=fields):
                    with variant(fields, set(args.dims)):
                        return time_us(calls(ours, lambda s: s[0])[1], args.warmup, args.reps)
                timers[name] = timer
            if not args.no_peers:
                fn, params = torch_varlen()
                kw = torch_window_kwargs(params, causal)
                tv = lambda s: fn(*s[0], cu_seq, cu_seq, seq, seq, **kw)
                tf, tb = calls(tv, lambda s: s[0])
                timers["torch varlen forward"] = lambda: time_us(tf, args.warmup, args.reps)
                timers["torch varlen"] = lambda: time_us(tb, args.warmup, args.reps)
                sd = lambda s: F.scaled_dot_product_attention(*s[2], is_causal=causal)
                sf, sb = calls(sd, lambda s: s[2])
                timers["SDPA forward"] = lambda: time_us(sf, args.warmup, args.reps)
                timers["SDPA"] = lambda: time_us(sb, args.warmup, args.reps)
            # Interleaved rounds (not bench_util.interleaved_us: it sorts, and each backward takes
            # its own round's forward).
            times = {name: [] for name in timers}
            for _ in range(args.rounds):
                for name, timer in timers.items():
                    times[name].append(timer())
            print(f"\n{batch} x {seq}, D{head_dim} x {heads} heads, {'causal' if causal else 'full'}: backward us (median, min..max "
                  f"of {args.rounds} rounds), TFLOP/s of the median")
            fwd_of = {"torch varlen": "torch varlen forward", "SDPA": "SDPA forward"}
            for name in timers:
                if name.endswith("forward"):
                    continue
                base = times[fwd_of.get(name, "jitattn forward")]
                per_round = sorted(b - f for b, f in zip(times[name], base))  # same round's forward
                med = statistics.median(per_round)
                print(f"  {name:<24} {med:9.1f} us ({per_round[0]:.1f}..{per_round[-1]:.1f})  "
                      f"{flops / med / 1e6:7.1f} TFLOP/s", flush=True)
        del sets
        torch.cuda.empty_cache()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
