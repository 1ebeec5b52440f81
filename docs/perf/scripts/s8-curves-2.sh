#!/usr/bin/env bash
# Session 8, second call (as s8-curves.sh): the draws' kernel against the host hash again, then
# FP8 blockwise (its first run stopped on a NaN at step 144: a tile of gradients so small that
# 1 / scale overflowed, now scaled by 1) for 300 steps and NVFP4 for as many as fit.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
timeout -s KILL 60 bash .gpu/run.sh gpu-suite --world 1 --filter quantized_linear > "$OUT/kernel-suite.log" 2>&1
grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/kernel-suite.log" | cut -c1-600
train() {  # PRECISION LIMIT
  timeout -s KILL "$2" bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
    --init per-shard --precision "$1" --data data/shakespeare.txt --steps 300 --batch 1 \
    --lr 3e-4 --sample-every 0 > "$OUT/train-$1.log" 2>&1
  echo "$1: $(grep -c '^step' "$OUT/train-$1.log") steps; $(tail -n 3 "$OUT/train-$1.log" | tr '\n' ' ')"
}
train fp8-blockwise 250
train nvfp4 250
