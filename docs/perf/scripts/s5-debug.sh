#!/usr/bin/env bash
# Session 5 (nvidia-h200-x2, carry .gpu with bench): the TMA-store epilogue's first build wrote
# no usable output (relative error inf). CubeCL's generated source for the GEMM kernel, and the
# first checks under compute-sanitizer.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh bench --gemm --kernels NONE >/dev/null 2>&1
CUBECL_DEBUG_LOG="$OUT/cubecl-full.log" timeout -s KILL 60 bash .gpu/run.sh bench --gemm --kernels WgmmaTilePerBlock > "$OUT/gemm.log" 2>&1
python3 - "$OUT/cubecl-full.log" "$OUT/gemm-src.log" <<'PY'
import sys
s = open(sys.argv[1], errors="replace").read()
i = s.find("name: burn_megatron_kernels::wgmma::gemm_kernel")
j = s.find("[END_KERNEL_COMPILATION]", i)
open(sys.argv[2], "w").write(s[i:j])
PY
rm -f "$OUT/cubecl-full.log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
echo "sanitizer: $san"
[ -n "$san" ] && CUDA_VISIBLE_DEVICES=1 timeout -s KILL 90 "$san" --print-limit 4 .gpu/.bin/bench --gemm --kernels WgmmaTilePerBlock > "$OUT/sanitizer.log" 2>&1
grep -v "^GEMM" "$OUT/sanitizer.log" | head -40 | cut -c1-250
grep CHECK "$OUT/gemm.log" | head -3 | cut -c1-200
