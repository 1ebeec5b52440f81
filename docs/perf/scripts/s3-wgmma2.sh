#!/usr/bin/env bash
# Session 3, second call (nvidia-h200-x2, carry .gpu with bench): the wgmma GEMM, both register
# variants at once on the two GPUs, checked and timed, with CubeCL's CUDA source of each.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh bench --unpack-only >/dev/null 2>&1
i=0
for k in Wgmma WgmmaRegisterSplit; do
  (CUDA_VISIBLE_DEVICES=$i CUBECL_DEBUG_LOG=$OUT/cubecl-$k.log timeout 200 bash .gpu/run.sh bench --gemm --kernels $k > "$OUT/gemm-$k.log" 2>&1) &
  i=$((i + 1))
done
wait
for k in Wgmma WgmmaRegisterSplit; do
  grep -h 'CHECK\|GEMM' "$OUT/gemm-$k.log" | cut -c1-260
  grep -m2 -A8 'panicked at' "$OUT/gemm-$k.log" | cut -c1-300
done
# Keep only our kernel's source from the logs.
for k in Wgmma WgmmaRegisterSplit; do
  python3 - "$OUT/cubecl-$k.log" "$OUT/src-$k.cu" <<'PY'
import sys
s = open(sys.argv[1], errors="replace").read()
i = s.find("gemm_kernel")
if i >= 0:
    start = s.rfind("typedef unsigned int uint32_t", 0, i)
    open(sys.argv[2], "w").write(s[max(start, 0):i + 400000])
PY
  rm -f "$OUT/cubecl-$k.log"
done
ls -la "$OUT"
