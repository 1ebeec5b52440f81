#!/usr/bin/env bash
# Session 2, second device call on nvidia-h200-x2 (carry .gpu with bench + train, and .peers):
#   GPU 0: llama-1b with the linears on SpecializedTmaMma (--profile); GPU 1: the PyTorch eager
#   peer, in the same call; then examples/train in bf16 at tp2 (SP) and at dp2 (ZeRO-1).
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh bench --unpack-only >/dev/null 2>&1
bash .gpu/run.sh train --unpack-only >/dev/null 2>&1
(CUDA_VISIBLE_DEVICES=0 timeout 260 bash .gpu/run.sh bench --preset llama-1b --profile --steps 5 --warmup 2 > "$OUT/bench-1b.log" 2>&1) &
(cd .peers && CUDA_VISIBLE_DEVICES=1 PEER_TIMEOUT=120 bash run_peers.sh llama-1b torch > "$OUT/peers.log" 2>&1) &
wait
timeout 110 bash .gpu/run.sh train --device cuda --dtype bf16 --tp 2 --sp --steps 30 --sample-every 15 > "$OUT/train-tp2.log" 2>&1
timeout 110 bash .gpu/run.sh train --device cuda --dtype bf16 --dp 2 --zero1 --steps 30 --sample-every 15 > "$OUT/train-dp2.log" 2>&1
grep -h 'RESULT\|PROFILE\|warmup\|panick\|rror' "$OUT/bench-1b.log" "$OUT/peers.log" | cut -c1-320
tail -n 2 "$OUT/bench-1b.log" | cut -c1-300
grep -h 'tokens/s\|^step 1 \|^step 30\|sample\|rror' "$OUT/train-tp2.log" "$OUT/train-dp2.log"
