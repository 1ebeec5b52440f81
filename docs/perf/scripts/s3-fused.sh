#!/usr/bin/env bash
# Session 3 (nvidia-h200-x2, carry .gpu with bench + gpu-suite, and .peers): GPU 0 runs the
# kernel suite, then llama-1b on every fused kernel (wgmma linears, flash attention, RMSNorm,
# SwiGLU, RoPE, fused AdamW) with its memory sampled by nvidia-smi; GPU 1 runs the PyTorch eager
# and torch.compile peers in the same call.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh bench --unpack-only >/dev/null 2>&1
bash .gpu/run.sh gpu-suite --unpack-only >/dev/null 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite > "$OUT/kernels.log" 2>&1
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/mem-1b.csv" &
  smi=$!
  timeout 200 bash .gpu/run.sh bench --preset llama-1b --profile --steps 10 --warmup 3 > "$OUT/bench-1b.log" 2>&1
  kill $smi
) &
(cd .peers && CUDA_VISIBLE_DEVICES=1 PEER_TIMEOUT=240 bash run_peers.sh llama-1b torch compile > "$OUT/peers.log" 2>&1) &
wait
grep -h "^test\|passed" "$OUT/kernels.log" | cut -c1-400
grep -h 'RESULT\|PROFILE' "$OUT/bench-1b.log" "$OUT/peers.log" | cut -c1-320
tail -n 3 "$OUT/bench-1b.log" | cut -c1-300
echo "peak MiB on GPU 0 during llama-1b: $(awk -F', ' '$1==0 {print $2}' "$OUT/mem-1b.csv" | sort -n | tail -1)"
