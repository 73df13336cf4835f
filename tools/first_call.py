"""The first call of a new process on a warm cache, and where its time goes.

PYTHONPATH=. python tools/first_call.py [--runs 5] [--tree DIR ...]
Each run is a fresh process on the cache the environment names (JITATTN_CACHE_DIR, seed dirs,
strict mode: as production runs it). The clock starts after `import torch`, CUDA init and the
inputs exist (as tools/coldstart.py), and stops when the first result is on the host:
  decode:         single_decode_with_kv_cache, q 32x128 fp16 over 4096 keys of 32 heads
  decode-second:  then a second specialization in the same process (group 4, tensor cores)
  varlen:         varlen_attn, 4 sequences of 1 query over 1k-4k keys, 32/8 heads of 128, bf16
  breakdown:      the decode call's steps one by one (imports, cache lookup, load, first launch)
--tree runs the same in another checkout (e.g. the commit before, to compare), first on PYTHONPATH.
The first run of a tree may also compile its .pyc files (a fresh copy); the table shows it apart.
Without a GPU only the breakdown's host part runs.
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

SETUP = """
import json, sys, time
import torch
T = time.perf_counter
gpu = torch.cuda.is_available()
dev = "cuda" if gpu else "cpu"
g = torch.Generator(device=dev).manual_seed(0)
q = torch.randn(32, 128, dtype=torch.float16, device=dev, generator=g)
k = torch.randn(4096, 32, 128, dtype=torch.float16, device=dev, generator=g)
vq = torch.randn(4, 32, 128, dtype=torch.bfloat16, device=dev, generator=g)
vk = torch.randn(10000, 8, 128, dtype=torch.bfloat16, device=dev, generator=g)
cu_q = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32, device=dev)
cu_k = torch.tensor([0, 1000, 3000, 6000, 10000], dtype=torch.int32, device=dev)
if gpu:
    torch.cuda.synchronize()
def sync():
    if gpu:
        torch.cuda.synchronize()
result = {}
"""

MODES = {
    "decode": """
t0 = T()
import jitattn
jitattn.single_decode_with_kv_cache(q, k, k); sync()
result["first_ms"] = (T() - t0) * 1e3
t1 = T(); jitattn.single_decode_with_kv_cache(q, k, k); sync(); result["second_call_ms"] = (T() - t1) * 1e3
""",
    "decode-second": """
import jitattn
jitattn.single_decode_with_kv_cache(q, k, k); sync()
kg = k[:, :8].contiguous(); sync()
t0 = T(); jitattn.single_decode_with_kv_cache(q, kg, kg); sync()
result["first_ms"] = (T() - t0) * 1e3
""",
    "varlen": """
t0 = T()
import jitattn
jitattn.varlen_attn(vq, vk, vk, cu_q, cu_k, 1, 4000, enable_gqa=True); sync()
result["first_ms"] = (T() - t0) * 1e3
""",
    "breakdown": """
import inspect
steps = []
t = [T()]
def step(name):
    now = T(); steps.append((name, (now - t[0]) * 1e3)); t[0] = now
import jitattn; step("import jitattn")
import jitattn.decode.api as api; step("import jitattn.decode.api (and what it imports)")
from jitattn.jit import cache, env, keys, loader, toolchain
from jitattn.decode.spec import DecodeSpec
from jitattn.decode.launch import DecodeKernel
spec = DecodeSpec.for_call(128, "float16", "float16", "NONE", False, 1)
archs = spec.archs_for(toolchain.target_archs()[0]); tag = toolchain.arch_tag(archs); step("target archs")
wanted = keys.components(spec, keys.BuildTarget(archs, "", "")); step("key components (template digest)")
if not env.jit_disabled():
    try:
        toolchain.fingerprint(memo_dir=env.cache_dir())
    except Exception:
        pass
    step("toolchain memo (not strict)")
paths = [p for layer in loader.layers() for p in cache.siblings(layer, keys.CACHE_SCHEMA, tag, spec.name)]
step("list cache layers")
kw = {"stamps": env.cache_dir() / cache.STAMPS} if "stamps" in inspect.signature(cache.read_entry).parameters else {}
entries = [e for e in (cache.read_entry(p, **kw) for p in paths) if e is not None]
step(f"read_entry x{len(paths)} (manifest, verify)")
module = loader.get_module(spec); step("get_module (rest: load_library, ops namespace)")
kernel = DecodeKernel(module); step("DecodeKernel (ctypes entry point)")
if gpu:
    kernel.capacity(q.device); step("capacity (occupancy query: loads the CUDA module)")
    jitattn.single_decode_with_kv_cache(q, k, k); sync(); step("first call after these (plan, alloc, launch, sync)")
    jitattn.single_decode_with_kv_cache(q, k, k); sync(); step("second call")
result["steps"] = steps
result["first_ms"] = sum(ms for name, ms in steps if name != "second call")
""",
}


def run(tree: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", SETUP + MODES[mode] + "\nprint(json.dumps(result))"], env=env,
                         capture_output=True, text=True, cwd=str(tree))
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tree", type=Path, action="append", default=[])
    parser.add_argument("--modes", default="decode,decode-second,varlen,breakdown")
    parser.add_argument("--skip-self", action="store_true", help="only the --tree checkouts")
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    modes = [m for m in args.modes.split(",") if gpu or m == "breakdown"]
    for tree in ([] if args.skip_self else [ROOT]) + args.tree:
        print(f"\n== {tree} (strict={os.environ.get('JITATTN_DISABLE_JIT', '0')}, gpu={gpu})")
        for mode in modes:
            results = [run(tree, mode) for _ in range(args.runs)]
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                print(f"{mode:14s} failed: {errors[0]}")
                continue
            times = [r["first_ms"] for r in results]
            rest = times[1:] or times
            print(f"{mode:14s} first process {times[0]:6.1f} ms (may compile .pyc); next {len(rest)}: median "
                  f"{statistics.median(rest):6.1f}, min {min(rest):6.1f}, max {max(rest):6.1f} ms")
            if mode == "breakdown":
                last = results[-1]["steps"]
                for name, ms in last:
                    print(f"    {ms:7.2f} ms  {name}")
            if mode == "decode":
                print(f"    second call {statistics.median(r['second_call_ms'] for r in results):.2f} ms")


if __name__ == "__main__":
    main()
