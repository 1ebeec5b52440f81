#!/usr/bin/env bash
# Session 20, one H200.
#   moe-suite: (carry .gpu with gpu-suite) the row kernels against Burn's ops, then the MoE
#              suite on the one GPU as two and four ranks, with the combine kernel on the rows
#              that come back over the all-to-all and `moe_steps_match` reporting the step at
#              which each layout's routing first differs from ep = 1's; REPEAT times (call 1: 1).
#   staged:    (carry .gpu with gpu-suite) the same build with shared-GPU collectives staged
#              through the host by the sending rank: the communicator and mapping suites on
#              the one GPU, then the MoE suite REPEAT times (call 3: 3).
# Logs go to $OUT (a device call brings back a few files).
set -u
cd "$(dirname "$0")/../../.."
part=${1:-moe-suite}
case $part in
  moe-suite)
    timeout -s KILL 120 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::row_kernels" > "$OUT/suite-row_kernels.log" 2>&1
    grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-row_kernels.log" | cut -c1-600
    for i in $(seq 1 "${REPEAT:-1}"); do
      [ $SECONDS -gt 420 ] && { echo "no time left for run $i"; continue; }
      timeout -s KILL 150 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::" > "$OUT/one-gpu-moe_suite-$i.log" 2>&1
      echo "run $i:"; grep -h "FAILED\|passed\|routing first" "$OUT/one-gpu-moe_suite-$i.log" | cut -c1-400
    done
    ;;
  staged)
    for suite in comm_suite mapping_suite; do
      timeout -s KILL 120 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "$suite::" > "$OUT/one-gpu-$suite.log" 2>&1
      echo "$suite:"; grep -h "FAILED\|passed" "$OUT/one-gpu-$suite.log" | cut -c1-400
    done
    for i in $(seq 1 "${REPEAT:-3}"); do
      [ $SECONDS -gt 430 ] && { echo "no time left for run $i"; continue; }
      timeout -s KILL 150 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::" > "$OUT/one-gpu-moe_suite-$i.log" 2>&1
      echo "run $i:"; grep -h "FAILED\|passed\|routing first" "$OUT/one-gpu-moe_suite-$i.log" | cut -c1-400
    done
    ;;
esac
