#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the benchmarks; prints short tables last.
#   tools/device_check.sh [--profile] [pytest args...]
# With a cache artifact in .seedpack/*.tar.gz (built on any machine:
#   jitattn prewarm cache/gpu-tests.toml --arch 9.0
#   jitattn cache pack .seedpack/gpu-tests.tar.gz --manifest cache/gpu-tests.toml)
# it is unpacked here as a read-only seed dir and the tests run strict: JITATTN_DISABLE_JIT=1,
# zero compiles (a prebuilt cache root copied to .seed/ works the same way). Without either,
# kernels are compiled here on first use. --profile adds the host
# breakdown, per-kernel times and the split sweep; NCU=1 also an ncu summary of the kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export JITATTN_CACHE_DIR=${JITATTN_CACHE_DIR:-/tmp/jitattn-cache}
OUT=${OUT:-/tmp/jitattn-out}
mkdir -p "$OUT"
profile=0
if [ "${1:-}" = "--profile" ]; then profile=1; shift; fi
seed=""
for pack in .seedpack/*.tar.gz; do
  [ -f "$pack" ] || continue
  seed=/tmp/jitattn-seed
  python3 -m jitattn cache unpack "$pack" --into "$seed" | tail -1 || exit 1
  chmod -R a-w "$seed"  # read-only, like an image layer
done
[ -z "$seed" ] && [ -d .seed ] && seed=$PWD/.seed
if [ -n "$seed" ]; then
  # Strict, with a fresh empty writable cache: everything must come from the seed.
  export JITATTN_CACHE_SEED_DIRS=$seed JITATTN_DISABLE_JIT=${JITATTN_DISABLE_JIT:-1}
  export JITATTN_CACHE_DIR=$(mktemp -d /tmp/jitattn-cache-XXXX)
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python3 -m pytest -q -m gpu tests "$@" 2>&1 | tee "$OUT/pytest.log" | tail -15
status=${PIPESTATUS[0]}
compiles=$(find "$JITATTN_CACHE_DIR" -name manifest.json 2>/dev/null | wc -l)
echo "GPU tests exit code: $status; entries in the writable cache $JITATTN_CACHE_DIR (= compiles here): $compiles"
if [ $profile = 1 ]; then
  python3 tools/profile_decode.py 2>&1 | tee "$OUT/profile.log"
  if [ "${NCU:-0}" = 1 ]; then
    ncu --clock-control none -k regex:decode_chunk --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 tools/profile_decode.py --ncu-case > "$OUT/ncu.log" 2>&1
    grep -E "decode_chunk|Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Stall|Warp Cycles Per Issued|Registers" "$OUT/ncu.log" | head -60
  fi
fi
# BENCH: decode (default), varlen, all or 0; BENCH_ARGS go to each benchmark (e.g. --quick).
bench=${BENCH:-decode}
case "$bench" in decode|all|1)
  python3 tools/bench_decode.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  # The floor under every event-timed row (launch gap behind the start event, dependent release)
  # and what streaming each acceptance row's bytes alone costs.
  floor_bin=$(mktemp /tmp/event_floor-XXXX)  # not under $OUT: only logs come back
  nvcc -O2 -arch=native tools/event_floor.cu -o "$floor_bin" && "$floor_bin" | tee -a "$OUT/bench.log" ;;
esac
case "$bench" in varlen|all) python3 tools/bench_varlen.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_varlen.log" ;; esac
exit $status
