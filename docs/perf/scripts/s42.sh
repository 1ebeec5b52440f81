#!/usr/bin/env bash
# Session 42, one GPU:
#   first:  (carry .gpu2 with gpu-suite and bench, .peers) the decoding paths through the
#           residual's epilogue (s41.sh decode); on an H200, the bf16 row beside PyTorch +
#           compile (10 timed steps after 3 warm-up), then 40 steps of each.
#   tight:  the same in less device time: the kernel test, 40 steps beside compile's, the rest.
#   ncu:    (carry .gpu3) ncu over a bench step: the GEMMs and RoPE's kernels.
#   tables: (branch next/rotated-tables, carry .gpu5, .peers) the table values loaded as a
#           tile starts, the loaded epilogues in quarters: tests, ncu, 40 steps around compile's.
#   tables-ab: (carry .gpu6) 40 steps of main's build and the branch's, alternating.
#   ab:     (carry .gpu4) 40 steps of the build before and this one, alternating.
#   test:   (carry .gpu3 with gpu-suite and bench, .peers) RoPE in q's and k's products'
#           epilogue: the tests, ncu over a bench step, 40 steps twice around compile's.
# Logs go to $OUT, packed into one $OUT/logs.tgz at the end (the device tool returns a few files).
set -u
[ -z "${S42_NESTED:-}" ] && trap 'tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/logs.tgz "$OUT/"' EXIT
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-first}
suite() {  # LOG ARGS...: one gpu-suite run from $SUITE (default .gpu2)
  local log=$1 rc; shift
  timeout -s KILL 150 bash "${SUITE:-.gpu2}/run.sh" gpu-suite "$@" > "$OUT/suite-$log.log" 2>&1; rc=$?
  echo "-- $log: rc $rc"; grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$log.log" | cut -c1-600
  return $rc
}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
case $part in
  first)
    for test in cached_decoding_matches_full_forward graph_decoding_matches_eager; do
      suite "$test" --world 1 --filter "posttrain_suite::$test"
    done
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      ln -sfn .gpu2 .gpu
      run 1b-bf16 70 $bf16; memory 1b-bf16
      peers 1b-compile 150 llama-1b compile
      [ $SECONDS -lt 420 ] && ours steps-1
      [ $SECONDS -lt 440 ] && compiled compile-40
    fi
    ;;
  test)
    # (carry .gpu3 with gpu-suite and bench, .peers) q's and k's products with RoPE in their
    # epilogue (`linear_rotated`, `rotary_attention_rotated`): the kernel test (a failing or hung
    # one ends the call), flash attention's, the attention layer at tp 1 and 2, the Llama 3
    # transformers fixture, decoding; ncu's times of the GEMMs and RoPE's kernel over a bench
    # step; 40 llama-1b steps twice around compile's (on an H200: the row, then 40 steps).
    export SUITE=.gpu3
    suite rotated_gemm --world 1 --filter kernel_suite::rotated_gemm || exit 1
    for test in kernel_suite::flash_attention layer_suite::attention hf_suite::llama3_matches_transformers \
      posttrain_suite::cached_decoding_matches_full_forward posttrain_suite::graph_decoding_matches_eager; do
      suite "${test#*::}" --world 1 --filter "$test"
    done
    suite attention-tp2 --one-gpu --world 2 --filter layer_suite::attention
    timeout -s KILL 200 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
      -k regex:'gemm|rope' bash .gpu3/run.sh bench --preset llama-1b --steps 1 --warmup 1 > "$OUT/ncu-rotated.csv" 2>&1
    python3 docs/perf/scripts/ncu_table.py "$OUT/ncu-rotated.csv" "$OUT/steady-rotated.txt" "$OUT/ordered-rotated.txt"
    head -14 "$OUT/steady-rotated.txt"; rm -f "$OUT/ncu-rotated.csv"
    ln -sfn .gpu3 .gpu
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      # The H200 row, on the peers' recipe (3 warm-up, 10 timed steps), then 40 of ours.
      run 1b-bf16 70 $bf16; memory 1b-bf16
      [ $SECONDS -lt 380 ] && peers 1b-compile 150 llama-1b compile
      [ $SECONDS -lt 470 ] && ours after-1
    else
      [ $SECONDS -lt 330 ] && ours after-1
      [ $SECONDS -lt 380 ] && compiled compile
      [ $SECONDS -lt 450 ] && ours after-2
    fi
    ;;
  tight)
    # (carry .gpu3, .peers) what little device time is left: the rotated products' kernel test,
    # 40 llama-1b steps beside compile's 40, then the other tests while time is left.
    export SUITE=.gpu3
    suite rotated_gemm --world 1 --filter kernel_suite::rotated_gemm || exit 1
    ln -sfn .gpu3 .gpu
    ours after-1
    [ $SECONDS -lt 250 ] && compiled compile
    for test in layer_suite::attention posttrain_suite::cached_decoding_matches_full_forward \
      posttrain_suite::graph_decoding_matches_eager hf_suite::llama3_matches_transformers kernel_suite::flash_attention; do
      [ $SECONDS -lt 400 ] && suite "${test#*::}" --world 1 --filter "$test"
    done
    ;;
  ab)
    # (carry .gpu4 with bench0 = d3ed27a, the session before's, and bench = this one) 40 steps
    # each, alternating.
    ln -sfn .gpu4 .gpu
    for round in 1 2; do
      [ $SECONDS -lt 170 ] && BENCH=bench0 ours "before-$round"
      [ $SECONDS -lt 200 ] && ours "after-$round"
    done
    ;;
  ncu)
    # (carry .gpu3) ncu's times of the GEMMs and RoPE's kernels over a bench step.
    timeout -s KILL 140 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
      -k regex:'gemm|rope' bash .gpu3/run.sh bench --preset llama-1b --steps 1 --warmup 1 > "$OUT/ncu-rotated.csv" 2>&1
    python3 docs/perf/scripts/ncu_table.py "$OUT/ncu-rotated.csv" "$OUT/steady-rotated.txt" "$OUT/ordered-rotated.txt"
    head -14 "$OUT/steady-rotated.txt"; rm -f "$OUT/ncu-rotated.csv"
    ;;
  tables)
    # (branch next/rotated-tables; carry .gpu5 with its gpu-suite and bench, .peers) the rotated
    # products' table values loaded as a tile starts (registers by `setmaxnreg`, as the promoted
    # FP8 kernel's), and the loaded
    # epilogues (the residual's, the SwiGLU's backward) in four quarters through two boxes: the
    # kernel tests (a failing one ends the call), the attention and MLP layers, ncu of the GEMMs,
    # 40 steps twice around compile's.
    export SUITE=.gpu5
    for test in rotated_gemm residual_gemm gated_gemm; do
      suite "$test" --world 1 --filter "kernel_suite::$test" || exit 1
    done
    suite attention --world 1 --filter layer_suite::attention
    suite mlp --world 1 --filter layer_suite::mlp
    timeout -s KILL 140 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
      -k regex:'gemm|loaded|gated' bash .gpu5/run.sh bench --preset llama-1b --steps 1 --warmup 1 > "$OUT/ncu-tables.csv" 2>&1
    python3 docs/perf/scripts/ncu_table.py "$OUT/ncu-tables.csv" "$OUT/steady-tables.txt" "$OUT/ordered-tables.txt"
    head -16 "$OUT/steady-tables.txt"; rm -f "$OUT/ncu-tables.csv"
    ln -sfn .gpu5 .gpu
    [ $SECONDS -lt 380 ] && ours after-1
    [ $SECONDS -lt 420 ] && compiled compile
    [ $SECONDS -lt 500 ] && ours after-2
    ;;
  tables-ab)
    # (the same warm machine, carry .gpu6: bench and bench0 = main's da8dc9f; both bundles
    # together pass the carry's 64 MiB) 40 steps before and after, alternating.
    ln -sfn .gpu6 .gpu
    for round in 1 2 3; do
      [ $SECONDS -lt 400 ] && BENCH=bench0 ours "before-$round"
      [ $SECONDS -lt 450 ] && ours "after-$round"
    done
    ;;
esac
