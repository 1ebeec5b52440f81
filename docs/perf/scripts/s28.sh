#!/usr/bin/env bash
# Session 28, one H200: the promoted FP8 GEMM (`Accumulation::Promoted`: 128 × 256 tiles, each
# 128-deep slice's halves multiplied into a fresh accumulator and added into f32, registers
# moved from the producer by `setmaxnreg`).
#   gemm: (carry .gpu with gpu-suite and bench, .peers and .whl) the FP8 GEMM's kernel test, fast
#         and promoted, and every recipe's product (`quantized_linear`), with the PTX dumped
#         and Triton's ptxas reporting registers and spills;
#         `bench --gemm --kernels Wgmma` (`Fp8Wgmma` beside `Fp8WgmmaPromoted` and the blockwise
#         kernels); then llama-1b under fp8-tensorwise-promoted and fp8-tensorwise beside
#         torchao float8 tensorwise + compile (whose gradient products promote too).
#   curves: (carry .gpu with train and shakespeare.txt.xz) our llama-1b on the plays under
#         fp8-tensorwise-promoted from each of SEEDS (default 1–6), as `s23.sh curves` trained
#         the others; then bench rows where bench was carried too.
# Logs go to $OUT/logs.tar.xz.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-gemm}
case $part in
  gemm)
    CUBECL_CUDA_DUMP_PTX=/tmp/ptx suite fp8_gemm quantized_linear
    grep -h "relative error" "$OUT/suite-fp8_gemm.log" | cut -c1-300
    ptxreport /tmp/ptx
    timeout -s KILL 200 bash .gpu/run.sh bench --gemm --kernels Wgmma > "$OUT/bench-gemm.log" 2>&1
    grep -h 'Fp8\|CHECK.*rror\|panicked' "$OUT/bench-gemm.log" | cut -c1-250
    torchao
    run 1b-fp8-tensorwise-promoted 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise-promoted
    run 1b-fp8-tensorwise 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
    peers 1b-torchao 150 llama-1b fp8
    [ $SECONDS -lt 500 ] && run 1b-fp8-tensorwise-promoted-2 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise-promoted
    ;;
  curves)
    mkdir -p data && xz -dc .gpu/shakespeare.txt.xz > data/shakespeare.txt
    for seed in ${SEEDS:-1 2 3 4 5 6}; do
      [ $SECONDS -gt 470 ] && { echo "no time left for seed $seed"; continue; }
      log="$OUT/train-fp8-tensorwise-promoted-seed$seed.log"
      timeout -s KILL 100 bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
        --init per-shard --precision fp8-tensorwise-promoted --data data/shakespeare.txt --steps 300 --batch 1 \
        --lr 3e-4 --sample-every 0 --seed "$seed" > "$log" 2>&1
      echo "fp8-tensorwise-promoted seed $seed: $(grep -c '^step' "$log") steps, last 20 mean $(grep '^step' "$log" | tail -n 20 \
        | awk '{for (i = 1; i < NF; i++) if ($i == "loss") s += $(i + 1)} END {printf "%.4f", s / NR}')"
    done
    [ -f .gpu/bench.xz ] && [ $SECONDS -lt 520 ] && run 1b-fp8-tensorwise-promoted 60 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise-promoted
    ;;
esac
(cd "$OUT" && tar cJf logs.tar.xz --remove-files -- $(ls *.log *.csv 2>/dev/null))
