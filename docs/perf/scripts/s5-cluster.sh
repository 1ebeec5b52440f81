#!/usr/bin/env bash
# Session 5, second call (nvidia-h200-x2, carry .gpu with bench and gpu-suite, and .peers): the
# wgmma GEMM in clusters that multicast their shared operand. GPU 0: the kernel suite (every
# cluster shape against Burn's product), then bench --gemm on Wgmma and WgmmaCluster2x1; GPU 1:
# the two other cluster shapes, then cuBLAS. Then llama-1b with the linears on WgmmaCluster2x1
# (if its checks pass) on GPU 0 beside the torch.compile peer on GPU 1.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
bash .gpu/run.sh bench --gemm --kernels NONE >/dev/null 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  timeout -s KILL 150 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite > "$OUT/suite.log" 2>&1
  timeout -s KILL 150 bash .gpu/run.sh bench --gemm --kernels Wgmma,WgmmaCluster2x1 > "$OUT/gemm-a.log" 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout -s KILL 150 bash .gpu/run.sh bench --gemm --kernels WgmmaCluster1x2,WgmmaCluster2x2 > "$OUT/gemm-b.log" 2>&1
  timeout -s KILL 60 python3 examples/bench/gemm_peer.py > "$OUT/gemm-cublas.log" 2>&1
) &
wait
cat "$OUT/gemm-a.log" "$OUT/gemm-b.log" > "$OUT/gemm.log"
grep -h 'passed\|FAILED\|panicked\|relative error' "$OUT/suite.log" | cut -c1-300
if grep -q poisoned "$OUT/gemm.log"; then
  # The first failing shape again, with CubeCL's generated source logged and under memcheck.
  export CUDA_VISIBLE_DEVICES=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
  CUBECL_DEBUG_LOG="$OUT/cubecl.log" timeout -s KILL 60 .gpu/.bin/bench --gemm --kernels WgmmaCluster2x1 > "$OUT/debug.log" 2>&1
  san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  [ -n "$san" ] && timeout -s KILL 120 "$san" --print-limit 5 .gpu/.bin/bench --gemm --kernels WgmmaCluster2x1 > "$OUT/sanitizer.log" 2>&1
  grep -v "^CHECK\|^GEMM" "$OUT/sanitizer.log" | head -60 | cut -c1-250
  python3 - "$OUT/cubecl.log" <<'PY'
import sys
s = open(sys.argv[1], errors="replace").read()
i = s.find("gemm_kernel")
open(sys.argv[1], "w").write(s[max(0, i - 2000): i + 60000] if i >= 0 else s[:60000])
PY
fi
checks=$(grep -c 'CHECK.*"WgmmaCluster2x1"' "$OUT/gemm.log"); good=$(grep 'CHECK.*"WgmmaCluster2x1"' "$OUT/gemm.log" | grep -cE '"rel_error": [0-9.]+e-[3-9],')
echo "WgmmaCluster2x1: $good of $checks checks under 1e-2"
grep -h 'CHECK' "$OUT/gemm.log" | grep -v '"rel_error": [0-9.]*e-[3-9],' | cut -c1-200
grep -h '^GEMM' "$OUT/gemm.log" "$OUT/gemm-cublas.log" | grep -v '"burn"' | sed 's/"m": [0-9]*, "k": [0-9]*, "n": [0-9]*, //' | cut -c1-140
if [ "$checks" -gt 0 ] && [ "$good" = "$checks" ]; then
  (CUDA_VISIBLE_DEVICES=0 timeout -s KILL 100 bash .gpu/run.sh bench --preset llama-1b --profile --steps 10 --warmup 3 --linear-gemm WgmmaCluster2x1 > "$OUT/bench-1b.log" 2>&1) &
  (cd .peers && CUDA_VISIBLE_DEVICES=1 PEER_TIMEOUT=140 timeout -s KILL 145 bash run_peers.sh llama-1b torch compile > "$OUT/peers-1b.log" 2>&1) &
  wait
  grep -h 'RESULT\|PROFILE\|panicked' "$OUT/bench-1b.log" "$OUT/peers-1b.log" | cut -c1-320
fi
