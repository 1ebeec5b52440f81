#!/usr/bin/env bash
# Session 11, one H200 (carry .gpu2 with train; the plays in /tmp/m): llama-1b trained 300 steps
# on the Shakespeare plays (bytes) under bf16, FP8 delayed scaling (history 1024, its largest
# amax) and NVFP4, as s8-curves.sh ran the other recipes: bf16 compute, fp32 master weights,
# lr 3e-4, batch 1 × 2048 tokens, the same batches and initialization for every run.
set -u
cd "$(dirname "$0")/../../.."
for run in "default 110" "fp8-delayed 140" "nvfp4 310"; do
  set -- $run
  timeout -s KILL "$2" bash .gpu2/run.sh train --preset llama-1b --device cuda --dtype bf16 \
    --init per-shard --precision "$1" --data /tmp/m/shakespeare.txt --steps 300 --batch 1 \
    --lr 3e-4 --sample-every 0 > "$OUT/train-$1.log" 2>&1
  echo "$1: $(grep -c '^step' "$OUT/train-$1.log") steps; $(tail -n 3 "$OUT/train-$1.log" | tr '\n' ' ' | cut -c1-300)"
done
