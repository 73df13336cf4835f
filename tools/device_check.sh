#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the decode benchmark; prints a short table last.
#   tools/device_check.sh [--profile] [pytest args...]
# With a prebuilt seed cache in .seed/ (jitattn prewarm cache/gpu-tests.toml --arch 9.0 on any
# machine, then copy the cache root to .seed), the tests run strict: JITATTN_DISABLE_JIT=1,
# zero compiles. Without one, kernels are compiled here on first use. --profile adds the host
# breakdown, per-kernel times and the split sweep; NCU=1 also an ncu summary of the kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export JITATTN_CACHE_DIR=${JITATTN_CACHE_DIR:-/tmp/jitattn-cache}
OUT=${OUT:-/tmp/jitattn-out}
mkdir -p "$OUT"
profile=0
if [ "${1:-}" = "--profile" ]; then profile=1; shift; fi
if [ -d .seed ]; then
  export JITATTN_CACHE_SEED_DIRS=$PWD/.seed JITATTN_DISABLE_JIT=${JITATTN_DISABLE_JIT:-1}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python3 -m pytest -q -m gpu tests "$@" 2>&1 | tee "$OUT/pytest.log" | tail -15
status=${PIPESTATUS[0]}
compiles=$(find "$JITATTN_CACHE_DIR" -name manifest.json 2>/dev/null | wc -l)
echo "GPU tests exit code: $status; entries compiled on this machine: $compiles"
if [ $profile = 1 ]; then
  python3 tools/profile_decode.py 2>&1 | tee "$OUT/profile.log"
  if [ "${NCU:-0}" = 1 ]; then
    ncu --clock-control none -k regex:decode_chunk --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 tools/profile_decode.py --ncu-case > "$OUT/ncu.log" 2>&1
    grep -E "decode_chunk|Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Stall|Warp Cycles Per Issued|Registers" "$OUT/ncu.log" | head -60
  fi
fi
python3 tools/bench_decode.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
exit $status
