#!/usr/bin/env bash
# One device call for the D256 wgmma backward (notes/backward-d256.md): the backward GPU tests
# (default rung, then JITATTN_TEST_BACKWARD_PRODUCER=0), the D256 benchmark (wgmma producer
# default, lockstep, mma.sync, deterministic, torch varlen, SDPA in one run), optionally an ncu
# pass over the D256 main kernel (NCU=1). Seeds from .seedpack/*.tar.gz (tools/device_check_backward.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jitattn-out}
parallel=(-n 8)
python3 -c "import xdist" 2>/dev/null || parallel=()  # pytest-xdist absent: serial
TEST_VARIANTS=${TEST_VARIANTS:-"default 0"} TEST_TIMEOUT=${TEST_TIMEOUT:-120} BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} \
  BENCH_RUNS=${BENCH_RUNS:-"--quick --parts backward --bwd-dims 256 --bwd-variants other mma det peers"} \
  OUT=$OUT bash tools/device_check_backward.sh -m gpu "${parallel[@]}" tests/test_varlen_backward_gpu.py
status=$?
if [ "${NCU:-0}" = 1 ]; then
  export PYTHONPATH=$PWD JITATTN_CACHE_SEED_DIRS=/tmp/jitattn-seed JITATTN_CACHE_DIR=$(mktemp -d /tmp/jitattn-ncu-XXXX)
  timeout 120 /usr/local/cuda/bin/ncu --clock-control none -k regex:^varlen_bwd$ -s 2 -c 1 --section SpeedOfLight \
    --section WarpStateStats --section MemoryWorkloadAnalysis --print-details all \
    python3 tools/bench_varlen.py --quick --parts backward --bwd-dims 256 --bwd-variants > "$OUT/ncu.log" 2>&1
  echo "== ncu (exit $?)"; grep -E "Duration|Throughput|Warp Cycles|Stall|Issued|Eligible" "$OUT/ncu.log" | head -40
fi
exit $status
