#!/usr/bin/env bash
# Session 18, one H200.
#   suite:  (carry .gpu with gpu-suite) the kernel tests named in TESTS (default: the emulated
#           recipes' block kernel and every recipe's product), then the suites never run on CUDA
#           before, ranks as threads on the one GPU (`--one-gpu --world 2`): pipeline stages
#           (plain, MoE, tied) and recomputation against one rank, and the Hugging Face fixtures
#           (the tied llama3 among them) against transformers, trained, resharded and exported.
#   rows:   (carry .gpu with bench) llama-1b under bf16, MXFP8 and NVFP4 (their blocks quantized
#           by one kernel reading transposed views in place, NVFP4's Hadamard transform in it,
#           multiplied in bf16), fp32 master weights, random ids, 3 warm-up and 10 timed steps.
#   delayed: (carry .gpu with bench) llama-1b under FP8 delayed scaling and tensorwise with
#           `--profile` (where a step's time goes, the host's issue time among it).
#   ncu:    (carry .gpu with bench) one steady step's kernels under each of RECIPES (default:
#           mxfp8 nvfp4), as s16.sh ncu.
#   curves: (carry .gpu with train, data/ from scripts/fetch-shakespeare.sh) llama-1b trained
#           300 steps on the plays under each of RECIPES (default: bf16, mxfp8, fp8-delayed) from
#           each of SEEDS' initializations (default 1 2 3; the batches are the same for every
#           seed), as s8-curves.sh: bf16 compute, fp32 master weights, lr 3e-4, batch 1 × 2048.
#           Prints each run's mean loss over its last 20 steps.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-rows}
case $part in
  suite)
    for test in ${TESTS:-emulated_blocks quantized_linear}; do
      timeout -s KILL 120 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::$test" > "$OUT/suite-$test.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$test.log" | cut -c1-600
    done
    for suite in ${SUITES:-pipeline_suite recompute_suite hf_suite}; do
      timeout -s KILL 200 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "$suite::" > "$OUT/one-gpu-$suite.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/one-gpu-$suite.log" | cut -c1-600
    done
    ;;
  rows)
    run 1b-bf16 90 --preset llama-1b --steps 10 --warmup 3
    run 1b-mxfp8 150 --preset llama-1b --steps 10 --warmup 3 --precision mxfp8
    run 1b-nvfp4 150 --preset llama-1b --steps 10 --warmup 3 --precision nvfp4
    ;;
  delayed)
    run 1b-fp8-delayed 150 --preset llama-1b --steps 10 --warmup 3 --precision fp8-delayed --profile
    run 1b-fp8-tensorwise 150 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise --profile
    ;;
  curves)
    for seed in ${SEEDS:-1 2 3}; do
      for precision in ${RECIPES:-default mxfp8 fp8-delayed}; do
        log="$OUT/train-$precision-seed$seed.log"
        timeout -s KILL 150 bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
          --init per-shard --precision "$precision" --data data/shakespeare.txt --steps 300 --batch 1 \
          --lr 3e-4 --sample-every 0 --seed "$seed" > "$log" 2>&1
        echo "$precision seed $seed: $(grep -c '^step' "$log") steps, last 20 mean $(grep '^step' "$log" | tail -n 20 \
          | awk '{for (i = 1; i < NF; i++) if ($i == "loss") s += $(i + 1)} END {printf "%.4f", s / NR}'); $(tail -n 1 "$log" | cut -c1-120)"
      done
    done
    ;;
  ncu)
    for recipe in ${RECIPES:-mxfp8 nvfp4}; do
      RECIPE=$recipe bash docs/perf/scripts/s16.sh ncu
    done
    ;;
esac
