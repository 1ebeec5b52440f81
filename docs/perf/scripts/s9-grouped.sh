#!/usr/bin/env bash
# Session 9, one H200 (carry .gpu with gpu-suite and bench): the grouped GEMM on CUDA against
# the CPU (kernel suite), then its speed on moe-4b's shapes beside torch._grouped_mm (cuBLAS)
# on the same group sizes.
set -u
cd "$(dirname "$0")/../../.."
timeout -s KILL 150 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite::grouped > "$OUT/kernel-suite.log" 2>&1
grep -h "FAILED\|passed\|ok (\|panicked\|error" "$OUT/kernel-suite.log" | cut -c1-400
timeout -s KILL 120 bash .gpu/run.sh bench --grouped > "$OUT/grouped.log" 2>&1
grep -h "GROUPED\|GROUP_SIZES\|panicked\|error" "$OUT/grouped.log" | cut -c1-400
sizes=$(grep GROUP_SIZES "$OUT/grouped.log" | sed 's/GROUP_SIZES //')
timeout -s KILL 90 python3 examples/bench/grouped_peer.py "$sizes" > "$OUT/grouped-peer.log" 2>&1
grep -h "GROUPED\|Error" "$OUT/grouped-peer.log" | cut -c1-400
