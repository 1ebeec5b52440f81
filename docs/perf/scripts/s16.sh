#!/usr/bin/env bash
# Session 16, one H200 (carry .gpu with gpu-suite and bench, .peers (../shared/peers) and .whl
# with torchao 0.18's wheel): FP8 blockwise on FP8 codes (1×128 tiles, 128×128 weight blocks,
# the blockwise FP8 GEMM).
#   suite: the FP8 kernel tests (the block quantizers, the blockwise GEMM, every recipe's
#          product) and the GEMMs whose store changed (wgmma, grouped).
#   gemm:  the GEMMs on the llama shapes (`bench --gemm`): bf16, FP8 tensorwise, blockwise.
#   rows:  llama-1b FP8 blockwise and tensorwise beside torchao float8 + compile, rowwise and
#          tensorwise, in one call: fp32 master weights, random ids, 3 warm-up and 10 timed steps.
#   ncu:   every kernel of one steady llama-1b step under FP8 blockwise, summed by name.
#   curves: llama-1b trained 300 steps on the Shakespeare plays under FP8 blockwise on the FP8
#          kernels (carry .gpu with train and data/ from scripts/fetch-shakespeare.sh), as
#          s8-curves.sh ran every recipe: the same initialization and batches as its bf16 run.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-suite}
case $part in
  suite)
    for test in ${TESTS:-fp8_tiles fp8_blocks fp8_gemm fp8_blockwise_gemm quantized_linear shared_input wgmma_gemm grouped_gemm}; do
      timeout -s KILL 240 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::$test" > "$OUT/suite-$test.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$test.log" | cut -c1-600
    done
    ;;
  gemm)
    timeout -s KILL 200 bash .gpu/run.sh bench --gemm --kernels Wgmma > "$OUT/gemm.log" 2>&1
    grep -h '^GEMM' "$OUT/gemm.log" | grep -v burn | cut -c1-200
    ;;
  rows)
    torchao
    run 1b-fp8-blockwise 120 --preset llama-1b --steps 10 --warmup 3 --precision fp8-blockwise
    run 1b-fp8-tensorwise 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
    sample peer-rowwise; smi=$!
    (cd .peers && timeout -s KILL 150 python3 peer_fp8.py --preset llama-1b --recipe rowwise > "$OUT/peers-rowwise.log" 2>&1)
    kill $smi; grep -h RESULT "$OUT/peers-rowwise.log" | cut -c1-400; echo "peer rowwise peak MiB: $(peak peer-rowwise)"
    peers 1b-torchao 150 llama-1b fp8
    run 1b-fp8-blockwise-again 120 --preset llama-1b --steps 10 --warmup 3 --precision fp8-blockwise --profile
    ;;
  ncu)
    recipe=${RECIPE:-fp8-blockwise}
    timeout -s KILL 240 ncu --clock-control none --target-processes all --metrics gpu__time_duration.sum -c 16000 \
      bash .gpu/run.sh bench --preset llama-1b --precision $recipe --steps 1 --warmup 2 > "$OUT/ncu-$recipe.log" 2>&1
    grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$OUT/ncu-$recipe.log" | paste - - \
      | awk '{name=$1; sub(/_[0-9a-f]{8}$/,"",name); print name, $NF}' > "$OUT/ordered.txt"
    awk '/^ce_partials/ {n++} n == 2 {t[$1] += $2; c[$1]++} END {for (k in t) printf "%10.1f us %5d  %s\n", t[k], c[k], k}' \
      "$OUT/ordered.txt" | sort -rn > "$OUT/steady-$recipe.txt"
    echo "== $recipe steady step: $(awk '{s+=$3} END {print s}' "$OUT/steady-$recipe.txt") kernels, $(awk '{s+=$1} END {print s/1000}' "$OUT/steady-$recipe.txt") ms of GPU time"
    head -30 "$OUT/steady-$recipe.txt"; rm -f "$OUT/ncu-$recipe.log" "$OUT/ordered.txt"
    ;;
  curves)
    for precision in ${RECIPES:-fp8-blockwise}; do
      timeout -s KILL 150 bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
        --init per-shard --precision "$precision" --data data/shakespeare.txt --steps 300 --batch 1 \
        --lr 3e-4 --sample-every 0 > "$OUT/train-$precision.log" 2>&1
      echo "$precision: $(grep -c '^step' "$OUT/train-$precision.log") steps; $(tail -n 3 "$OUT/train-$precision.log" | tr '\n' ' ' | cut -c1-300)"
    done
    ;;
esac
