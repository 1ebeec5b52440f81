#!/usr/bin/env bash
# Session 5, first call (nvidia-h200-x2, carry .gpu with bench and gpu-suite, and .peers):
# GemmKernel::WgmmaInFlight's first GPU run. GPU 0: the kernel suite (both wgmma loops against
# Burn's product), then bench --gemm on both loops, then llama-1b with the linears on
# WgmmaInFlight if every check passed. GPU 1 meanwhile: cuBLAS on the same shapes, the
# torch.compile peer, then llama-1b on Wgmma as the control. Every step has a hard limit.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  timeout -s KILL 120 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite > "$OUT/suite.log" 2>&1
  timeout -s KILL 200 bash .gpu/run.sh bench --gemm --kernels Wgmma,WgmmaInFlight > "$OUT/gemm.log" 2>&1
  checks=$(grep -c 'CHECK.*"WgmmaInFlight"' "$OUT/gemm.log"); good=$(grep 'CHECK.*"WgmmaInFlight"' "$OUT/gemm.log" | grep -cE '"rel_error": [0-9.]+e-[3-9],')
  echo "WgmmaInFlight: $good of $checks checks under 1e-2" > "$OUT/verdict.log"
  if [ "$checks" -gt 0 ] && [ "$good" = "$checks" ]; then
    timeout -s KILL 100 bash .gpu/run.sh bench --preset llama-1b --profile --steps 10 --warmup 3 --linear-gemm WgmmaInFlight > "$OUT/bench-1b-inflight.log" 2>&1
  fi
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout -s KILL 60 python3 examples/bench/gemm_peer.py > "$OUT/gemm-cublas.log" 2>&1
  (cd .peers && PEER_TIMEOUT=140 timeout -s KILL 145 bash run_peers.sh llama-1b torch compile > "$OUT/peers-1b.log" 2>&1)
  timeout -s KILL 100 bash .gpu/run.sh bench --preset llama-1b --profile --steps 10 --warmup 3 > "$OUT/bench-1b-wgmma.log" 2>&1
) &
wait
grep -h 'passed\|FAILED\|panicked' "$OUT/suite.log" | cut -c1-300
cat "$OUT/verdict.log"
grep -h 'CHECK' "$OUT/gemm.log" | grep -v '"rel_error": [0-9.]*e-[3-9],' | cut -c1-200
grep -h '^GEMM' "$OUT/gemm.log" "$OUT/gemm-cublas.log" | sed 's/"m": [0-9]*, "k": [0-9]*, "n": [0-9]*, //' | cut -c1-140
grep -h 'RESULT\|PROFILE\|panicked' "$OUT"/bench-1b-*.log "$OUT/peers-1b.log" | cut -c1-320
