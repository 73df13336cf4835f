"""Per-kernel GPU times of jitattn's variant calls (tools/bench_variants.py's shapes and variants):
where a variant's time goes, e.g. the mask map's kernel against the attention kernels.

torch.profiler over `--iters` forward and forward + backward calls, each kernel's mean time per
call (µs) and its share. Warm (compiled, traced) before profiling.

    python3 tools/variant_kernels.py --only "document mask" "causal mask" [--batch 8 --seqlen 4096]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jitattn  # noqa: E402
from bench_variants import shape_arguments, variant_set  # noqa: E402


def kernel_times(fn, iters: int) -> dict[str, float]:
    """Kernel name -> mean µs per call of fn over iters calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time if hasattr(event, "device_time") else event.cuda_time
    return {name: us / iters for name, us in totals.items()}


def short(name: str) -> str:
    for key in ("mask_map", "varlen_bwd_pre", "varlen_bwd_post", "varlen_bwd_dq", "varlen_bwd", "merge_splits",
                "varlen_fwd"):
        if key in name:
            return key
    return name[:40]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape_arguments(parser)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=None, help="variant names (substring match)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    b, l, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    q, k, v = (torch.randn(b * l, h, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    cu = torch.arange(0, (b + 1) * l, l, dtype=torch.int32, device=device)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"bf16 {b}x{l} H{h} D{d}", flush=True)
    print("\n| variant | call | kernel | µs per call | share |\n|---|---|---|---:|---:|")
    cases = {"built-in": (None, None, True), **variant_set(b, l, h, device)}
    for name, (score_mod, mask_mod, full) in cases.items():
        if args.only and not any(o in name for o in args.only):
            continue
        window = (-1, -1) if full else (-1, 0)
        if mask_mod is not None:
            window = (-1, -1)

        def forward():
            return jitattn.varlen_attn(q, k, v, cu, cu, l, l, window_size=window, score_mod=score_mod,
                                       mask_mod=mask_mod)

        def fwd():
            with torch.no_grad():
                forward()

        def fwd_bwd():
            torch.autograd.grad(forward(), (q, k, v), grad)

        for call, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            times = kernel_times(fn, args.iters)
            total = sum(times.values())
            merged: dict[str, float] = collections.defaultdict(float)
            for kernel, us in times.items():
                merged[short(kernel)] += us
            for kernel, us in sorted(merged.items(), key=lambda kv: -kv[1]):
                if us >= 0.01 * total:
                    print(f"| {name} | {call} | {kernel} | {us:.1f} | {100 * us / total:.0f}% |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
