#!/usr/bin/env bash
# Session 21, one H200.
#   moe:  (carry .gpu with gpu-suite and bench, .peers) the dispatch order kernels against the
#         host's order, the MoE suite on the one GPU as two and four ranks (every dropless
#         dispatch now decided on the device), the FP8 steps against tp = 1
#         (model_suite::fp8_*, their curve within 5e-2 on bf16 outputs), `bench
#         --moe-breakdown` (the dispatch decided on the device beside the same order decided on
#         the host, in one binary), then moe-4b beside PyTorch + torch._grouped_mm +
#         torch.compile in the same call (bf16 compute, fp32 master weights, random ids, 3
#         warm-up and 10 timed steps).
#   ab:   (carry .gpu with bench and bench-old, bench-old built at 24af85f, the commit before
#         this session) moe-4b with each, alternating, twice.
# Logs go to $OUT (a device call brings back a few files).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-moe}
case $part in
  moe)
    timeout -s KILL 60 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::expert_order" > "$OUT/suite-expert_order.log" 2>&1
    grep -h "FAILED\|passed\|panicked\|left:\|right:" "$OUT/suite-expert_order.log" | cut -c1-1500
    timeout -s KILL 150 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::" > "$OUT/one-gpu-moe_suite.log" 2>&1
    grep -h "FAILED\|passed\|routing first" "$OUT/one-gpu-moe_suite.log" | cut -c1-400
    if [ -z "${SKIP_FP8:-}" ]; then
      timeout -s KILL 90 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "model_suite::fp8" > "$OUT/one-gpu-fp8-steps.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/one-gpu-fp8-steps.log" | cut -c1-400
    fi
    timeout -s KILL 60 bash .gpu/run.sh bench --moe-breakdown > "$OUT/moe-breakdown.log" 2>&1
    grep -h "MOE\|panicked" "$OUT/moe-breakdown.log"
    [ $SECONDS -gt 330 ] && { echo "no time left for moe-4b"; exit 0; }
    run moe4b 100 --preset moe-4b --steps 10 --warmup 3
    peers moe4b-torch 160 moe-4b moe
    ;;
  ab)
    for i in 1 2; do
      for b in bench-old bench; do
        [ $SECONDS -gt 400 ] && { echo "no time left for $b $i"; continue; }
        timeout -s KILL 100 bash .gpu/run.sh $b --preset moe-4b --steps 10 --warmup 3 > "$OUT/$b-$i.log" 2>&1
        echo "$b $i: $(grep -h RESULT "$OUT/$b-$i.log" | grep -o '"step_ms": [0-9.]*, "tokens_per_s": [0-9]*')"
      done
    done
    ;;
esac
