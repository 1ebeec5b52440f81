#!/usr/bin/env bash
# Session 9, one H200 (carry .gpu with gpu-suite and bench), after the dispatch's permutations
# became row gathers with gather gradients: the MoE suite on CUDA again, one moe-4b MoE layer
# phase by phase, and moe-4b on one GPU (the peers' recipe, 3 warm-up and 10 timed steps).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
timeout -s KILL 200 bash .gpu/run.sh gpu-suite --one-gpu --filter moe_suite > "$OUT/moe-suite-2.log" 2>&1
grep -h "FAILED\|passed" "$OUT/moe-suite-2.log" | cut -c1-300
timeout -s KILL 100 bash .gpu/run.sh bench --moe-breakdown > "$OUT/moe-breakdown.log" 2>&1
grep -h "MOE\|panicked" "$OUT/moe-breakdown.log"
run moe4b-2 240 --preset moe-4b --steps 10 --warmup 3 --profile
