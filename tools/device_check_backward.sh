#!/usr/bin/env bash
# One call on the GPU machine for the varlen backward: its GPU tests, then its benchmark rows.
#   tools/device_check_backward.sh [pytest args...]
# With cache artifacts in .seedpack/*.tar.gz (built on any machine, e.g.
#   jitattn prewarm cache/gpu-tests.toml cache/tune-backward.toml --arch 9.0
#   jitattn cache pack .seedpack/backward.tar.gz --manifest cache/gpu-tests.toml cache/tune-backward.toml)
# they are unpacked as read-only seed dirs and everything runs strict (JITATTN_DISABLE_JIT=1):
# zero compiles.
#   TEST_VARIANTS  the test file runs once per entry: "default", or a value of
#                  JITATTN_TEST_BACKWARD_PRODUCER (1: wgmma with its producer warpgroup, 0: without)
#   BENCH_RUNS     tools/bench_varlen.py argument lists separated by ';' (default: one quick
#                  backward run); each runs on its own, so one that fails or hangs costs only itself
#   TEST_TIMEOUT / BENCH_TIMEOUT bound each step (seconds). Logs land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jitattn-out}
mkdir -p "$OUT"
seed=/tmp/jitattn-seed
for pack in .seedpack/*.tar.gz; do
  [ -f "$pack" ] || continue
  python3 -m jitattn cache unpack "$pack" --into "$seed" | tail -1 || exit 1
done
if [ -d "$seed" ]; then
  chmod -R a-w "$seed"
  export JITATTN_CACHE_SEED_DIRS=$seed JITATTN_DISABLE_JIT=${JITATTN_DISABLE_JIT:-1}
  export JITATTN_CACHE_DIR=$(mktemp -d /tmp/jitattn-cache-XXXX)
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
status=0
for variant in ${TEST_VARIANTS:-default}; do
  log="$OUT/pytest_$variant.log"
  if [ "$variant" = default ]; then
    env -u JITATTN_TEST_BACKWARD_PRODUCER timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q --tb=line -rfE \
      -p no:cacheprovider "${@:-tests/test_varlen_backward_gpu.py}" > "$log" 2>&1
  else
    JITATTN_TEST_BACKWARD_PRODUCER=$variant timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q --tb=line -rfE \
      -p no:cacheprovider "${@:-tests/test_varlen_backward_gpu.py}" > "$log" 2>&1
  fi
  rc=$?
  [ $rc = 0 ] || status=$rc
  echo "== tests ($variant): exit $rc: $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$log" | cut -c1-200 | head -12
  grep -E "Error:" "$log" | cut -c1-300 | sort | uniq -c | sort -rn | head -6
done
echo "compiles here: $(find "${JITATTN_CACHE_DIR:-/nonexistent}" -name manifest.json 2>/dev/null | wc -l)"
IFS=';' read -ra runs <<< "${BENCH_RUNS:---quick --parts backward}"
n=0
for args in "${runs[@]}"; do
  n=$((n + 1))
  echo "== bench $n: tools/bench_varlen.py $args"
  timeout "${BENCH_TIMEOUT:-150}" python3 tools/bench_varlen.py $args > "$OUT/bench_$n.log" 2>&1
  echo "(exit $?)"
  grep -v "^$" "$OUT/bench_$n.log"
done
exit $status
