#!/usr/bin/env bash
# Session 17, one H200.
#   suite:  (carry .gpu with gpu-suite) the kernel tests named in TESTS (default: the emulated
#           recipes' block kernel and every recipe's product).
#   decode: (carry .gpu with generate and gpu-suite) the decoding kernels' tests, then decoding
#           beside transformers and ncu at batch 32 (`generate-graph.sh suite peers ncu`): the
#           few-row product on tensor cores (`skinny.rs`).
#   rows:   (carry .gpu with bench and train, data/ from scripts/fetch-shakespeare.sh) llama-1b
#           under bf16, MXFP8 and NVFP4 (their blocks quantized by one kernel, multiplied in bf16),
#           fp32 master weights, random ids, 3 warm-up and 10 timed steps, in one call.
#   curves: llama-1b 300 steps on the plays under each of RECIPES (default: mxfp8 nvfp4 and
#           bf16), as s8-curves.sh: the same initialization and batches.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-decode}
case $part in
  suite)
    for test in ${TESTS:-emulated_blocks quantized_linear}; do
      timeout -s KILL 240 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::$test" > "$OUT/suite-$test.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$test.log" | cut -c1-600
    done
    ;;
  decode)
    bash docs/perf/scripts/generate-graph.sh suite peers ncu
    ;;
  rows)
    run 1b-bf16 90 --preset llama-1b --steps 10 --warmup 3
    run 1b-mxfp8 150 --preset llama-1b --steps 10 --warmup 3 --precision mxfp8
    run 1b-nvfp4 150 --preset llama-1b --steps 10 --warmup 3 --precision nvfp4
    ;;
  curves)
    for precision in ${RECIPES:-mxfp8 nvfp4 default}; do
      timeout -s KILL 150 bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
        --init per-shard --precision "$precision" --data data/shakespeare.txt --steps 300 --batch 1 \
        --lr 3e-4 --sample-every 0 > "$OUT/train-$precision.log" 2>&1
      echo "$precision: $(grep -c '^step' "$OUT/train-$precision.log") steps; $(tail -n 3 "$OUT/train-$precision.log" | tr '\n' ' ' | cut -c1-300)"
    done
    ;;
esac
