#!/usr/bin/env bash
# Session 36, one GPU (carry .gpu with bench and train, .peers):
#   clocks: why our bf16 step runs at a lower SM clock than PyTorch + compile's. nvidia-smi every
#           50 ms (SM clock, power, GPU and memory temperature, the active clock-event reasons)
#           over 40 timed llama-1b steps of each, alternating: compile, ours, compile, ours.
#           Per run: the busy samples' clock quartiles, mean and top power, top temperatures, and
#           how often each clock-event reason was active.
#   watch:  (s35.sh watch) bench and train past the device's memory stop on CubeCL's failures.
#   fused:  (carry .gpu with gpu-suite and bench) the backward as one kernel, dQ added by TMA
#           reductions: its kernel tests, flash attention alone, and 40 llama-1b steps.
#   ab:     (carry .gpu with bench0, the bench of 693a92f, and bench) the step before and after,
#           alternating, and PyTorch + compile.
# Logs go to $OUT.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-clocks}
case $part in
  clocks)
    nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
    compiled compile-1
    ours ours-1
    [ $SECONDS -lt 380 ] && compiled compile-2
    [ $SECONDS -lt 480 ] && ours ours-2
    ;;
  watch)
    bash docs/perf/scripts/s35.sh watch
    ;;
  fused)
    suite flash_attention
    timeout -s KILL 120 bash .gpu/run.sh bench --attention > "$OUT/attention.log" 2>&1
    grep -v '^MEMORY' "$OUT/attention.log" | grep -i 'attention\|panicked\|error' | cut -c1-300
    ours fused-1
    ;;
  ab)
    for b in bench0 bench; do
      timeout -s KILL 90 bash .gpu/run.sh $b --attention > "$OUT/attention-$b.log" 2>&1
      echo "$b: $(grep -h '^ATTENTION' "$OUT/attention-$b.log" | cut -c1-200 | tr '\n' ' ')"
    done
    BENCH=bench0 ours before-1
    ours after-1
    compiled compile-1
    [ $SECONDS -lt 420 ] && BENCH=bench0 ours before-2
    [ $SECONDS -lt 480 ] && ours after-2
    ;;
esac
