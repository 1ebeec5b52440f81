#!/usr/bin/env bash
# Session 23, one H200 (carry .gpu with gpu-suite and bench, .peers (../shared/peers) and .whl
# with torchao 0.18's wheel).
#   fp8:  the kernel tests of what changed (the one-launch amax, the casts that transpose in
#         registers, both tilings in registers, the cross-entropy's row max; every recipe's
#         product over them), then llama-1b under FP8 tensorwise beside torchao float8
#         tensorwise + compile, ours before and after the peer, and with `--profile` if time is left:
#         fp32 master weights, random ids, 3 warm-up and 10 timed steps.
#   rows: the tests of the blockwise tilings (both from one read, staged through a swizzled
#         shared tile), then llama-1b under FP8 blockwise beside torchao rowwise + compile,
#         tensorwise beside torchao tensorwise, and bf16 beside PyTorch + compile if time is
#         left, as above.
# Logs go to $OUT/logs.tar.xz (a device call brings back a few files).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-fp8}
rowwise() {  # the torchao rowwise peer, its memory sampled
  sample peer-rowwise; local smi=$!
  (cd .peers && timeout -s KILL 150 python3 peer_fp8.py --preset llama-1b --recipe rowwise > "$OUT/peers-rowwise.log" 2>&1)
  kill $smi; grep -h RESULT "$OUT/peers-rowwise.log" | cut -c1-400; echo "peer rowwise peak MiB: $(peak peer-rowwise)"
}
case $part in
  fp8)
    for test in ${TESTS:-fp8_ quantized_linear shared_input weight_codes emulated_blocks cross_entropy}; do
      timeout -s KILL 120 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::$test" > "$OUT/suite-$test.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$test.log" | cut -c1-600
    done
    torchao
    run 1b-fp8-tensorwise 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
    peers 1b-torchao 150 llama-1b fp8
    run 1b-fp8-tensorwise-2 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
    [ $SECONDS -lt 480 ] && run 1b-fp8-tensorwise-profile 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise --profile
    ;;
  rows)
    for test in ${TESTS:-fp8_blocks quantized_linear}; do
      timeout -s KILL 120 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::$test" > "$OUT/suite-$test.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$test.log" | cut -c1-600
    done
    torchao
    run 1b-fp8-blockwise 120 --preset llama-1b --steps 10 --warmup 3 --precision fp8-blockwise
    rowwise
    run 1b-fp8-tensorwise 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
    peers 1b-torchao 150 llama-1b fp8
    [ $SECONDS -lt 380 ] && run 1b-bf16 90 --preset llama-1b --steps 10 --warmup 3
    [ $SECONDS -lt 420 ] && peers 1b-compile 150 llama-1b compile
    ;;
  curves)
    # (carry .gpu with train and bench, and shakespeare.txt.xz: xz of the file
    # scripts/fetch-shakespeare.sh fetches) llama-1b trained 300 steps on the plays under each of
    # RECIPES (default bf16, FP8 tensorwise and blockwise) from each of SEEDS' initializations
    # (default 4 5 6: s18.sh and s19.sh ran 1 2 3; the batches are the same for every seed), as
    # s18.sh curves (EXTRA: more train flags, TAG: their name in the logs); then (unless
    # PROFILES=0) FP8 delayed scaling and tensorwise with
    # `--profile` if time is left.
    mkdir -p data && xz -dc .gpu/shakespeare.txt.xz > data/shakespeare.txt
    for seed in ${SEEDS:-4 5 6}; do
      for precision in ${RECIPES:-default fp8-tensorwise fp8-blockwise}; do
        [ $SECONDS -gt 450 ] && { echo "no time left for $precision seed $seed"; continue; }
        log="$OUT/train-$precision${TAG:-}-seed$seed.log"
        timeout -s KILL 100 bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
          --init per-shard --precision "$precision" --data data/shakespeare.txt --steps 300 --batch 1 \
          --lr 3e-4 --sample-every 0 --seed "$seed" ${EXTRA:-} > "$log" 2>&1
        echo "$precision${TAG:-} seed $seed: $(grep -c '^step' "$log") steps, last 20 mean $(grep '^step' "$log" | tail -n 20 \
          | awk '{for (i = 1; i < NF; i++) if ($i == "loss") s += $(i + 1)} END {printf "%.4f", s / NR}'); $(tail -n 2 "$log" | head -n 1 | cut -c1-80)"
      done
    done
    [ "${PROFILES:-1}" = 1 ] || exit_profiles=1
    [ -z "${exit_profiles:-}" ] && [ $SECONDS -lt 470 ] && run 1b-fp8-delayed 60 --preset llama-1b --steps 10 --warmup 3 --precision fp8-delayed --profile
    [ -z "${exit_profiles:-}" ] && [ $SECONDS -lt 530 ] && run 1b-fp8-tensorwise 60 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise --profile
    ;;
esac
(cd "$OUT" && tar cJf logs.tar.xz --remove-files -- $(ls *.log *.csv 2>/dev/null))
