#!/usr/bin/env bash
# Session 9, one H200 (carry .gpu with train, and data/ from scripts/fetch-shakespeare.sh): the
# two convergence runs session 8 could not finish, as s8-curves.sh ran the others: llama-1b on
# the plays, bf16 compute with fp32 master weights, lr 3e-4, batch 1 × 2048, 300 steps, under
# FP8 tensorwise with E4M3 gradients (on the FP8 kernels) and MXFP8 (emulated).
set -u
cd "$(dirname "$0")/../../.."
for recipe in fp8-tensorwise-e4m3 mxfp8; do
  limit=$([ "$recipe" = mxfp8 ] && echo 250 || echo 80)
  timeout -s KILL "$limit" bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
    --init per-shard --precision "$recipe" --data data/shakespeare.txt --steps 300 --batch 1 \
    --lr 3e-4 --sample-every 0 > "$OUT/train-$recipe.log" 2>&1
  echo "$recipe: $(grep -c '^step' "$OUT/train-$recipe.log") steps; $(tail -n 3 "$OUT/train-$recipe.log" | tr '\n' ' ')"
done
