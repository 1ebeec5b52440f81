#!/usr/bin/env bash
# Session 5 (nvidia-h200-x2, carry .gpu with bench and gpu-suite, and .peers): the wgmma GEMM
# persistent (one block an SM running its tiles in turn) with grouped tile order, against a block
# a tile. GPU 0: the kernel suite, then bench --gemm on both schedules; GPU 1: cuBLAS. Then
# llama-1b with the linears on the persistent kernel (Wgmma, if its checks pass) on GPU 0 beside
# the eager and torch.compile peers on GPU 1.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
bash .gpu/run.sh bench --gemm --kernels NONE >/dev/null 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  timeout -s KILL 150 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite > "$OUT/suite.log" 2>&1
  timeout -s KILL 150 bash .gpu/run.sh bench --gemm --kernels Wgmma,WgmmaTilePerBlock > "$OUT/gemm.log" 2>&1
) &
(CUDA_VISIBLE_DEVICES=1 timeout -s KILL 60 python3 examples/bench/gemm_peer.py > "$OUT/gemm-cublas.log" 2>&1) &
wait
grep -h 'passed\|FAILED\|relative error' "$OUT/suite.log" | cut -c1-300
checks=$(grep -c 'CHECK.*"Wgmma"' "$OUT/gemm.log"); good=$(grep 'CHECK.*"Wgmma"' "$OUT/gemm.log" | grep -cE '"rel_error": [0-9.]+e-[3-9],')
echo "Wgmma: $good of $checks checks under 1e-2"
grep -h 'CHECK' "$OUT/gemm.log" | grep -v '"rel_error": [0-9.]*e-[3-9],' | cut -c1-200
grep -h '^GEMM' "$OUT/gemm.log" "$OUT/gemm-cublas.log" | grep -v '"burn"' | sed 's/"m": [0-9]*, "k": [0-9]*, "n": [0-9]*, //' | cut -c1-140
if [ "$checks" -gt 0 ] && [ "$good" = "$checks" ] && grep -q "7 passed" "$OUT/suite.log"; then
  (CUDA_VISIBLE_DEVICES=0 timeout -s KILL 100 bash .gpu/run.sh bench --preset llama-1b --profile --steps 10 --warmup 3 > "$OUT/bench-1b.log" 2>&1) &
  (cd .peers && CUDA_VISIBLE_DEVICES=1 PEER_TIMEOUT=140 timeout -s KILL 145 bash run_peers.sh llama-1b torch compile > "$OUT/peers-1b.log" 2>&1) &
  wait
  grep -h 'RESULT\|PROFILE\|panicked' "$OUT/bench-1b.log" "$OUT/peers-1b.log" | cut -c1-320
fi
