#!/usr/bin/env bash
# Session 38, one GPU:
#   side:   (carry .gpu with bench, .peers) ncu over one steady llama-1b bf16 step of ours and
#           one of PyTorch + compile (peer_torch.py unchanged, profiled from its timed step's
#           start by peer_step_ncu.py), both with the clocks free (--clock-control none), each
#           kernel's time by name (ncu_table.py); then each step again, unprofiled.
#   embtest: (carry .gpu2 with gpu-suite and bench, .gpu2/run.sh) the embedding's kernel tests
#           and the row kernels'; then ncu's times of the embedding's kernels in one bench step.
#   cetest: (carry .gpu2 with gpu-suite and bench, .gpu2/run.sh) the cross-entropy's one pass:
#           its kernel test, the embedding's, the layer suite's cross-entropy at tp 2 and 4 on one
#           GPU (ranks as threads), the model's loss and gradients and AdamW steps; then ncu's
#           times of the cross-entropy's and embedding's kernels over two bench steps.
#   rows:   (carry .gpu with bench, .peers, .whl) the rows beside the peers with the embedding's
#           and the cross-entropy's one pass (s6-common's rows: FP8 promoted beside torchao
#           float8 + compile, bf16 beside PyTorch + compile), then 40 bf16 steps and 40 of
#           compile's with the clocks sampled.
#   embed:  (carry .gpu with bench0, the bench of b1c51b8, and bench, whose embedding sorts its
#           gradient's positions by token; .peers) side's two profiles with bench, then the
#           llama-1b step before and after, alternating, 40 timed steps each with the clocks
#           sampled, and PyTorch + compile between.
# Logs go to $OUT, packed into one $OUT/logs.tgz at the end (the device tool returns a few files).
set -u
trap 'tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/logs.tgz "$OUT/"' EXIT
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-side}
scripts=$(pwd)/docs/perf/scripts
profile() {  # NAME WINDOW COMMAND...: ncu's kernel times, one row a kernel
  local name=$1 window=$2; shift 2
  timeout -s KILL 280 ncu --clock-control none --target-processes all --csv --print-units base \
    --metrics gpu__time_duration.sum "$@" > "$OUT/ncu-$name.csv" 2> "$OUT/ncu-$name.err"
  echo "== $name: rc $? $(python3 "$scripts/ncu_table.py" "$OUT/ncu-$name.csv" "$OUT/steady-$name.txt" "$OUT/ordered-$name.txt" $window)"
  head -30 "$OUT/steady-$name.txt" | cut -c1-110
  tail -3 "$OUT/ncu-$name.err"; rm -f "$OUT/ncu-$name.csv"
}
case $part in
  side)
    profile ours ce_partials -c 6000 bash .gpu/run.sh "${BENCH:-bench}" --preset llama-1b --steps 1 --warmup 2
    (cd .peers && profile compile "" --profile-from-start off python3 "$scripts/peer_step_ncu.py" \
      --preset llama-1b --compile --steps 1)
    [ $SECONDS -lt 420 ] && run 1b-bf16 70 $bf16
    [ $SECONDS -lt 480 ] && peers 1b-compile 110 llama-1b compile
    ;;
  embtest)
    for test in embedding_kernels row_kernels; do
      timeout -s KILL 150 bash .gpu2/run.sh gpu-suite --world 1 --filter "kernel_suite::$test" > "$OUT/suite-$test.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$test.log" | cut -c1-600
    done
    timeout -s KILL 200 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
      -k regex:'count_kernel|tile_sums|scan_kernel|place_kernel|rank_kernel|sum_kernel|gather_kernel' \
      bash .gpu2/run.sh bench --preset llama-1b --steps 1 --warmup 1 > "$OUT/ncu-embedding.csv" 2>&1
    grep gpu__time_duration "$OUT/ncu-embedding.csv" | awk -F'","' '{print $5, $NF}' | tr -d '"'
    ;;
  cetest)
    for test in kernel_suite::cross_entropy kernel_suite::embedding_kernels model_suite::tiny_loss_and_gradients \
      model_suite::adamw_steps_match; do
      timeout -s KILL 150 bash .gpu2/run.sh gpu-suite --world 1 --filter "$test" > "$OUT/suite-${test#*::}.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-${test#*::}.log" | cut -c1-600
    done
    for world in 2 4; do
      timeout -s KILL 150 bash .gpu2/run.sh gpu-suite --one-gpu --world $world --filter layer_suite::cross_entropy \
        > "$OUT/suite-layer-ce-$world.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-layer-ce-$world.log" | cut -c1-600
    done
    timeout -s KILL 200 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
      -k regex:'ce_|count_kernel|tile_sums|scan_kernel|place_kernel|rank_kernel|sum_kernel|gather_kernel' \
      bash .gpu2/run.sh bench --preset llama-1b --steps 1 --warmup 1 > "$OUT/ncu-ce.csv" 2>&1
    grep gpu__time_duration "$OUT/ncu-ce.csv" | awk -F'","' '{print $5, $NF}' | tr -d '"' |
      grep -E "^(ce_|count|tile_sums|scan|place|rank|sum|gather)" > "$OUT/ncu-ce.txt"; rm -f "$OUT/ncu-ce.csv"
    cat "$OUT/ncu-ce.txt"
    ;;
  rows)
    rows
    [ $SECONDS -lt 470 ] && ours final-40
    [ $SECONDS -lt 430 ] && compiled compile-40
    ;;
  embed)
    profile ours ce_partials -c 6000 bash .gpu/run.sh bench --preset llama-1b --steps 1 --warmup 2
    (cd .peers && profile compile "" --profile-from-start off python3 "$scripts/peer_step_ncu.py" \
      --preset llama-1b --compile --steps 1)
    for round in 1 2; do
      [ $SECONDS -lt 470 ] && BENCH=bench0 ours "before-$round"
      [ $SECONDS -lt 500 ] && ours "after-$round"
      [ $round = 1 ] && [ $SECONDS -lt 420 ] && compiled compile
    done
    ;;
esac
