"""The first varlen_attn call with grad beside the same call without, each in a new process (GPU).

PYTHONPATH=. python tools/first_call_grad.py [--runs 3]
Issue 47's acceptance: in a new process on a warm kernel cache, the first call with
requires_grad within 50 ms of the first call without. The clock starts after `import torch,
jitattn`, CUDA init and the inputs exist, and stops when the result is on the host (and, for
"grad + backward", after the first backward too). Also prints which of torch._dynamo, sympy and
torch.distributed.fsdp the process imported (notes/first-call.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = """
import json, sys, time, torch, jitattn
mode = sys.argv[1]
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(4096, 16, 128, dtype=torch.bfloat16, device="cuda", generator=g) for _ in range(3))
cu = torch.tensor([0, 1024, 2048, 4096], dtype=torch.int32, device="cuda")
if mode != "no grad":
    q.requires_grad_()
torch.cuda.synchronize()
start = time.perf_counter()
out = jitattn.varlen_attn(q, k, v, cu, cu, 2048, 2048, window_size=(-1, 0))
if mode == "grad + backward":
    out.sum().backward()
torch.cuda.synchronize()
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "imported": [m for m in ("torch._dynamo", "sympy", "torch.distributed.fsdp")
                                                   if m in sys.modules]}))
"""
MODES = ("no grad", "grad", "grad + backward")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for mode in MODES:  # warm the kernel cache (and the .pyc files) once
        subprocess.run([sys.executable, "-c", RUN, mode], env=env, check=True, capture_output=True)
    results = {mode: [] for mode in MODES}
    for _ in range(args.runs):
        for mode in MODES:
            out = subprocess.run([sys.executable, "-c", RUN, mode], env=env, check=True, capture_output=True, text=True)
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(r["seconds"] for r in results["no grad"])
    print(f"{'first call':18s} {'median ms':>10s} {'vs no grad':>11s}  imported")
    for mode in MODES:
        median = statistics.median(r["seconds"] for r in results[mode])
        print(f"{mode:18s} {median * 1e3:10.1f} {(median - base) * 1e3:+10.1f}  {results[mode][-1]['imported']}")


if __name__ == "__main__":
    main()
