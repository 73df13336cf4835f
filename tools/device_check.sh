#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the benchmarks; prints short tables last.
#   tools/device_check.sh [--profile] [pytest args...]
# With a cache artifact in .seedpack/*.tar.gz (built on any machine:
#   jitattn prewarm cache/gpu-tests.toml cache/gpu-dropin.toml --arch 9.0
#   jitattn cache pack .seedpack/gpu-tests.tar.gz --manifest cache/gpu-tests.toml --manifest cache/gpu-dropin.toml)
# it is unpacked here as a read-only seed dir and the tests run strict: JITATTN_DISABLE_JIT=1,
# zero compiles (a prebuilt cache root copied to .seed/ works the same way). Without either,
# kernels are compiled here on first use. SEED_PREWARM=1 builds that seed here first (prewarm of the
# GPU manifests with every core into /tmp/jitattn-seed: cheaper than carrying a pack) and then runs
# strict the same way, which also proves the manifests cover every call the tests make
# (cache/gpu-tests-compiled.toml lists what the tests trace or pick beyond the hand-written ones;
# a run with JITATTN_DISABLE_JIT=0 lists what it had to compile in $OUT/compiled.toml).
# TESTS=0 skips the GPU tests (a benchmark-only call on a warm machine); SHARDS=1 runs them in one
# pytest process (default 4 processes sharing the GPU, logs in $OUT/pytest.N.log). ROWS80=0 runs the
# backward tests with full D128 calls on the 64-row kernels instead of the 80-row tile
# (JITATTN_TEST_BACKWARD_ROWS80; spec.TILE80_HEAD_DIMS); ROWS80=1 adds tools/bwd_method.py's line
# with the 80-row tile forced onto causal calls too (BENCH=bwd or variants) and bench_variants.py's
# bwd80 columns; ROWS80=all runs every GPU test with every D128 backward call but a soft-capped one on
# the 80-row tile (windows, score_mods, mask_mods: spec.TILE80_FEATURES), JIT on (the seed's manifests
# list the plan's choice, not these), and the benchmarks as ROWS80=1. EARLY=0 runs the GPU tests with
# spec.EARLY_UNIT_SLOPE_PROBS off (JIT on) and, with BENCH=variants, the bias table's rows again
# without it (bench_variants.py --no-early-probs). --profile adds the host
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
if [ -z "$seed" ] && [ "${SEED_PREWARM:-0}" = 1 ]; then
  seed=/tmp/jitattn-seed
  if [ ! -d "$seed" ]; then  # a warm machine's earlier call may have built it
    # (pipefail: a prewarm that failed a spec leaves no seed; tail alone would pass)
    JITATTN_CACHE_DIR=$seed.building python3 -m jitattn prewarm cache/gpu-tests.toml cache/gpu-dropin.toml cache/variants.toml \
      cache/gpu-tests-compiled.toml cache/softcap.toml --arch 9.0 -j "$(nproc)" 2>&1 | tail -3 && mv $seed.building "$seed" || exit 1
  fi
fi
if [ -n "$seed" ]; then
  # Strict, with a fresh empty writable cache: everything must come from the seed.
  export JITATTN_CACHE_SEED_DIRS=$seed JITATTN_DISABLE_JIT=${JITATTN_DISABLE_JIT:-1}
  export JITATTN_CACHE_DIR=$(mktemp -d /tmp/jitattn-cache-XXXX)
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
status=0
[ "${ROWS80:-}" = 0 ] && export JITATTN_TEST_BACKWARD_ROWS80=0 && echo "the backward tests with the 80-row tile off"
if [ "${ROWS80:-}" = all ]; then
  export JITATTN_TEST_BACKWARD_ROWS80=all JITATTN_DISABLE_JIT=0
  echo "the GPU tests with every D128 backward call but a soft-capped one on the 80-row tile (JIT on)"
fi
if [ "${EARLY:-1}" = 0 ]; then
  export JITATTN_TEST_BACKWARD_EARLY_PROBS=0 JITATTN_DISABLE_JIT=0
  echo "the GPU tests with spec.EARLY_UNIT_SLOPE_PROBS off (JIT on)"
