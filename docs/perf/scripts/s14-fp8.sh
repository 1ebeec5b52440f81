#!/usr/bin/env bash
# Session 14, one H200 (carry .gpu with gpu-suite and bench, .peers (../shared/peers) and .whl
# with torchao 0.18's wheel): FP8 tensorwise with each tensor quantized once and FP8 codes kept
# for backward.
#   suite: the quantized-product kernel tests, the FP8 model tests at tp = 2 (two ranks on the
#          one GPU), then the delayed and tensorwise recipes with the step profiled.
#   ncu:   every kernel of one llama-1b step (no warm-up) under FP8 tensorwise and delayed,
#          timed by ncu and summed by name, with the kernel counts.
#   rows:  llama-1b bf16 and FP8 tensorwise beside PyTorch + compile (bf16) and torchao float8 +
#          compile in the same call: fp32 master weights, random ids, 3 warm-up and 10 timed steps.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-suite}
case $part in
  suite)
    timeout -s KILL 200 bash .gpu/run.sh gpu-suite --world 1 --filter quant > "$OUT/suite-quant.log" 2>&1
    timeout -s KILL 150 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter fp8 > "$OUT/suite-fp8.log" 2>&1
    grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-quant.log" "$OUT/suite-fp8.log" | cut -c1-400
    run 1b-fp8-delayed 100 --preset llama-1b --steps 10 --warmup 3 --profile --precision fp8-delayed
    run 1b-fp8-tensorwise 90 --preset llama-1b --steps 10 --warmup 3 --profile --precision fp8-tensorwise
    ;;
  ncu)
    for recipe in ${RECIPES:-fp8-tensorwise fp8-delayed}; do
      timeout -s KILL 200 ncu --clock-control none --target-processes all --metrics gpu__time_duration.sum -c 9000 \
        bash .gpu/run.sh bench --preset llama-1b --steps 1 --warmup 0 --precision $recipe > "$OUT/ncu-$recipe.log" 2>&1
      grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$OUT/ncu-$recipe.log" | paste - - \
        | awk '{name=$1; sub(/_[0-9a-f]{8}$/,"",name); t[name]+=$NF; c[name]++} END {for (n in t) printf "%10.1f us %5d  %s\n", t[n], c[n], n}' \
        | sort -rn > "$OUT/ncu-$recipe.txt"
      echo "== $recipe: $(grep -c gpu__time "$OUT/ncu-$recipe.log") kernels, $(awk '{s+=$1} END {print s/1000}' "$OUT/ncu-$recipe.txt") ms"
      head -40 "$OUT/ncu-$recipe.txt"; rm -f "$OUT/ncu-$recipe.log"
    done
    ;;
  rows)
    python3 -m pip install --quiet --no-deps --target /tmp/torchao .whl/torchao-0.18.0-*.whl
    export PYTHONPATH=/tmp/torchao
    run 1b-bf16 90 --preset llama-1b --steps 10 --warmup 3
    run 1b-fp8-tensorwise 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
    peers 1b-torchao 150 llama-1b fp8
    peers 1b-compile 150 llama-1b compile
    ;;
esac
