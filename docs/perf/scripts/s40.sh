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
#   prefetch: (carry .gpu with bench0 and bench, .peers) ncu's times of the fused dgrad kernel in
#           both (bench0 before, bench after: its second pass brought into L2 while the tile is
#           computed; measured slower and reverted: that build is not in the tree), then `ab`
#           without the rows.
#   rows:   (carry .gpu with bench, .peers, .whl with torchao 0.18) s6-common's rows: FP8 promoted
#           beside torchao float8 + compile, bf16 beside PyTorch + compile (10 timed steps after 3
#           warm-up, the peers' recipe).
#   verify: (carry .gpu2 with gpu-suite) the GEMM kernels' tests after their consumers' k-loop and
#           producers' pipelines became shared pieces (`consume_slice`, `Pipeline::wide`).
# Logs go to $OUT, packed into one $OUT/logs.tgz at the end (the device tool returns a few files).
set -u
[ -z "${S40_NESTED:-}" ] && trap 'tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/logs.tgz "$OUT/"' EXIT
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-test}
suite2() {  # LOG ARGS...: one gpu-suite run from .gpu2
  local log=$1 rc; shift
  timeout -s KILL 150 bash .gpu2/run.sh gpu-suite "$@" > "$OUT/suite-$log.log" 2>&1; rc=$?
  echo "-- $log: rc $rc"; grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$log.log" | cut -c1-600
  return $rc
}
case $part in
  test)
    # A failing (or hung) kernel test ends the call: the rest runs the same kernel.
    suite2 gated_gemm --world 1 --filter kernel_suite::gated_gemm || exit 1
    for test in ${MORE:-kernel_suite::wgmma_gemm} layer_suite::mlp \
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
  prefetch)
    for b in bench0 bench; do
      timeout -s KILL 120 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
        -k regex:'gated_dgrad' bash .gpu/run.sh $b --preset llama-1b --steps 1 --warmup 1 > "$OUT/ncu-$b.csv" 2>&1
      python3 docs/perf/scripts/ncu_table.py "$OUT/ncu-$b.csv" "$OUT/steady-$b.txt" "$OUT/ordered-$b.txt"
      echo "-- $b"; head -3 "$OUT/steady-$b.txt"; rm -f "$OUT/ncu-$b.csv"
    done
    S40_NESTED=1 ROWS=0 bash "$0" ab
    ;;
  verify)
    for test in kernel_suite::gated_gemm kernel_suite::wgmma_gemm kernel_suite::fp8_gemm layer_suite::mlp; do
      suite2 "${test#*::}" --world 1 --filter "$test"
    done
    ;;
  rows)
    rows
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
