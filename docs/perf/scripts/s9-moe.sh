#!/usr/bin/env bash
# Session 9, one H200 (carry .gpu with gpu-suite and bench): the MoE suite on CUDA (ranks as
# threads sharing GPU 0, f32 and the layer in bf16) and the grouped GEMM's kernel test; the
# grouped GEMM on moe-4b's shapes beside torch._grouped_mm; then moe-4b on one GPU (the peers'
# recipe: bf16 compute, fp32 master weights, random ids, 3 warm-up and 10 timed steps). The
# peers of the whole model run in s9-moe-peers.sh.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
timeout -s KILL 200 bash .gpu/run.sh gpu-suite --one-gpu --filter moe_suite > "$OUT/moe-suite.log" 2>&1
timeout -s KILL 60 bash .gpu/run.sh gpu-suite --filter grouped >> "$OUT/moe-suite.log" 2>&1
grep -h "FAILED\|passed" "$OUT/moe-suite.log" | cut -c1-300
timeout -s KILL 120 bash .gpu/run.sh bench --grouped > "$OUT/grouped.log" 2>&1
sizes=$(grep GROUP_SIZES "$OUT/grouped.log" | sed 's/GROUP_SIZES //')
timeout -s KILL 90 python3 examples/bench/grouped_peer.py "$sizes" > "$OUT/grouped-peer.log" 2>&1
grep -h "GROUPED" "$OUT/grouped.log" "$OUT/grouped-peer.log" | sed 's/"rows": 32768, //; s/"experts": 32, //' | cut -c10-230
run moe4b 240 --preset moe-4b --steps 10 --warmup 3 --profile
