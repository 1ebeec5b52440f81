#!/usr/bin/env bash
# Session 5, third call (nvidia-h200-x2, carry .gpu with bench): the clustered wgmma GEMM with
# CTA-scope remote arrivals (the second call's cluster-scope release made it slower than one
# block). GPU 0: Wgmma and WgmmaCluster2x1; GPU 1: the other two shapes; then cuBLAS.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh bench --gemm --kernels NONE >/dev/null 2>&1
(CUDA_VISIBLE_DEVICES=0 timeout -s KILL 150 bash .gpu/run.sh bench --gemm --kernels Wgmma,WgmmaCluster2x1 > "$OUT/gemm-a.log" 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout -s KILL 150 bash .gpu/run.sh bench --gemm --kernels WgmmaCluster1x2,WgmmaCluster2x2 > "$OUT/gemm-b.log" 2>&1; CUDA_VISIBLE_DEVICES=1 timeout -s KILL 60 python3 examples/bench/gemm_peer.py > "$OUT/gemm-cublas.log" 2>&1) &
wait
cat "$OUT/gemm-a.log" "$OUT/gemm-b.log" > "$OUT/gemm.log"
grep -h 'CHECK' "$OUT/gemm.log" | grep -v '"rel_error": [0-9.]*e-[3-9],' | cut -c1-200
echo "checks: $(grep -c CHECK "$OUT/gemm.log")"
grep -h '^GEMM' "$OUT/gemm.log" "$OUT/gemm-cublas.log" | grep -v '"burn"' | sed 's/"m": [0-9]*, "k": [0-9]*, "n": [0-9]*, //' | cut -c1-140