fi
rows80_bench=$([ "${ROWS80:-}" = 1 ] || [ "${ROWS80:-}" = all ] && echo --rows80)
if [ "${TESTS:-1}" = 1 ] && [ "${SHARDS:-4}" -gt 1 ]; then
  # SHARDS (default 4) pytest processes share the GPU, each every SHARDS-th test: the GPU suite is
  # host-bound (references, checks), and one process took 5+ minutes where four take under two.
  python3 -m pytest --co -q -p no:cacheprovider -m gpu tests "$@" 2>/dev/null | grep "::" > "$OUT/test_ids"
  echo "$(wc -l < "$OUT/test_ids") GPU tests in ${SHARDS:-4} shards"
  for s in $(seq 0 $((${SHARDS:-4} - 1))); do
    awk -v s="$s" -v n="${SHARDS:-4}" 'NR % n == s' "$OUT/test_ids" > "$OUT/test_ids.$s"
    mapfile -t ids < "$OUT/test_ids.$s"  # ids hold spaces and brackets: one argument each, never globbed
    python3 -m pytest -q -p no:cacheprovider "${ids[@]}" > "$OUT/pytest.$s.log" 2>&1 &
  done
  status=0
  for job in $(jobs -p); do wait "$job" || status=1; done
  for s in $(seq 0 $((${SHARDS:-4} - 1))); do tail -1 "$OUT/pytest.$s.log"; done
  grep -h "^FAILED\|^ERROR" "$OUT"/pytest.*.log | head -30
