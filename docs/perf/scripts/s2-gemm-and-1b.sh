#!/usr/bin/env bash
# Session 2, one device call on nvidia-h200-x2 (carry .gpu and .peers; bench and train bundled):
#   GPU 0: every cubek matmul routine on the llama GEMM shapes, then cuBLAS on the same shapes;
#   GPU 1: llama-1b with Burn's autotune on (--profile), then the PyTorch eager peer;
#   then examples/train on both GPUs at tp2 (SP) and at dp2 (ZeRO-1).
set -u
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0
bash .gpu/run.sh bench --unpack-only >/dev/null 2>&1
bash .gpu/run.sh train --unpack-only >/dev/null 2>&1
(
  CUDA_VISIBLE_DEVICES=0 timeout 330 bash .gpu/run.sh bench --gemm > "$OUT/gemm.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 examples/bench/gemm_peer.py > "$OUT/gemm-peer.log" 2>&1
) &
(
  CUDA_VISIBLE_DEVICES=1 CUBECL_AUTOTUNE_LEVEL=minimal timeout 300 bash .gpu/run.sh bench --preset llama-1b --profile --steps 5 --warmup 2 > "$OUT/bench-1b.log" 2>&1
  cd .peers && CUDA_VISIBLE_DEVICES=1 PEER_TIMEOUT=100 bash run_peers.sh llama-1b torch > "$OUT/peers.log" 2>&1
) &
wait
CUBECL_AUTOTUNE_LEVEL=minimal timeout 90 bash .gpu/run.sh train --device cuda --tp 2 --sp --steps 30 --sample-every 10 > "$OUT/train-tp2.log" 2>&1
CUBECL_AUTOTUNE_LEVEL=minimal timeout 90 bash .gpu/run.sh train --device cuda --dp 2 --zero1 --steps 30 --sample-every 10 > "$OUT/train-dp2.log" 2>&1
grep -h '^GEMM' "$OUT/gemm.log" "$OUT/gemm-peer.log" | sed 's/"m": [0-9]*, "k": [0-9]*, "n": [0-9]*, //' | cut -c1-140
grep -h 'RESULT\|PROFILE\|warmup' "$OUT/bench-1b.log" "$OUT/peers.log" | cut -c1-300
tail -n 3 "$OUT/bench-1b.log" | cut -c1-300
grep -h 'tokens/s\|^step 30\|sample\|rror' "$OUT/train-tp2.log" "$OUT/train-dp2.log" | tail -n 12
