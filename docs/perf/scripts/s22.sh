#!/usr/bin/env bash
# Session 22, one H200.
#   moe:  (carry .gpu with gpu-suite and bench, .peers) the dispatch with no read to the host
#         (the order's rows given their most room, the grouped products finding each tile's
#         expert from the starts on the device): the order and grouped-product kernels against
#         their references, `bench --moe-breakdown`, moe-4b beside PyTorch + torch._grouped_mm
#         + torch.compile in the same call (bf16 compute, fp32 master weights, random ids, 3
#         warm-up and 10 timed steps), ours a second time, then the MoE suite on the one GPU
#         as two and four ranks while time is left.
#   suite: (carry .gpu with gpu-suite and bench) the MoE suite, the grouped product's table
#         (`bench --grouped` beside `grouped_peer.py`).
#   profile: (carry .gpu with bench) moe-4b's step in pieces (`--profile`: each piece
#         synchronized, and the host's time issuing a step from an idle GPU).
# Logs go to $OUT (a device call brings back a few files).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-moe}
case $part in
  moe)
    for t in expert_order grouped_gemm; do
      timeout -s KILL 60 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::$t" > "$OUT/suite-$t.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked\|left:\|right:" "$OUT/suite-$t.log" | cut -c1-800
      grep -q "0 failed" "$OUT/suite-$t.log" || { tail -30 "$OUT/suite-$t.log" | cut -c1-400; exit 1; }
    done
    timeout -s KILL 60 bash .gpu/run.sh bench --moe-breakdown > "$OUT/moe-breakdown.log" 2>&1
    grep -h "MOE\|panicked" "$OUT/moe-breakdown.log"
    run moe4b 100 --preset moe-4b --steps 10 --warmup 3
    peers moe4b-torch 170 moe-4b moe
    run moe4b-2 100 --preset moe-4b --steps 10 --warmup 3
    [ $SECONDS -gt 400 ] && { echo "no time left for the MoE suite"; exit 0; }
    timeout -s KILL $((570 - SECONDS)) bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::" > "$OUT/one-gpu-moe_suite.log" 2>&1
    grep -h "FAILED\|passed\|routing first" "$OUT/one-gpu-moe_suite.log" | cut -c1-400
    ;;
  suite)
    timeout -s KILL 200 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::" > "$OUT/one-gpu-moe_suite.log" 2>&1
    grep -h "FAILED\|passed\|routing first" "$OUT/one-gpu-moe_suite.log" | cut -c1-400
    timeout -s KILL 120 bash .gpu/run.sh bench --grouped > "$OUT/grouped.log" 2>&1
    grep -h "GROUPED\|GROUP_SIZES\|panicked" "$OUT/grouped.log" | cut -c1-300
    sizes=$(grep GROUP_SIZES "$OUT/grouped.log" | sed 's/GROUP_SIZES //')
    timeout -s KILL 90 python3 examples/bench/grouped_peer.py "$sizes" > "$OUT/grouped-peer.log" 2>&1
    grep -h "GROUPED\|Error" "$OUT/grouped-peer.log" | cut -c1-300
    ;;
  profile)
    run moe4b-profile 150 --preset moe-4b --steps 10 --warmup 3 --profile
    ;;
esac
