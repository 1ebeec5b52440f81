#!/usr/bin/env bash
# Session 3, first device call on nvidia-h200-x2 (carry .gpu with bench, and .peers):
#   GPU 0: the wgmma GEMM checked on ragged shapes and timed on the llama shapes (with the CUDA
#   source and PTX CubeCL made for it), then llama-1b with the linears on it if every check passed;
#   GPU 1: cuBLAS on the same shapes, then the PyTorch eager and torch.compile peers.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh bench --unpack-only >/dev/null 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  CUBECL_DEBUG_LOG=$OUT/cubecl-wgmma.log CUBECL_CUDA_DUMP_PTX=$OUT/ptx \
    timeout 150 bash .gpu/run.sh bench --gemm --kernels Wgmma > "$OUT/gemm-wgmma.log" 2>&1
  timeout 120 bash .gpu/run.sh bench --gemm --kernels WgmmaRegisterSplit,SpecializedTmaMma > "$OUT/gemm-other.log" 2>&1
  kernel=SpecializedTmaMma
  for k in Wgmma WgmmaRegisterSplit; do
    log=$OUT/gemm-wgmma.log; [ $k = Wgmma ] || log=$OUT/gemm-other.log
    checks=$(grep -c "CHECK.*\"$k\"" "$log"); good=$(grep "CHECK.*\"$k\"" "$log" | grep -cE '"rel_error": [0-9.]+e-[3-9]}')
    echo "$k: $good of $checks checks under 1e-2"
    [ "$checks" -gt 0 ] && [ "$good" = "$checks" ] && kernel=$k
  done
  echo "llama-1b linears on $kernel"
  timeout 300 bash .gpu/run.sh bench --preset llama-1b --profile --steps 5 --warmup 2 --linear-gemm $kernel > "$OUT/bench-1b.log" 2>&1
) > "$OUT/gpu0.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  python3 examples/bench/gemm_peer.py > "$OUT/gemm-cublas.log" 2>&1
  cd .peers && PEER_TIMEOUT=240 bash run_peers.sh llama-1b torch compile > "$OUT/peers.log" 2>&1
) &
wait
cat "$OUT/gpu0.log"
grep -h 'CHECK\|GEMM' "$OUT/gemm-wgmma.log" "$OUT/gemm-other.log" "$OUT/gemm-cublas.log" | cut -c1-220
grep -h 'RESULT\|PROFILE\|panick\|rror' "$OUT/bench-1b.log" "$OUT/peers.log" | cut -c1-320
tail -n 3 "$OUT/gemm-wgmma.log" "$OUT/bench-1b.log" | cut -c1-300
ls "$OUT/ptx" 2>/dev/null | wc -l; du -sh "$OUT"/* | sort -h | tail -4
