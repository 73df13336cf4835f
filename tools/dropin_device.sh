#!/usr/bin/env bash
# Issue 23's GPU run in one call (device time is scarce): the GPU tests the drop-in work touches,
# the first call in a new process (this tree beside OLD, the commit before), transformers
# tokens/s beside sdpa, and the varlen split timing in both trees. Strict: every kernel comes from
# .seedpack/dropin.tar.gz (prewarmed here from cache/gpu-dropin.toml, plus OLD's two varlen decode
# kernels), so nothing compiles on the GPU machine.
#   tools/dropin_device.sh [OLD]      (OLD defaults to ../old)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OLD=$(cd "${1:-../old}" && pwd)
OUT=${OUT:-/tmp/dropin-out}
mkdir -p "$OUT"
seed=/tmp/jitattn-seed
python3 -m jitattn cache unpack .seedpack/dropin.tar.gz --into "$seed" | tail -1 || exit 1
chmod -R a-w "$seed"
export JITATTN_CACHE_SEED_DIRS=$seed JITATTN_DISABLE_JIT=1 JITATTN_CACHE_DIR=$(mktemp -d /tmp/jitattn-cache-XXXX)
python3 -m compileall -q jitattn "$OLD/jitattn" >/dev/null  # .pyc as an installed package has them
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
timeout 85 python3 -m pytest -q -n 8 -p no:cacheprovider -rP tests/test_varlen_dropin_gpu.py tests/test_transformers_gpu.py \
  tests/test_ops_gpu.py tests/test_varlen_gpu.py > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -12
grep -E "rel error|tokens equal|loss " "$OUT/pytest.log" | sed 's/^ *//' | sort -u | head -24
timeout 50 python3 tools/first_call.py --runs 2 --modes decode,breakdown,varlen --tree "$OLD" 2>&1 | tee "$OUT/first_call.log"
timeout 40 python3 tools/bench_transformers.py --layers 2 --new 32 2>&1 | tee "$OUT/bench_transformers.log" | tail -4
for tree in "$PWD" "$OLD"; do
  echo "split, $tree"; timeout 15 env PYTHONPATH="$tree" python3 tools/bench_varlen_split.py
done 2>&1 | tee "$OUT/split.log"
