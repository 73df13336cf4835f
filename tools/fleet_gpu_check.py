"""One compile per fleet on a GPU machine: N processes over R cache roots and one redis-server
call single_decode_with_kv_cache for the same cold specialization at once.

PYTHONPATH=. python tools/fleet_gpu_check.py [--procs 8] [--roots 4] [--redis-server PATH]

Starts its own redis-server on a free localhost port (stopped at the end). Each process
imports torch, waits for a common start signal, makes the call on fresh random inputs and
compares it with the float64 reference (jitattn.reference); it reports its compiles and pulls.
Then a strict-mode process (JITATTN_DISABLE_JIT=1) on a new empty root serves the same spec
from the fleet tier. Prints one line per process and a summary; exits 1 unless there was
exactly one compile, every result matched, and the strict process pulled and matched.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.redis_server import RedisServer  # noqa: E402
SECRET = "fleet-gpu-check-secret-0123456789"

CHILD = r"""
import json, os, sys, time
import torch
import jitattn
from jitattn.jit import loader
from jitattn.reference import single_decode_reference
torch.manual_seed(int(sys.argv[1]))
q = torch.randn(32, 128, dtype=torch.float16, device="cuda")
k = torch.randn(4096, 8, 128, dtype=torch.float16, device="cuda")
v = torch.randn(4096, 8, 128, dtype=torch.float16, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
start = time.time()
out = jitattn.single_decode_with_kv_cache(q, k, v, logits_soft_cap=30.0)
torch.cuda.synchronize()
end = time.time()
ref, _ = single_decode_reference(q, k, v, logits_soft_cap=30.0)
rel = ((out.double() - ref).norm() / ref.norm()).item()
print(json.dumps({"pid": os.getpid(), "compiles": loader.COMPILE_COUNT, "pulls": loader.PULL_COUNT,
                  "rel_err": rel, "finite": bool(torch.isfinite(out).all()), "start": start, "end": end}), flush=True)
"""



def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--roots", type=int, default=4)
    parser.add_argument("--redis-server", default=shutil.which("redis-server"))
    args = parser.parse_args()
    if not args.redis_server:
        sys.exit("no redis-server (apt-get install redis-server, or --redis-server PATH)")
    with tempfile.TemporaryDirectory(prefix="jitattn-fleet-gpu-") as tmp:
        tmp = Path(tmp)
        server = RedisServer(args.redis_server, tmp / "redis").start()  # the test suite's throwaway server
        try:
            base = {k: v for k, v in os.environ.items() if not k.startswith("JITATTN_")}
            base.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                        JITATTN_REMOTE_CACHE=server.url, JITATTN_REMOTE_CACHE_KEY=SECRET,
                        JITATTN_VERBOSE="1")
            procs = []
            for i in range(args.procs):
                env = {**base, "JITATTN_CACHE_DIR": str(tmp / f"node{i % args.roots}")}
                procs.append(subprocess.Popen([sys.executable, "-c", CHILD, str(i)], env=env, stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            for p in procs:
                line = p.stdout.readline()
                if not line.startswith("ready"):
                    print(p.stderr.read()[-3000:])
                    return 1
            t0 = time.time()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            reports = []
            for i, p in enumerate(procs):
                out, err = p.communicate(timeout=600)
                if p.returncode != 0:
                    print(f"process {i} failed:\n{err[-3000:]}")
                    return 1
                reports.append(json.loads(out.strip().splitlines()[-1]))
            for i, r in enumerate(reports):
                print(f"  process {i} (node{i % args.roots}): compiles {r['compiles']}, pulls {r['pulls']}, "
                      f"rel err {r['rel_err']:.2e}, finite {r['finite']}, done {r['end'] - t0:.1f} s after the signal")
            compiles = sum(r["compiles"] for r in reports)
            pulls = sum(r["pulls"] for r in reports)
            good = sum(r["finite"] and r["rel_err"] < 2e-3 for r in reports)
            print(f"{args.procs} processes over {args.roots} roots: {compiles} compile(s) fleet-wide, {pulls} pull(s), "
                  f"{good}/{args.procs} correct results; last done {max(r['end'] for r in reports) - t0:.1f} s "
                  f"after the start signal")

            strict_env = {**base, "JITATTN_CACHE_DIR": str(tmp / "strict-node"), "JITATTN_DISABLE_JIT": "1"}
            p = subprocess.run([sys.executable, "-c", CHILD, "99"], env=strict_env, input="go\n", capture_output=True,
                               text=True, timeout=300)
            if p.returncode != 0:
                print(f"strict process failed:\n{p.stderr[-3000:]}")
                return 1
            s = json.loads(p.stdout.strip().splitlines()[-1])
            strict_ok = s["pulls"] == 1 and s["compiles"] == 0 and s["finite"] and s["rel_err"] < 2e-3
            print(f"strict node (empty root, JITATTN_DISABLE_JIT=1): compiles {s['compiles']}, pulls {s['pulls']}, "
                  f"rel err {s['rel_err']:.2e}")
            return 0 if compiles == 1 and good == args.procs and strict_ok else 1
        finally:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
