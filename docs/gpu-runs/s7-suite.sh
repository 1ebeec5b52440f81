#!/usr/bin/env bash
# Session 7 (nvidia-h200, one GPU; carry .gpu with gpu-suite and bench): the suite with f32
# products kept in f32 (no TF32) and the CPU's f32 tolerances, ranks as threads sharing GPU 0
# (`--one-gpu`: data between ranks through host memory; only one H200 was lent). Then llama-1b's
# step on the fused master-weight AdamW, profiled.
set -u
cd "$(dirname "$0")/../.."
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
timeout -s KILL 300 bash .gpu/run.sh gpu-suite --one-gpu --world 2 > "$OUT/suite-one-gpu.log" 2>&1
grep -h "FAILED\|passed\|f32_matmul\|adamw_master\|sum_of_squares" "$OUT/suite-one-gpu.log" | cut -c1-300
timeout -s KILL 150 bash .gpu/run.sh bench --preset llama-1b --steps 10 --warmup 3 --profile > "$OUT/bench-1b.log" 2>&1
grep -h "RESULT\|PROFILE\|panicked" "$OUT/bench-1b.log" | cut -c1-400
