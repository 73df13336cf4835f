#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the decode benchmark; prints a short table last.
#   tools/device_check.sh [pytest args...]
# With a prebuilt seed cache in .seed/ (jitattn prewarm cache/gpu-tests.toml --arch 9.0 on any
# machine, then copy the cache root to .seed), the tests run strict: JITATTN_DISABLE_JIT=1,
# zero compiles. Without one, kernels are compiled here on first use.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export JITATTN_CACHE_DIR=${JITATTN_CACHE_DIR:-/tmp/jitattn-cache}
OUT=${OUT:-/tmp/jitattn-out}
mkdir -p "$OUT"
if [ -d .seed ]; then
  export JITATTN_CACHE_SEED_DIRS=$PWD/.seed JITATTN_DISABLE_JIT=${JITATTN_DISABLE_JIT:-1}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python3 -m pytest -q -x -m gpu tests "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
status=${PIPESTATUS[0]}
compiles=$(grep -rl '"seconds"' "$JITATTN_CACHE_DIR" 2>/dev/null | wc -l)
echo "GPU tests exit code: $status; entries compiled on this machine: $compiles"
python3 tools/bench_decode.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
exit $status
