#!/usr/bin/env bash
# Session 8, one H200 (nvidia-h200; carry .gpu with gpu-suite and train, and data/ from
# scripts/fetch-shakespeare.sh): every recipe's product on CUDA against the CPU emulation (the
# stochastic draws' kernel against the host hash among it), then llama-1b trained 300 steps on the
# Shakespeare plays (bytes) under bf16 and each low-precision recipe: bf16 compute, fp32 master
# weights, lr 3e-4, batch 1 × 2048 tokens (the emulated recipes take ~0.3 s a step at this size).
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
timeout -s KILL 90 bash .gpu/run.sh gpu-suite --world 1 --filter quantized_linear > "$OUT/kernel-suite.log" 2>&1
grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/kernel-suite.log" | cut -c1-400
for precision in default fp8-tensorwise fp8-blockwise mxfp8 nvfp4; do
  timeout -s KILL 160 bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
    --init per-shard --precision "$precision" --data data/shakespeare.txt --steps 300 --batch 1 \
    --lr 3e-4 --sample-every 0 > "$OUT/train-$precision.log" 2>&1
  echo "$precision: $(grep -c '^step' "$OUT/train-$precision.log") steps; $(tail -n 4 "$OUT/train-$precision.log" | tr '\n' ' ')"
done
