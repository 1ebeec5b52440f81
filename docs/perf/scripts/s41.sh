#!/usr/bin/env bash
# Session 41, one GPU:
#   first:  (carry .gpu2 with gpu-suite and bench, .peers) selective recomputation's MLP on the
#           fused down node (`swiglu_down`) against keeping every activation, at tp 1 and at tp 2
#           on one GPU (ranks as threads); then the bf16 row (10 timed steps after 3 warm-up)
#           beside PyTorch + compile, and 40 steps of ours twice around 40 of compile's.
#   test:   (carry .gpu3 with gpu-suite and bench, .peers) the branches' last products added onto
#           the residual stream in the GEMM's epilogue (`gemm_onto`, `gated_mlp_onto`): its
#           kernel test, the gated MLP's (its data gradient now on the same kernel), the MLP
#           layer at tp 1 and 2, the Llama 3 transformers fixture, the model's AdamW steps,
#           recomputation at tp 1 and 2; then ncu's times of the GEMMs and adds over a bench
#           step; then 40 llama-1b steps twice around compile's 40.
#   buffers: (carry .gpu3 with gpu-suite and bench, .peers) the same with a buffer a pass for the
#           residual's epilogue (both passes' values loaded while the tile is computed, three
#           stages): the epilogue kernels' tests, ncu over a bench step, 40 steps twice around
#           compile's. Measured slower (the stages count more): reverted, not in the tree.
#   rows:   (carry .gpu with bench, .peers, .whl with torchao 0.18) bf16 beside PyTorch + compile,
#           then FP8 promoted beside torchao float8 + compile if the call has time left (10 timed
#           steps after 3 warm-up, the peers' recipe).
#   decode: (carry .gpu2 with gpu-suite) the decoding paths through the residual's epilogue (the
#           prompt's products) and its fallback (a step's few rows: the product, then the add),
#           eager and as a CUDA graph, against the full forward.
# Logs go to $OUT, packed into one $OUT/logs.tgz at the end (the device tool returns a few files).
set -u
[ -z "${S41_NESTED:-}" ] && trap 'tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/logs.tgz "$OUT/"' EXIT
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-first}
suite2() {  # LOG ARGS...: one gpu-suite run from $SUITE (default .gpu2)
  local log=$1 rc; shift
  timeout -s KILL 150 bash "${SUITE:-.gpu2}/run.sh" gpu-suite "$@" > "$OUT/suite-$log.log" 2>&1; rc=$?
  echo "-- $log: rc $rc"; grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$log.log" | cut -c1-600
  return $rc
}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
case $part in
  first)
    suite2 recompute --world 1 --filter recompute_suite::recomputation_matches_keeping
    suite2 recompute-tp2 --one-gpu --world 2 --filter recompute_suite::recomputation_matches_keeping
    ln -sfn .gpu2 .gpu
    run 1b-bf16 70 $bf16; memory 1b-bf16
    peers 1b-compile 150 llama-1b compile
    [ $SECONDS -lt 420 ] && ours steps-1
    [ $SECONDS -lt 440 ] && compiled compile-40
    [ $SECONDS -lt 520 ] && ours steps-2
    ;;
  buffers)
    export SUITE=.gpu3
    suite2 residual_gemm --world 1 --filter kernel_suite::residual_gemm || exit 1
    suite2 gated_gemm --world 1 --filter kernel_suite::gated_gemm || exit 1
    suite2 mlp --world 1 --filter layer_suite::mlp
    S41_NESTED=1 SKIP_TESTS=1 bash "$0" test
    ;;
  test)
    export SUITE=.gpu3
    if [ -z "${SKIP_TESTS:-}" ]; then
      # A failing (or hung) kernel test ends the call: the rest runs the same kernel.
      suite2 residual_gemm --world 1 --filter kernel_suite::residual_gemm || exit 1
      suite2 gated_gemm --world 1 --filter kernel_suite::gated_gemm || exit 1
      for test in layer_suite::mlp hf_suite::llama3_matches_transformers model_suite::adamw_steps_match \
        recompute_suite::recomputation_matches_keeping; do
        suite2 "${test#*::}" --world 1 --filter "$test"
      done
      suite2 mlp-tp2 --one-gpu --world 2 --filter layer_suite::mlp
      suite2 recompute-tp2 --one-gpu --world 2 --filter recompute_suite::recomputation_matches_keeping
    fi
    timeout -s KILL 200 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
      -k regex:'gemm|loaded|gated|add' bash .gpu3/run.sh bench --preset llama-1b --steps 1 --warmup 1 > "$OUT/ncu-onto.csv" 2>&1
    python3 docs/perf/scripts/ncu_table.py "$OUT/ncu-onto.csv" "$OUT/steady-onto.txt" "$OUT/ordered-onto.txt"
    head -14 "$OUT/steady-onto.txt"; rm -f "$OUT/ncu-onto.csv"
    [ "${STEPS:-1}" = 0 ] && exit 0
    ln -sfn .gpu3 .gpu
    [ $SECONDS -lt 400 ] && ours after-1
    [ $SECONDS -lt 430 ] && compiled compile
    [ $SECONDS -lt 520 ] && ours after-2
    ;;
  decode)
    for test in cached_decoding_matches_full_forward graph_decoding_matches_eager; do
      SUITE=.gpu2 suite2 "$test" --world 1 --filter "posttrain_suite::$test"
    done
    ;;
  rows)
    # bf16 first; FP8 promoted beside torchao only while the call has time for both.
    run 1b-bf16 70 $bf16; memory 1b-bf16
    peers 1b-compile 150 llama-1b compile
    if [ $SECONDS -lt ${FP8_BEFORE:-150} ]; then
      torchao
      run 1b-fp8 90 $fp8; memory 1b-fp8
      peers 1b-torchao 150 llama-1b fp8
    fi
    ;;
esac
