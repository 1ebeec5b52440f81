#!/usr/bin/env bash
# Session 3, last call (nvidia-h200, carry .gpu with bench + gpu-suite): the kernel suite on the
# final code (now with the fused cross-entropy), then llama-1b on every fused kernel.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh bench --unpack-only >/dev/null 2>&1
bash .gpu/run.sh gpu-suite --unpack-only >/dev/null 2>&1
timeout 100 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite > "$OUT/kernels.log" 2>&1
timeout 120 bash .gpu/run.sh bench --preset llama-1b --profile --steps 10 --warmup 3 > "$OUT/bench-1b.log" 2>&1
grep -h "^test\|passed" "$OUT/kernels.log" | cut -c1-400
grep -h 'RESULT\|PROFILE\|panicked' "$OUT/bench-1b.log" | cut -c1-320
