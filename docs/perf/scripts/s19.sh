#!/usr/bin/env bash
# Session 19, one H200.
#   moe:    (carry .gpu with gpu-suite and bench, .peers) the row kernels and the router's top k
#           on CUDA against Burn's ops and the CPU, the MoE suite on the one GPU as two ranks,
#           `bench --moe-breakdown`, then moe-4b beside PyTorch + torch._grouped_mm +
#           torch.compile in the same call (the peers' recipe: bf16 compute, fp32 master
#           weights, random ids, 3 warm-up and 10 timed steps), and ours again with
#           `--profile`.
#   curves: (carry .gpu with gpu-suite, train and shakespeare.txt.xz, xz of the file
#           scripts/fetch-shakespeare.sh fetches) the router's top k on CUDA against the CPU
#           again and the MoE steps at ep 2 against ep 1, then s18.sh's curves for the recipes it had not run over three
#           initializations: RECIPES default fp8-tensorwise, fp8-blockwise and nvfp4, SEEDS 1 2 3
#           (bf16's are in logs/s18/curves), the seeds outermost; no run starts after 470 s.
# Calls 3 and 4 (logs/s19/call3, call4) ran the MoE steps on a probe build, not committed, whose
# rows ops took Burn's tensor ops when DEBUG_ROWS_REFERENCE (all of them) or DEBUG_REF_GATHER,
# _GATHER_BACK, _COMBINE, _COMBINE_BACK (one each) was set, and which printed each step's losses.
# Logs go to $OUT/logs.tar.xz (a device call brings back a few files).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-moe}
case $part in
  moe)
    for test in ${TESTS:-row_kernels router_top_k}; do
      timeout -s KILL 120 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::$test" > "$OUT/suite-$test.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$test.log" | cut -c1-600
    done
    timeout -s KILL 200 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::" > "$OUT/one-gpu-moe_suite.log" 2>&1
    grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/one-gpu-moe_suite.log" | cut -c1-600
    timeout -s KILL 90 bash .gpu/run.sh bench --moe-breakdown > "$OUT/moe-breakdown.log" 2>&1
    grep -h "MOE\|panicked" "$OUT/moe-breakdown.log"
    run moe4b 150 --preset moe-4b --steps 10 --warmup 3
    peers moe4b-torch 200 moe-4b moe
    run moe4b-profile 150 --preset moe-4b --steps 10 --warmup 3 --profile
    ;;
  curves)
    timeout -s KILL 60 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::router_top_k" > "$OUT/suite-router_top_k.log" 2>&1
    grep -h "FAILED\|passed\|ok (" "$OUT/suite-router_top_k.log" | cut -c1-300
    timeout -s KILL 60 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::moe_steps_match" > "$OUT/moe-steps.log" 2>&1
    grep -h "FAILED\|passed\|ok (" "$OUT/moe-steps.log" | cut -c1-300
    mkdir -p data && xz -dc .gpu/shakespeare.txt.xz > data/shakespeare.txt
    for seed in ${SEEDS:-1 2 3}; do
      for precision in ${RECIPES:-fp8-tensorwise fp8-blockwise nvfp4}; do
        [ $SECONDS -gt 470 ] && { echo "no time left for $precision seed $seed"; continue; }
        log="$OUT/train-$precision-seed$seed.log"
        timeout -s KILL 100 bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
          --init per-shard --precision "$precision" --data data/shakespeare.txt --steps 300 --batch 1 \
          --lr 3e-4 --sample-every 0 --seed "$seed" > "$log" 2>&1
        echo "$precision seed $seed: $(grep -c '^step' "$log") steps, last 20 mean $(grep '^step' "$log" | tail -n 20 \
          | awk '{for (i = 1; i < NF; i++) if ($i == "loss") s += $(i + 1)} END {printf "%.4f", s / NR}'); $(tail -n 2 "$log" | head -n 1 | cut -c1-80)"
      done
    done
    ;;
esac
(cd "$OUT" && tar cJf logs.tar.xz --remove-files -- *.log *.csv 2>/dev/null)
