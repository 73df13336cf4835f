"""The D256 backward with dQ in its own kernel (VarlenBackwardSpec.dq_kernel) against the
single-kernel path it replaces, in one GPU job:

  1. correctness of both paths on a handful of D256 cases against float64 (the GPU tests'
     oracle and checks: tests/test_varlen_backward_gpu.py), and bitwise determinism of the new one;
  2. backward time, (forward + backward) - forward, of both paths, torch's varlen_attn and SDPA,
     interleaved rounds (tools/bench_util.interleaved_us), bf16 8 x 4096 tokens, 16 heads, full
     and causal, cold L2 (rotating input sets);
  3. each kernel of the two paths on its own (torch.profiler's CUDA kernel times), so the note
     can say which one bounds the new path.

    python3 tools/bwd_dq_ab.py [--rounds 3] [--skip-check] [--skip-bench]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import jitattn  # noqa: E402
from jitattn.varlen import backward_launch as launch  # noqa: E402

BF16, F16 = torch.bfloat16, torch.float16
PATHS = (True, False)  # check both paths (--new-only: the dq_kernel path alone)


def path(dq_kernel: bool):
    """Set which D256 path plan() takes (the module-level list plan reads) and drop cached ops."""
    launch.DQ_KERNEL_HEAD_DIMS = frozenset({256}) if dq_kernel else frozenset()
    launch._kernels.clear()


def check():
    from tests import test_varlen_backward_gpu as t
    from tests.varlen_utils import make_batch

    cases = [  # (what, make_batch args, window, extra)
        ("full bf16", dict(len_q=[300, 517], len_k=[300, 517], h_q=4, h_kv=4, dtype=BF16), (-1, -1), {}),
        ("causal bf16", dict(len_q=[1000, 129, 64], len_k=[1000, 129, 64], h_q=2, h_kv=2, dtype=BF16), (-1, 0), {}),
        ("window (37, 11) f16", dict(len_q=[400, 90], len_k=[400, 90], h_q=2, h_kv=2, dtype=F16), (37, 11), {}),
        ("gqa 4 causal bf16", dict(len_q=[200, 333], len_k=[200, 333], h_q=8, h_kv=2, dtype=BF16), (-1, 0), {}),
        ("gqa 3 (cp.async Q) full f16", dict(len_q=[150, 61], len_k=[150, 61], h_q=6, h_kv=2, dtype=F16), (-1, -1), {}),
        ("seqused_k slack, Lq != Lk, causal bf16",
         dict(len_q=[100, 250], len_k=[180, 300], h_q=4, h_kv=2, dtype=BF16, slack=[17, 70], use_seqused=True),
         (-1, 0), {}),
        ("empty and 1-row sequences f16", dict(len_q=[0, 1, 77], len_k=[5, 9, 100], h_q=2, h_kv=1, dtype=F16),
         (-1, -1), {}),
        ("soft cap 30 causal bf16", dict(len_q=[333, 64], len_k=[333, 64], h_q=2, h_kv=2, dtype=BF16), (-1, 0),
         dict(softcap=30.0)),
        ("lse gradient, sliding (64, 0) bf16", dict(len_q=[513], len_k=[513], h_q=2, h_kv=2, dtype=BF16), (64, 0),
         dict(with_lse=True)),
    ]
    failures = 0
    for dq_kernel in PATHS:
        path(dq_kernel)
        for i, (what, kw, window, extra) in enumerate(cases):
            b = make_batch(head_dim=256, seed=100 + i, **kw)
            name = f"{'dq_kernel' if dq_kernel else 'single kernel'}: {what}"
            try:
                errors = t.check_case(b, window, name, seed=i, **extra)
                print(f"PASS {name}: {', '.join(f'{k} {v:.2e}' for k, v in errors.items())}", flush=True)
            except AssertionError as exc:
                failures += 1
                print(f"FAIL {name}: {str(exc).splitlines()[0][:300]}", flush=True)
        print("  specs run:", sorted(spec.name for _, spec in launch._kernels.values()), flush=True)
    # Deterministic mode on the new path: the same kernels (no semaphores), bitwise equal twice.
    path(True)
    b = make_batch([700, 300], [700, 300], 4, 2, 256, BF16, seed=7)
    g = t.grad_out_for(b, 1)
    torch.use_deterministic_algorithms(True)
    try:
        one, two = t.run_backward(b, (-1, 0), g), t.run_backward(b, (-1, 0), g)
    finally:
        torch.use_deterministic_algorithms(False)
    same = all(torch.equal(x, y) for x, y in zip(one, two))
    failures += not same
    print(f"{'PASS' if same else 'FAIL'} dq_kernel deterministic: bitwise equal twice", flush=True)
    return failures


def bench(rounds: int):
    from bench_util import interleaved_us, median_spread, sets_needed, time_us
    from bench_varlen import torch_varlen, torch_window_kwargs

    batch, seq, heads, d = 8, 4096, 16, 256
    tokens = batch * seq
    cu = torch.arange(0, tokens + 1, seq, dtype=torch.int32, device="cuda")
    fn, params = torch_varlen()
    sets = []
    for _ in range(sets_needed(5 * tokens * heads * d * 2)):
        q, k, v = (torch.randn(tokens, heads, d, device="cuda", dtype=BF16).requires_grad_() for _ in range(3))
        do = torch.randn(tokens, heads, d, device="cuda", dtype=BF16)
        sdpa = [x.detach().view(batch, seq, heads, d).transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
        sets.append(((q, k, v), do, sdpa, do.view(batch, seq, heads, d).transpose(1, 2).contiguous()))

    def backward_us(forward, pick):
        def both(s):
            leaves, grad = pick(s)
            for x in leaves:
                x.grad = None
            forward(leaves).backward(grad)
        fwd = [lambda s=s: forward(pick(s)[0]) for s in sets]
        fb = [lambda s=s: both(s) for s in sets]
        return time_us(fb, warmup=3, reps=10) - time_us(fwd, warmup=3, reps=10)

    print("\n### D256 backward, bf16 8 x 4096 tokens, 16 heads: (forward + backward) - forward, CUDA events, "
          f"3 warm-up, median of 10, cold L2; {rounds} interleaved rounds (median [min, max]); "
          "FLOPs 2.5x forward, causal half\n")
    print("| causal | variant | us | TFLOP/s | vs torch varlen | vs SDPA |")
    print("|---|---|---:|---:|---:|---:|")
    for causal in (False, True):
        window = (-1, 0) if causal else (-1, -1)
        flops = 2.5 * batch * 4 * seq * seq * d * heads * (0.5 if causal else 1.0)
        ours = lambda leaves: jitattn.varlen_attn(*leaves, cu, cu, seq, seq, window_size=window)
        mine = lambda s: (s[0], s[1])

        def variant(dq_kernel):
            def run():
                path(dq_kernel)
                return backward_us(ours, mine)
            return run

        timers = {"dq_kernel (new)": variant(True), "single kernel (old)": variant(False)}
        kw = torch_window_kwargs(params, causal)
        if fn is not None and kw is not None:
            timers["torch varlen_attn"] = lambda: backward_us(lambda l: fn(*l, cu, cu, seq, seq, **kw), mine)
        timers["SDPA"] = lambda: backward_us(lambda l: F.scaled_dot_product_attention(*l, is_causal=causal),
                                             lambda s: (s[2], s[3]))
        times = interleaved_us(timers, rounds)
        med = {n: median_spread(t) for n, t in times.items()}
        for name, (m, lo, hi) in med.items():
            vs = lambda peer: f"{med[peer][0] / m:.2f}x" if peer in med else "-"
            print(f"| {causal} | {name} | {m:.0f} [{lo:.0f}, {hi:.0f}] | {flops / m / 1e6:.1f} "
                  f"| {vs('torch varlen_attn')} | {vs('SDPA')} |", flush=True)
        # Each kernel on its own: CUDA kernel times over 5 backward calls per path.
        for dq_kernel in (True, False):
            path(dq_kernel)
            leaves, grad = sets[0][0], sets[0][1]
            out = ours(leaves)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    out.backward(grad, retain_graph=True)
                torch.cuda.synchronize()
            per = {}
            for a in prof.key_averages():
                if "varlen_bwd" in a.key:
                    total = getattr(a, "device_time_total", None) or getattr(a, "cuda_time_total", 0.0)
                    name = next(n for n in ("varlen_bwd_dq", "varlen_bwd_pre", "varlen_bwd_post", "varlen_bwd") if n in a.key)
                    per[name] = per.get(name, 0.0) + total / max(a.count, 1)
            kernels = ", ".join(f"{k} {v:.0f} us" for k, v in sorted(per.items()))
            print(f"|  | kernels of {'dq_kernel' if dq_kernel else 'single kernel'} | {kernels} | | | |", flush=True)
            for x in leaves:
                x.grad = None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--new-only", action="store_true", help="check only the dq_kernel path")
    args = parser.parse_args()
    global PATHS
    if args.new_only:
        PATHS = (True,)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    failures = 0 if args.skip_check else check()
    if not args.skip_bench:
        bench(args.rounds)
    print(f"\ncorrectness failures: {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
