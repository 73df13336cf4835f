#!/usr/bin/env bash
# Run torch's own attention tests with jitattn active as torch's flash-attention provider.
#
#   tools/torch_tests_with_jitattn.sh /path/to/pytorch [extra pytest args...]
#
# Runs, from the pytorch checkout's test/ directory (torch's test helpers come from the installed
# torch, torch.testing._internal), with tools/jitattn_torch_tests_plugin.py activating jitattn:
#   1. test/test_varlen_attention.py, all of it;
#   2. the flash-attention forward/backward correctness cases of test/test_transformers.py
#      (TestSDPACudaOnly, selected by -k below; TORCH_SDPA_K replaces the expression, e.g. to take a
#      subset of the ~10^5 parametrizations of test_flash_attention_vs_math_ref_grads).
# Each part's summary line ends with jitattn's call counts (forward / backward / fallback).
# docs/torch-tests.md lists what is expected to pass, fail or not apply, and why.
set -u
if [ $# -lt 1 ] || [ ! -f "$1/test/test_varlen_attention.py" ] || [ ! -f "$1/test/test_transformers.py" ]; then
    echo "usage: $0 /path/to/pytorch [pytest args...]  (a checkout with test/test_varlen_attention.py" \
         "and test/test_transformers.py, best the tag of the installed torch)" >&2
    exit 2
fi
PYTORCH=$(cd "$1" && pwd); shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$HERE:$HERE/tools${PYTHONPATH:+:$PYTHONPATH}"  # jitattn, and the plugin by a name pytorch's own tools/ package cannot shadow
SDPA_K=${TORCH_SDPA_K:-"TestSDPACudaOnly and (flash_attention_vs_math_ref_grads or (fused_attention_vs_math_ref_grads and flash) or (fused_kernels_seq_len and flash) or flash_attention_fail_with_non_square_causal or flash_atteention_large_bf16_nan_values or (flash and deterministic))"}
PYTEST=(python3 -m pytest -p jitattn_torch_tests_plugin -p no:cacheprovider -q -rfE)
status=0
cd "$PYTORCH/test" || exit 2
echo "== torch test_varlen_attention.py with jitattn active"
"${PYTEST[@]}" test_varlen_attention.py "$@" || status=1
echo "== torch test_transformers.py flash cases with jitattn active (-k: $SDPA_K)"
"${PYTEST[@]}" test_transformers.py -k "$SDPA_K" "$@" || status=1
exit $status
