#!/usr/bin/env bash
# Run torch's own attention tests against jitattn, and write junit XML and a markdown report.
#
#   tools/torch_tests_with_jitattn.sh MODE TESTS [extra pytest args...]
#
# MODE: off | provider | dropin | all (all three, then the report; tools/jitattn_torch_tests_plugin.py
#   says what each mode patches). TESTS: the folder holding torch's test_varlen_attention.py and
#   test_transformers.py (e.g. .torchtests/test, never committed), or a pytorch checkout (its test/).
# Runs from the repository root; needs expecttest (torch.testing._internal imports it).
#   1. test_varlen_attention.py (the newest) and test_varlen_attention_torch210.py (torch 2.10/2.11's
#      API), all of each, in each mode;
#   2. test_transformers.py's flash cases (or the excerpt test_transformers_flash.py; TORCH_SDPA_K,
#      default below), off and provider only: it calls no varlen function, so dropin would be off again.
# Writes <stem>.<mode>.xml, <stem>.<mode>.log and (mode all) report.md under TORCH_TESTS_OUT,
# default $OUT/torchtests when OUT is set, else ./torchtests-out.
set -u
usage() {
    echo "usage: $0 off|provider|dropin|all TESTS_DIR_OR_PYTORCH_CHECKOUT [pytest args...]" >&2
    exit 2
}
# The earlier form `tools/torch_tests_with_jitattn.sh /path/to/pytorch` (tools/device_check_torch_flash.sh)
# still means provider mode.
if [ $# -ge 1 ] && [ -d "$1" ]; then set -- provider "$@"; fi
[ $# -ge 2 ] || usage
MODE=$1; TESTS=$2; shift 2
case "$MODE" in off|provider|dropin|all) ;; *) usage ;; esac
[ -d "$TESTS/test" ] && [ -f "$TESTS/test/test_varlen_attention.py" ] && TESTS=$TESTS/test
if [ ! -f "$TESTS/test_varlen_attention.py" ]; then
    echo "$TESTS has no test_varlen_attention.py" >&2
    exit 2
fi
TESTS=$(cd "$TESTS" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=${TORCH_TESTS_OUT:-${OUT:+$OUT/torchtests}}
RESULTS=${RESULTS:-$PWD/torchtests-out}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)
# jitattn, and the plugin by a name that pytorch's own tools/ package cannot shadow
export PYTHONPATH="$HERE:$HERE/tools${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# test_transformers' flash cases (docs/torch-tests.md): 68 of the ~7000 parametrizations of the excerpt's
# three tests: test_flash_attention_vs_math_ref_grads at batch 1, (143 x 127) and (2048 x 2048) tokens,
# head dims 8 (torch's kernel: below 32), 203 (padded to 208) and 256, both dtypes, causal or not, GQA
# or not, no dropout, plus one dropout case (the fallback); the CUDA-graph test on the flash kernel
# (head dims 32/64, 256^2 and 1024^2, causal or not, one dropout case); all 8 of
# test_sdp_flash_attention_grad_against_math (head dim 16: torch's kernel). TORCH_SDPA_K replaces it.
SDPA_K=${TORCH_SDPA_K:-"(test_flash_attention_vs_math_ref_grads and batch_size_1_ and (seq_len_q_143_seq_len_k_127 or seq_len_q_2048_seq_len_k_2048) and (head_dim_8_ or head_dim_203 or head_dim_256) and scale0 and n_heads0 and (dropout_p_0_0 or (dropout_p_0_22 and head_dim_256 and bfloat16 and is_causal_False and enable_gqa_False))) or (cudagraph and batch_size_1_ and fused_kernel0 and scale0 and (seq_len_q_256_seq_len_k_256 or seq_len_q_1024_seq_len_k_1024) and (dropout_p_0_0 or (dropout_p_0_22 and head_dim_64 and is_causal_False))) or test_sdp_flash_attention_grad_against_math"}
PYTEST=(python3 -m pytest -p jitattn_torch_tests_plugin -p no:cacheprovider -q -rfEs -o junit_logging=no)
status=0
run() {  # run MODE FILE [pytest args]
    local mode=$1 file=$2 stem; shift 2
    stem=$(basename "$file" .py)
    [ -f "$TESTS/$file" ] || { echo "== $file: not in $TESTS, skipped"; return; }
    echo "== $file, mode $mode"
    rm -f "$RESULTS/$stem.$mode.xml"
    (cd "$TESTS" && JITATTN_TORCH_TESTS=$mode "${PYTEST[@]}" --junitxml="$RESULTS/$stem.$mode.xml" "$file" "$@") \
        >"$RESULTS/$stem.$mode.log" 2>&1
    local rc=$?
    tail -n 3 "$RESULTS/$stem.$mode.log"
    # Failures, a file that does not import (exit 2) or selects nothing (5) are results the junit
    # XML and the report show; a run that left no junit XML is broken.
    [ -s "$RESULTS/$stem.$mode.xml" ] || { echo "   pytest exit $rc, no junit XML (see $RESULTS/$stem.$mode.log)"; status=1; }
}
TRANSFORMERS=test_transformers.py  # a pytorch checkout's full file, else the excerpt in .torchtests
[ -f "$TESTS/$TRANSFORMERS" ] || TRANSFORMERS=test_transformers_flash.py
for mode in off provider dropin; do
    [ "$MODE" = all ] || [ "$MODE" = "$mode" ] || continue
    run "$mode" test_varlen_attention.py "$@"           # the newest: torch >= 2.12's API
    run "$mode" test_varlen_attention_torch210.py "$@"  # torch 2.10/2.11's API
    [ "$mode" = dropin ] || run "$mode" "$TRANSFORMERS" -k "$SDPA_K" "$@"
done
if [ "$MODE" = all ]; then
    python3 "$HERE/tools/torch_tests_report.py" "$RESULTS" --tests-dir "$TESTS" -o "$RESULTS/report.md" || status=1
fi
exit $status
