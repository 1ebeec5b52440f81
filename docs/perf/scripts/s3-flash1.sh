#!/usr/bin/env bash
# Session 3 (nvidia-h200-x2, carry .gpu with bench + gpu-suite): the kernel suite (wgmma GEMM, SwiGLU, RMSNorm,
# flash attention forward/backward against Burn's f32 attention) on GPU 0, and llama-1b with
# flash attention and the wgmma linears on GPU 1.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh bench --unpack-only >/dev/null 2>&1
bash .gpu/run.sh gpu-suite --unpack-only >/dev/null 2>&1
(CUDA_VISIBLE_DEVICES=0 timeout 300 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite > "$OUT/kernels.log" 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 300 bash .gpu/run.sh bench --preset llama-1b --profile --steps 5 --warmup 2 > "$OUT/bench-1b.log" 2>&1) &
wait
grep -h "^test\|passed" "$OUT/kernels.log" | cut -c1-600
grep -m3 -A30 "panicked\|rror" "$OUT/kernels.log" | cut -c1-300 | head -80
grep -h 'RESULT\|PROFILE' "$OUT/bench-1b.log" | cut -c1-320
tail -n 5 "$OUT/bench-1b.log" | cut -c1-300