elif [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -m gpu tests "$@" 2>&1 | tee "$OUT/pytest.log" | tail -15
  status=${PIPESTATUS[0]}
fi
compiles=$(find "$JITATTN_CACHE_DIR" -name manifest.json 2>/dev/null | wc -l)
echo "GPU tests exit code: $status; entries in the writable cache $JITATTN_CACHE_DIR (= compiles here): $compiles"
if [ "$compiles" -gt 0 ]; then  # what the manifests missed (JIT on), as a manifest to add to the seed's
  python3 tools/compiled_manifest.py "$JITATTN_CACHE_DIR" --out "$OUT/compiled.toml" --note "$(date -u +%F) run" \
    && echo "  (python3 tools/compiled_manifest.py cache/gpu-tests-compiled.toml compiled.toml --out cache/gpu-tests-compiled.toml)"
fi
if [ $profile = 1 ]; then
  python3 tools/profile_decode.py 2>&1 | tee "$OUT/profile.log"
  if [ "${NCU:-0}" = 1 ]; then
    ncu --clock-control none -k regex:decode_chunk --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 tools/profile_decode.py --ncu-case > "$OUT/ncu.log" 2>&1
    grep -E "decode_chunk|Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Stall|Warp Cycles Per Issued|Registers" "$OUT/ncu.log" | head -60
  fi
fi
# BENCH: a comma list of decode (default), varlen, backward, host, transformers, or all, or 0;
# BENCH_ARGS go to the decode and varlen benchmarks (e.g. --quick).
#   host: host time per tiny decode call beside SDPA, the first call in a new process, and a
#     batch-1 transformers decode layer call's host time by part (tools/decode_host.py), and what the
#     varlen forward and backward cost the host to enqueue, GPU idle and busy (tools/host_enqueue.py)
#   backward: the varlen backward rows (the issue's shapes, peers, deterministic, skewed)
#   transformers: tokens/s of a generation and a training step beside sdpa (TRANSFORMERS_ARGS replace
#     the default --layers 2 --new 32, e.g. "--layers 4 32 --new 32 --rounds 7 --cases generate host")
#   encoder: tools/profile_encoder.py at head dims 32 and 64 (wall, host and device totals, top kernels
#     of one padded encoder forward: sdpa, jitattn on device, jitattn host_read), then
#     tools/short_tiles.py --mask-hooks (what the padding mask hook's capture reads cost)
#   torchflash: tools/device_check_torch_flash.sh (the torch flash-attention provider's and the
#     transformers integration's tests, the first call with grad, issue 47's transformers table; with
#     PYTORCH_DIR, torch's own attention tests with jitattn active). It may compile what the manifests
#     lack, so it runs with the JIT on (into the writable cache).
#   variants: tools/bench_variants.py (variants vs FlexAttention, masks vs windows, the soft cap's cost),
#     then bwd (below)
#   bwd: tools/bwd_method.py (the backward column taken apart, with torch.profiler per step; with
#     ROWS80=1 or all a line with the 80-row tile forced onto causal calls too)
#   sweep: tools/bench_sweep.py --quick (forward / backward TFLOP/s against sequence length, decode TB/s
#     against kv length, beside the peers) -> $OUT/sweep.json, which tools/plot_benchmarks.py draws
#   persistent: the forward's other schedule at D64 / D128 / D256 (a CTA per row block where calls
#     take the persistent kernel, VarlenSpec.for_call, and the persistent one at D256) checked
#     against float64 and timed beside the default and SDPA, under a timeout (a deadlock must not hang the job)
bench=${BENCH:-decode}
wants() { [[ ",$bench," == *",$1,"* || ",$bench," == *",all,"* || ($1 == decode && $bench == 1) ]]; }
if wants decode; then
  python3 tools/bench_decode.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  # The floor under every event-timed row (launch gap behind the start event, dependent release)
  # and what streaming each acceptance row's bytes alone costs.
  floor_bin=$(mktemp /tmp/event_floor-XXXX)  # not under $OUT: only logs come back
  nvcc -O2 -arch=native tools/event_floor.cu -o "$floor_bin" && "$floor_bin" | tee -a "$OUT/bench.log"
fi
wants varlen && python3 tools/bench_varlen.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_varlen.log"
if wants host; then
  python3 tools/bench_decode.py --host-only 2>&1 | tee "$OUT/host.log"
  python3 -m compileall -q jitattn >/dev/null  # .pyc, as an installed package has them
  python3 tools/first_call.py --runs 3 --modes decode,breakdown,varlen 2>&1 | tee "$OUT/first_call.log"
  python3 tools/decode_host.py 2>&1 | tee "$OUT/decode_host.log"  # a batch-1 transformers layer call's host time
  python3 tools/host_enqueue.py 2>&1 | tee "$OUT/host_enqueue.log"  # the varlen backward's host enqueue, by part
fi
wants backward && python3 tools/bench_varlen.py --quick --parts backward --bwd-variants mma det peers skewed 2>&1 \
  | tee "$OUT/bench_backward.log"
wants persistent && timeout 400 python3 tools/fwd_schedule.py --quick --head-dims 64 128 256 --rounds 3 \
  --shapes 8x4096 32x1024 --schedules default d64:tma d128:tma d256:tma,split_kv,persistent 2>&1 \
  | tee "$OUT/fwd_persistent.log"
wants transformers && python3 tools/bench_transformers.py ${TRANSFORMERS_ARGS:---layers 2 --new 32} 2>&1 \
  | tee "$OUT/bench_transformers.log"
if wants encoder; then
  for heads in 12 6; do
    PYTHONPATH=$PWD:$PWD/tools JITATTN_DISABLE_JIT=0 python3 tools/profile_encoder.py --heads $heads 2>&1 | tee -a "$OUT/profile_encoder.log"
  done
  JITATTN_DISABLE_JIT=0 python3 tools/short_tiles.py --mask-hooks 2>&1 | tee -a "$OUT/profile_encoder.log" | grep "^|\|^###\|FAILED"
fi
wants torchflash && JITATTN_DISABLE_JIT=0 tools/device_check_torch_flash.sh 2>&1 | tee "$OUT/torchflash.log"
wants sweep && python3 tools/bench_sweep.py --quick --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log"
# Variants (issue 46): the acceptance set beside FlexAttention, masks beside the built-in window, the
# soft cap's cost (VARIANTS_ARGS go to tools/bench_variants.py, e.g. --quick or --parts softcap). It
# compiles the variant kernels it meets (JIT on, into the writable cache).
wants variants && JITATTN_DISABLE_JIT=0 python3 tools/bench_variants.py ${VARIANTS_ARGS:-} $rows80_bench 2>&1 \
  | tee "$OUT/bench_variants.log"
wants variants && [ "${EARLY:-1}" = 0 ] && JITATTN_DISABLE_JIT=0 python3 tools/bench_variants.py --parts variants \
  --only "bias table" --no-early-probs $rows80_bench 2>&1 | tee -a "$OUT/bench_variants.log"
# What the variants table's backward column holds (the kernels alone, the grad path's host enqueue).
{ wants variants || wants bwd; } && JITATTN_DISABLE_JIT=0 python3 tools/bwd_method.py --profile $rows80_bench 2>&1 \
  | tee "$OUT/bwd_method.log"
exit $status
