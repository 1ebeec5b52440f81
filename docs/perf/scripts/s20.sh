#!/usr/bin/env bash
# Session 20, one H200.
#   moe-suite: (carry .gpu with gpu-suite) the row kernels against Burn's ops, then the MoE
#              suite on the one GPU as two and four ranks, with the combine kernel on the rows
#              that come back over the all-to-all and `moe_steps_match` reporting the step at
#              which each layout's routing first differs from ep = 1's; REPEAT times (call 1: 1).
#   staged:    (carry .gpu with gpu-suite) the same build with shared-GPU collectives staged
#              through the host by the sending rank: the communicator and mapping suites on
#              the one GPU, then the MoE suite REPEAT times (call 3: 3).
#   moe:       (carry .gpu with gpu-suite and bench, .peers) the row kernels and the MoE suite
#              on the one GPU with the dispatch's indices in one upload, the FP8 steps against
#              tp = 1 (model_suite::fp8_*) on the one GPU as two ranks, `bench --moe-breakdown`
#              (the dispatch's three parts timed alone), then moe-4b beside PyTorch +
#              torch._grouped_mm + torch.compile in the same call (the peers' recipe: bf16
#              compute, fp32 master weights, random ids, 3 warm-up and 10 timed steps).
#   ab:        (carry .gpu with bench and bench-old, bench built at 5e5597d, the commit before
#              this session) moe-4b with each, alternating, twice: the same call, the same
#              recipe, so what this session's code changed is the difference.
# Logs go to $OUT (a device call brings back a few files).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
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
  moe)
    timeout -s KILL 60 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::row_kernels" > "$OUT/suite-row_kernels.log" 2>&1
    grep -h "FAILED\|passed" "$OUT/suite-row_kernels.log" | cut -c1-400
    timeout -s KILL 150 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::" > "$OUT/one-gpu-moe_suite.log" 2>&1
    grep -h "FAILED\|passed" "$OUT/one-gpu-moe_suite.log" | cut -c1-400
    timeout -s KILL 90 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "model_suite::fp8" > "$OUT/one-gpu-fp8-steps.log" 2>&1
    grep -h "FAILED\|passed\|ok (" "$OUT/one-gpu-fp8-steps.log" | cut -c1-400
    timeout -s KILL 90 bash .gpu/run.sh bench --moe-breakdown > "$OUT/moe-breakdown.log" 2>&1
    grep -h "MOE\|panicked" "$OUT/moe-breakdown.log"
    run moe4b 150 --preset moe-4b --steps 10 --warmup 3
    peers moe4b-torch 200 moe-4b moe
    ;;
  ab)
    grep -m1 "model name" /proc/cpuinfo; nvidia-smi --query-gpu=clocks.max.sm,power.limit --format=csv,noheader
    for i in 1 2; do
      for b in bench-old bench; do
        [ $SECONDS -gt 400 ] && { echo "no time left for $b $i"; continue; }
        timeout -s KILL 100 bash .gpu/run.sh $b --preset moe-4b --steps 10 --warmup 3 > "$OUT/$b-$i.log" 2>&1
        echo "$b $i: $(grep -h RESULT "$OUT/$b-$i.log" | grep -o '"step_ms": [0-9.]*, "tokens_per_s": [0-9]*')"
      done
    done
    ;;
  ab-dispatch)
    # (carry .gpu with bench and bench-old) the dispatch decided by counting (one pass): each
    # binary's breakdown, then moe-4b with each.
    for b in bench-old bench; do
      timeout -s KILL 60 bash .gpu/run.sh $b --moe-breakdown > "$OUT/$b-breakdown.log" 2>&1
      echo "$b:"; grep -h "dispatch\|forward" "$OUT/$b-breakdown.log"
    done
    for b in bench-old bench; do
      [ $SECONDS -gt 250 ] && { echo "no time left for $b"; continue; }
      timeout -s KILL 80 bash .gpu/run.sh $b --preset moe-4b --steps 10 --warmup 3 > "$OUT/$b-moe4b.log" 2>&1
      echo "$b: $(grep -h RESULT "$OUT/$b-moe4b.log" | grep -o '"step_ms": [0-9.]*, "tokens_per_s": [0-9]*')"
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
