#!/usr/bin/env bash
# One device call for the D128 backward's register split (VarlenBackwardSpec.consumer_regs,
# notes/backward-h200.md): 224 / 56 (the default) against 240 / 24 checked against float64 and
# timed in interleaved rounds with torch varlen and SDPA (tools/bwd_ab.py), then the backward GPU
# tests with 240 forced at D128 (JITATTN_TEST_BACKWARD_CONSUMER_REGS=240) and by default. Seeds
# from .seedpack/*.tar.gz as tools/device_check_backward.sh does (a pack of cache/gpu-tests.toml).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jitattn-out}
mkdir -p "$OUT"
seed=/tmp/jitattn-seed
for pack in .seedpack/*.tar.gz; do
  [ -f "$pack" ] && python3 -m jitattn cache unpack "$pack" --into "$seed" | tail -1
done
[ -d "$seed" ] && export JITATTN_CACHE_SEED_DIRS=$seed JITATTN_CACHE_DIR=$(mktemp -d /tmp/jitattn-cache-XXXX)
timeout "${AB_TIMEOUT:-60}" python3 tools/bwd_ab.py --dims 128 --variant r224:consumer_regs=224 \
  --variant r240:consumer_regs=240 --rounds "${ROUNDS:-3}" 2>&1 | tee "$OUT/bwd_ab.log"
status=0
parallel=(-n 8)
python3 -c "import xdist" 2>/dev/null || parallel=()
for regs in 240 default; do
  if [ $regs = default ]; then unset JITATTN_TEST_BACKWARD_CONSUMER_REGS; else export JITATTN_TEST_BACKWARD_CONSUMER_REGS=$regs; fi
  JITATTN_DISABLE_JIT=${JITATTN_DISABLE_JIT:-1} timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -m gpu "${parallel[@]}" \
    -p no:cacheprovider --tb=line -rfE tests/test_varlen_backward_gpu.py > "$OUT/pytest_$regs.log" 2>&1
  rc=$?; [ $rc = 0 ] || status=$rc
  echo "== tests (consumer_regs $regs): exit $rc: $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest_$regs.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_$regs.log" | cut -c1-200 | head -12
done
exit $status
