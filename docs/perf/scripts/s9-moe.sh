#!/usr/bin/env bash
# Session 9, one H200 (carry .gpu with gpu-suite and bench): the MoE suite on CUDA (ranks as
# threads sharing GPU 0, f32 and the layer in bf16) and the grouped GEMM's kernel test, then
# moe-4b on one GPU (the peers' recipe: bf16 compute, fp32 master weights, random ids, 3
# warm-up and 10 timed steps). The peers run in s9-moe-peers.sh.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
timeout -s KILL 200 bash .gpu/run.sh gpu-suite --one-gpu --filter moe_suite > "$OUT/moe-suite.log" 2>&1
timeout -s KILL 60 bash .gpu/run.sh gpu-suite --filter grouped >> "$OUT/moe-suite.log" 2>&1
grep -h "FAILED\|passed\|ok (" "$OUT/moe-suite.log" | cut -c1-300
run moe4b 240 --preset moe-4b --steps 10 --warmup 3 --profile
