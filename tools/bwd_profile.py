"""Where a training step's attention time goes: every GPU kernel of one forward + backward, for
jitattn, torch's varlen_attn and SDPA, under torch.profiler (CUPTI kernel records, one profile
per step, after warm-up; each step on its own input set).

bf16, 8 x 4096 tokens, 32 heads, causal and full. Per kernel: launches a step and microseconds a
step (median over the profiled steps), then the step's GPU span (first kernel start to last
kernel end) and the idle time between its kernels. The benchmarks' "backward" (forward +
backward minus forward) is the span less the forward kernels'.

  python3 tools/bwd_profile.py --dims 128 64 --steps 3
  python3 tools/bwd_profile.py --dims 128 --timeline   # + each launch's start / end (PDL overlap)
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import jitattn  # noqa: E402
from bench_varlen import torch_varlen, torch_window_kwargs  # noqa: E402
from bwd_ab import training_sets  # noqa: E402

def kernels_of(step) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel / memset / memcpy one call of `step` ran."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if str(e.device_type).endswith("CUDA"):
            out.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(out, key=lambda k: k[1])


def report(label: str, steps: list, timeline: bool = False) -> None:
    runs = [kernels_of(s) for s in steps]
    per_name = defaultdict(list)
    offsets = defaultdict(list)  # name -> (start, end) from the step's first kernel start, per launch
    spans, idles = [], []
    for kernels in runs:
        totals = defaultdict(lambda: [0, 0.0])
        for i, (name, start, end) in enumerate(kernels):
            offsets[(i, name)].append((start - kernels[0][1], end - kernels[0][1]))
            totals[name][0] += 1
            totals[name][1] += end - start
        for name, (count, us) in totals.items():
            per_name[name].append((count, us))
        spans.append(kernels[-1][2] - kernels[0][1])
        busy_end, idle = kernels[0][1], 0.0
        for _, start, end in kernels:
            idle += max(0.0, start - busy_end)
            busy_end = max(busy_end, end)
        idles.append(idle)
    print(f"\n{label}: GPU span {statistics.median(spans):9.1f} us a step, idle between kernels "
          f"{statistics.median(idles):7.1f} us")
    order = sorted(per_name, key=lambda n: -statistics.median(us for _, us in per_name[n]))
    for name in order:
        counts = [c for c, _ in per_name[name]]
        us = statistics.median(u for _, u in per_name[name])
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"  {us:9.1f} us  x{max(counts)}  {short}", flush=True)
    if timeline:  # overlap between kernels (PDL): each launch's start / end in the step, medians
        print("  timeline (us from the step's first kernel start):")
        for (i, name), ranges in sorted(offsets.items()):
            short = name if len(name) <= 70 else name[:67] + "..."
            print(f"    {statistics.median(s for s, _ in ranges):9.1f} .. {statistics.median(e for _, e in ranges):9.1f}  {short}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", nargs="*", type=int, default=[128])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--timeline", action="store_true", help="each launch's start / end within the step")
    args = ap.parse_args()
    batch, seq, heads = 8, 4096, 32
    cu_seq = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seq
    for head_dim in args.dims:
        sets = training_sets(args.steps + 1, batch, seq, heads, head_dim)
        for causal in (False, True):
            window = (-1, 0) if causal else (-1, -1)
            callers = {"jitattn": lambda s: jitattn.varlen_attn(*s[0], cu_seq, cu_seq, seq, seq, window_size=window)}
            if not args.no_peers:
                fn, params = torch_varlen()
                kw = torch_window_kwargs(params, causal)
                callers["torch varlen"] = lambda s: fn(*s[0], cu_seq, cu_seq, seq, seq, **kw)
            for name, call in callers.items():
                def step(s, call=call):
                    for t in s[0]:
                        t.grad = None
                    call(s).backward(s[1])
                for s in sets[:2]:
                    step(s)  # warm-up (and any first-call work)
                report(f"D{head_dim} {'causal' if causal else 'full'} {name}", [lambda s=s: step(s) for s in sets[1:]],
                       args.timeline)
            if not args.no_peers:
                def sdpa_step(s):
                    for t in s[2]:
                        t.grad = None
                    F.scaled_dot_product_attention(*s[2], is_causal=causal).backward(s[3])
                for s in sets[:2]:
                    sdpa_step(s)
                report(f"D{head_dim} {'causal' if causal else 'full'} SDPA", [lambda s=s: sdpa_step(s) for s in sets[1:]],
                       args.timeline)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
