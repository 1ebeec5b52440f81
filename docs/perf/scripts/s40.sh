#!/usr/bin/env bash
# Session 40, one GPU:
#   test:   (carry .gpu2 with gpu-suite and bench, .peers) the down projection's data gradient with
#           the SwiGLU's backward in its epilogue (`gated_mlp`): the MLP's kernel test (forward
#           and the four gradients), the GEMM's, the MLP layer at tp 1 and at tp 2 on one GPU
#           (ranks as threads), the transformers fixtures (f32: the products apart), the model's
#           AdamW steps; then ncu's times of the GEMMs and the SwiGLU's kernels over three bench
#           steps; then, if time is left and STEPS is not 0, bench's llama-1b step (40 steps)
#           twice with PyTorch + compile's between.
#   ab:     (carry .gpu with bench0, the bench of the commit before, and bench; .peers) the
#           llama-1b step before and after, alternating, 40 timed steps each with the clocks
#           sampled, and PyTorch + compile between; then the rows (s6-common's) if ROWS=1 (.whl
#           carried too) and time is left.
# Logs go to $OUT, packed into one $OUT/logs.tgz at the end (the device tool returns a few files).
set -u
[ -z "${S40_NESTED:-}" ] && trap 'tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/logs.tgz "$OUT/"' EXIT
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-test}
suite2() {  # LOG ARGS...: one gpu-suite run from .gpu2
  local log=$1; shift
  timeout -s KILL 150 bash .gpu2/run.sh gpu-suite "$@" > "$OUT/suite-$log.log" 2>&1
  echo "-- $log: rc $?"; grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$log.log" | cut -c1-600
}
case $part in
  test)
    for test in kernel_suite::gated_gemm ${MORE:-kernel_suite::wgmma_gemm} layer_suite::mlp \
      hf_suite::llama3_matches_transformers model_suite::adamw_steps_match; do
      suite2 "${test#*::}" --world 1 --filter "$test"
    done
    suite2 mlp-tp2 --one-gpu --world 2 --filter layer_suite::mlp
    timeout -s KILL 200 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
      -k regex:'gemm|gated|swiglu' bash .gpu2/run.sh bench --preset llama-1b --steps 1 --warmup 1 > "$OUT/ncu-gated.csv" 2>&1
    python3 docs/perf/scripts/ncu_table.py "$OUT/ncu-gated.csv" "$OUT/steady-gated.txt" "$OUT/ordered-gated.txt"
    head -14 "$OUT/steady-gated.txt"; rm -f "$OUT/ncu-gated.csv"
    if [ "${STEPS:-1}" != 0 ] && [ $SECONDS -lt 300 ]; then
      ln -sfn .gpu2 .gpu
      ours after-1
      compiled compile
      [ $SECONDS -lt 500 ] && ours after-2
    fi
    ;;
  ab)
    for round in 1 2; do
      [ $SECONDS -lt 470 ] && BENCH=bench0 ours "before-$round"
      [ $SECONDS -lt 500 ] && ours "after-$round"
      [ $round = 1 ] && [ $SECONDS -lt 420 ] && compiled compile
    done
    [ "${ROWS:-0}" = 1 ] && [ $SECONDS -lt 300 ] && rows
    ;;
esac
