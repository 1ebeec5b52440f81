#!/usr/bin/env bash
# Session 10, one H200 (carry .gpu with generate and bench): decode speed with the KV cache,
# ours (`generate --preset`, random bf16 weights) beside transformers' `generate` (static cache +
# torch.compile, `examples/generate/peer.py`) on the same shapes: SmolLM2-135M and llama-1b, batch
# 1 and 32, 128 prompt tokens, 128 new tokens, greedy, in one call.
# `s10-generate.sh peers` runs the peer alone.
set -u
cd "$(dirname "$0")/../../.."
for preset in smollm2-135m llama-1b; do
  for batch in 1 32; do
    [ "${1:-}" = peers ] || timeout -s KILL 120 bash .gpu/run.sh generate --preset $preset --device cuda --batch $batch \
      --prompt-len 128 --max-new 128 > "$OUT/gen-$preset-$batch.log" 2>&1
    [ "${1:-}" = peers ] || grep -h 'RESULT\|panicked\|error' "$OUT/gen-$preset-$batch.log" | cut -c1-300
    timeout -s KILL 100 python3 examples/generate/peer.py $preset $batch 128 128 > "$OUT/peer-$preset-$batch.log" 2>&1
    grep -h 'RESULT\|Error' "$OUT/peer-$preset-$batch.log" | cut -c1-300
  done
done
