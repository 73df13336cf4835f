"""Cold compile and warm first-call times, each in a fresh process.

PYTHONPATH=. python tools/coldstart.py [--arch 9.0]
  cold: a fresh cache; one process imports torch and compiles one decode specialization
        (reports the build alone, from the manifest, and the whole process wall time).
  warm: a new process on that warm cache; time from after `import torch` (and, on a GPU, after
        the inputs exist) to the first result of single_decode_with_kv_cache (or to the module
        being loaded, without a GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COLD = """
import time; t0 = time.perf_counter()
import torch; t1 = time.perf_counter()
from jitattn.jit import loader
from jitattn.decode.spec import DecodeSpec
m, compiled = loader.build_spec(DecodeSpec(head_dim=128))
print({"import_torch_s": t1 - t0, "compiled": compiled, "after_torch_s": time.perf_counter() - t1})
"""

WARM = """
import time, torch
gpu = torch.cuda.is_available()
if gpu:
    q = torch.randn(32, 128, dtype=torch.float16, device="cuda")
    k = torch.randn(4096, 32, 128, dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()
t1 = time.perf_counter()
import jitattn
if gpu:
    jitattn.single_decode_with_kv_cache(q, k, k)
    torch.cuda.synchronize()
else:
    from jitattn.jit import loader
    from jitattn.decode.spec import DecodeSpec
    loader.get_module(DecodeSpec(head_dim=128))
t2 = time.perf_counter()
if gpu:
    for _ in range(3): jitattn.single_decode_with_kv_cache(q, k, k)
    torch.cuda.synchronize(); t3 = time.perf_counter()
    jitattn.single_decode_with_kv_cache(q, k, k); torch.cuda.synchronize()
    steady = time.perf_counter() - t3
else:
    steady = 0.0
import sys
print({"first_call_ms": (t2 - t1) * 1e3, "steady_call_ms": steady * 1e3, "gpu": gpu,
       "heavy_modules_imported": [m for m in ("jinja2", "filelock", "torch.utils.cpp_extension") if m in sys.modules]})
"""


def run(code: str, env: dict) -> tuple[dict, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"child failed:\n{out.stderr[-3000:]}")
    wall = time.perf_counter() - start
    return eval(out.stdout.strip().splitlines()[-1]), wall  # our own dict literal


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default=None, help="JITATTN_CUDA_ARCH_LIST for the cold build")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JITATTN_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        env.pop("JITATTN_CACHE_SEED_DIRS", None)
        env.pop("JITATTN_DISABLE_JIT", None)
        if args.arch:
            env["JITATTN_CUDA_ARCH_LIST"] = args.arch
        cold, wall = run(COLD, env)
        manifest = next(Path(cache).rglob("manifest.json"))
        build_s = json.loads(manifest.read_text())["built"]["seconds"]
        print(f"cold: build {build_s:.2f} s, whole process {wall:.2f} s "
              f"(import torch {cold['import_torch_s']:.2f} s, compiled={cold['compiled']})")
        warm, wall = run(WARM, env)
        print(f"warm: first call {warm['first_call_ms']:.1f} ms after import torch "
              f"(steady call {warm['steady_call_ms']:.2f} ms, gpu={warm['gpu']}, "
              f"heavy modules imported: {warm['heavy_modules_imported'] or 'none'}), process {wall:.2f} s")


if __name__ == "__main__":
    main()
