"""The warm path after a fleet pull, against today's local warm path, in one run.

PYTHONPATH=. python tools/remote_warm.py [--arch 9.0] [--rounds 5] [--calls 100000] [--redis-server PATH]

Starts its own redis-server on a free localhost port (stopped at the end), builds one decode
specialization (head_dim 128) with nvcc into root A, which publishes it. Then, in rounds,
each a fresh process:
  pull    a process on a new empty root B_i: the first call pulls the entry from Redis
  local   a process on root A (its own build): today's warm path
  after   a second process on B_i: the first call after the pull, then the per-call cost
(local and after alternate their order from round to round).
Reports, per kind, the median over the rounds of: the first call (from after the imports to
the module loaded, or with a GPU to the first result of single_decode_with_kv_cache) and the
per-call cost after it (get_module, or the API call with a GPU), and whether the process imported
redis. `local` and `after` must match: after a pull the entry is local like any other.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.redis_server import RedisServer  # noqa: E402
SECRET = "remote-warm-tool-secret-0123456789"

BUILD = """
from jitattn.jit import loader
from jitattn.jit.registry import spec_from_dict
m, compiled = loader.build_spec(spec_from_dict({"family": "decode", "head_dim": 128}))
print({"compiled": compiled})
"""

CHILD = """
import sys, time, json
import torch
gpu = torch.cuda.is_available()
import jitattn
from jitattn.jit import loader
from jitattn.jit.registry import spec_from_dict
calls = int(sys.argv[1])
spec = spec_from_dict({"family": "decode", "head_dim": 128})
if gpu:
    q = torch.randn(32, 128, dtype=torch.float16, device="cuda")
    k = torch.randn(16, 32, 128, dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()
t0 = time.perf_counter()
if gpu:
    jitattn.single_decode_with_kv_cache(q, k, k)
    torch.cuda.synchronize()
else:
    loader.get_module(spec)
t1 = time.perf_counter()
if gpu:
    for _ in range(100): jitattn.single_decode_with_kv_cache(q, k, k)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    for _ in range(calls): jitattn.single_decode_with_kv_cache(q, k, k)
    torch.cuda.synchronize()
else:
    t2 = time.perf_counter()
    for _ in range(calls): loader.get_module(spec)
t3 = time.perf_counter()
print(json.dumps({"first_ms": (t1 - t0) * 1e3, "per_call_us": (t3 - t2) / calls * 1e6, "gpu": gpu,
                  "pulls": loader.PULL_COUNT, "compiles": loader.COMPILE_COUNT,
                  "redis_imported": "redis" in sys.modules}))
"""



def run(code: str, env: dict, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"child failed:\n{out.stderr[-3000:]}")
    line = out.stdout.strip().splitlines()[-1]
    return json.loads(line) if line.startswith("{\"") else eval(line)  # our own dict literal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="9.0", help="JITATTN_CUDA_ARCH_LIST (default 9.0)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100000, help="calls timed after the first (CPU; 10000 on a GPU)")
    parser.add_argument("--redis-server", default=shutil.which("redis-server"), help="redis-server binary")
    args = parser.parse_args()
    if not args.redis_server:
        sys.exit("no redis-server (apt-get install redis-server, or --redis-server PATH)")
    with tempfile.TemporaryDirectory(prefix="jitattn-remote-warm-") as tmp:
        tmp = Path(tmp)
        server = RedisServer(args.redis_server, tmp / "redis").start()  # the test suite's throwaway server
        try:
            base = {k: v for k, v in os.environ.items() if not k.startswith("JITATTN_")}
            base.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                        JITATTN_CUDA_ARCH_LIST=args.arch,
                        JITATTN_REMOTE_CACHE=server.url, JITATTN_REMOTE_CACHE_KEY=SECRET)
            built = run(BUILD, {**base, "JITATTN_CACHE_DIR": str(tmp / "a")})
            print(f"built into root A (compiled={built['compiled']}) and published to {server.url}")
            rows: dict[str, list[dict]] = {"local": [], "pull": [], "after": []}
            for i in range(args.rounds):
                calls = str(args.calls)
                rows["pull"].append(run(CHILD, {**base, "JITATTN_CACHE_DIR": str(tmp / f"b{i}")}, calls))
                pair = [("local", tmp / "a"), ("after", tmp / f"b{i}")]
                for kind, root in pair if i % 2 == 0 else pair[::-1]:  # alternate: no order bias
                    rows[kind].append(run(CHILD, {**base, "JITATTN_CACHE_DIR": str(root)}, calls))
            gpu = rows["local"][0]["gpu"]
            what = "single_decode_with_kv_cache (GPU)" if gpu else "loader.get_module (no GPU)"
            print(f"{args.rounds} rounds, fresh process each; first call and per-call cost of {what}; medians "
                  f"(min-max)")
            for kind, label in (("local", "local warm (built here)"), ("pull", "first call pulls from Redis"),
                                ("after", "after the pull (new process)")):
                first = [r["first_ms"] for r in rows[kind]]
                per = [r["per_call_us"] for r in rows[kind]]
                pulls = sum(r["pulls"] for r in rows[kind])
                compiles = sum(r["compiles"] for r in rows[kind])
                redis = sum(r["redis_imported"] for r in rows[kind])
                print(f"  {label:30s} first call {statistics.median(first):7.2f} ms ({min(first):.2f}-{max(first):.2f})"
                      f"  per call {statistics.median(per):6.3f} us ({min(per):.3f}-{max(per):.3f})"
                      f"  pulls {pulls}, compiles {compiles}, imported redis in {redis}/{args.rounds}")
        finally:
            server.kill()


if __name__ == "__main__":
    main()
