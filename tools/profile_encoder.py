"""Where one padded encoder forward's time goes (tools/bench_transformers.py's BERT-like encoder,
256 right-padded sentences of 8 to 68 tokens), per implementation: wall time, the host's and the
device's totals, the kernels by device time and the host ops by their own time.

    PYTHONPATH=. python3 tools/profile_encoder.py [--heads 12] [--impls sdpa jitattn jitattn:host_read]
"""
from __future__ import annotations

import argparse
import time

import torch

import jitattn.integrations.transformers as jt
from bench_transformers import encoder, inputs, padding


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=12, help="12: head dim 32; 6: head dim 64")
    parser.add_argument("--impls", nargs="+", default=["sdpa", "jitattn", "jitattn:host_read"])
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    jt.register()
    batch = inputs(torch.Generator().manual_seed(1))["sentences"]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"encoder d{384 // args.heads}")
    state = None
    for impl in args.impls:
        m = encoder(impl.partition(":")[0], args.heads, state).eval()
        state = state or m.state_dict()
        with torch.no_grad(), padding(impl):
            for _ in range(3):
                m(**batch)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                m(**batch)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / 5 * 1e3
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                m(**batch)
                torch.cuda.synchronize()
        events = prof.key_averages()
        device_of = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
        host = sum(e.self_cpu_time_total for e in events) / 1e3
        device = sum(device_of(e) for e in events) / 1e3
        print(f"\n== {impl}: wall {wall:.2f} ms per forward, host {host:.2f} ms, device {device:.2f} ms")
        kernels = sorted((e for e in events if device_of(e) > 0), key=lambda e: -device_of(e))[:8]
        for e in kernels:
            print(f"   device {device_of(e) / 1e3:8.3f} ms  x{e.count:<4d} {e.key[:90]}")
        ops = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
        for e in ops:
            print(f"   host   {e.self_cpu_time_total / 1e3:8.3f} ms  x{e.count:<4d} {e.key[:90]}")
        del m
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
