#!/usr/bin/env bash
# Session 8, third call (as s8-curves.sh): the draws' kernel against the host hash (the second
# call's failed from index 520, the second row: the 2-D output was allocated with padded rows and
# written by index; now 1-D), then NVFP4 again with the right draws, as many steps as fit.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
timeout -s KILL 60 bash .gpu/run.sh gpu-suite --world 1 --filter quantized_linear > "$OUT/kernel-suite.log" 2>&1
grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/kernel-suite.log" | cut -c1-600
timeout -s KILL 195 bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
  --init per-shard --precision nvfp4 --data data/shakespeare.txt --steps 300 --batch 1 \
  --lr 3e-4 --sample-every 0 > "$OUT/train-nvfp4.log" 2>&1
echo "nvfp4: $(grep -c '^step' "$OUT/train-nvfp4.log") steps; $(tail -n 3 "$OUT/train-nvfp4.log" | tr '\n' ' ')"
