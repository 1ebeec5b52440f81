#!/usr/bin/env bash
# Session 3, third call (nvidia-h200-x2, carry .gpu with bench): the wgmma GEMM reading MN-major
# operands in place (no transpose copies), both descriptor orders, checked and timed; then
# llama-1b with the linears on the variant whose checks all pass.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh bench --unpack-only >/dev/null 2>&1
(CUDA_VISIBLE_DEVICES=0 timeout 200 bash .gpu/run.sh bench --gemm --kernels Wgmma,WgmmaRegisterSplit > "$OUT/gemm-a.log" 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 200 bash .gpu/run.sh bench --gemm --kernels WgmmaSwapped > "$OUT/gemm-b.log" 2>&1) &
wait
cat "$OUT/gemm-a.log" "$OUT/gemm-b.log" > "$OUT/gemm.log"
kernel=SpecializedTmaMma
for k in WgmmaSwapped Wgmma; do
  checks=$(grep -c "CHECK.*\"$k\"" "$OUT/gemm.log"); good=$(grep "CHECK.*\"$k\"" "$OUT/gemm.log" | grep -cE '"rel_error": [0-9.]+e-3,')
  echo "$k: $good of $checks checks under 1e-2"
  [ "$checks" -gt 0 ] && [ "$good" = "$checks" ] && kernel=$k
done
echo "llama-1b linears on $kernel"
(CUDA_VISIBLE_DEVICES=0 timeout 300 bash .gpu/run.sh bench --preset llama-1b --profile --steps 5 --warmup 2 --linear-gemm $kernel > "$OUT/bench-1b.log" 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 300 bash .gpu/run.sh bench --preset llama-1b --steps 5 --warmup 2 --linear-gemm SpecializedTmaMma > "$OUT/bench-1b-cubek.log" 2>&1) &
wait
grep -h 'CHECK\|GEMM' "$OUT/gemm.log" | grep -v '"burn"' | sed 's/"out_norm.*//' | cut -c1-200
grep -h 'RESULT\|PROFILE\|panick' "$OUT/bench-1b.log" "$OUT/bench-1b-cubek.log" | cut -c1-320
tail -n 3 "$OUT/bench-1b.log" | cut -c1-300
