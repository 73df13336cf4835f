#!/usr/bin/env bash
# One GPU job for issue 47: the provider's and the transformers integration's GPU tests, the first
# call with grad, the transformers table, and (with PYTORCH_DIR=<a pytorch checkout>) torch's own
# tests with jitattn active.
#   tools/device_check_torch_flash.sh [bench_transformers args...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export JITATTN_CACHE_DIR=${JITATTN_CACHE_DIR:-/tmp/jitattn-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
status=0
echo "== GPU and CPU tests: provider, transformers integration, first call"
python3 -m pytest -q -rfEs tests/test_torch_flash_gpu.py tests/test_torch_flash.py tests/test_transformers_gpu.py \
    tests/test_transformers_integration.py tests/test_first_call_grad.py 2>&1 | tail -25 || status=1
echo "== first call with grad (issue 47 item 3)"
python3 tools/first_call_grad.py || status=1
echo "== transformers: sdpa vs jitattn, SDPA through the provider"
python3 tools/bench_transformers.py "$@" || status=1
if [ -n "${PYTORCH_DIR:-}" ]; then
  echo "== torch's own tests with jitattn active ($PYTORCH_DIR)"
  tools/torch_tests_with_jitattn.sh "$PYTORCH_DIR" || status=1
fi
exit $status
