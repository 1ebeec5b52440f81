#!/usr/bin/env bash
# Session 29, one GPU (an H100 when no H200 could be had):
#   rows: (carry .gpu with gpu-suite and bench, .peers and .whl) the kernel tests of RMSNorm's
#         backward in one kernel (dx and dw's partials from one read, the partials summed by a
#         column-sum kernel) and of AdamW adding each gradient's squares to the global norm as
#         it reads it (no pass of its own without clipping); then llama-1b under
#         fp8-tensorwise-promoted beside torchao float8 tensorwise + compile, and bf16 beside
#         PyTorch + compile, fp32 master weights, random ids, 3 warm-up and 10 timed steps.
#   ab:   (carry .gpu with bench and bench-old, the same code before these two changes) the
#         two builds alternating in one call on llama-1b, FP8 promoted and bf16, then each
#         once with `--profile`.
#   ticket: (carry .gpu with gpu-suite and bench) after the amax kernels and the AdamW master
#         kernel share one ticket helper (`last_block`): their kernel tests, and FP8 promoted
#         once more.
# Logs go to $OUT/logs.tar.xz.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-rows}
case $part in
  rows)
    suite rms_norm adamw_master sum_of_squares
    torchao
    run 1b-fp8-tensorwise-promoted 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise-promoted
    peers 1b-torchao 150 llama-1b fp8
    run 1b-bf16 90 --preset llama-1b --steps 10 --warmup 3
    peers 1b-compile 150 llama-1b compile
    [ $SECONDS -lt 480 ] && run 1b-fp8-tensorwise-promoted-2 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise-promoted
    [ $SECONDS -lt 520 ] && run 1b-bf16-2 70 --preset llama-1b --steps 10 --warmup 3
    ;;
  ab)
    fp8="--preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise-promoted"
    bf16="--preset llama-1b --steps 10 --warmup 3"
    for i in 1 2 3; do
      BENCH=bench run "fp8-new-$i" 70 $fp8
      BENCH=bench-old run "fp8-old-$i" 70 $fp8
    done
    for i in 1 2; do
      BENCH=bench run "bf16-new-$i" 70 $bf16
      BENCH=bench-old run "bf16-old-$i" 70 $bf16
    done
    [ $SECONDS -lt 450 ] && BENCH=bench run fp8-new-profile 70 $fp8 --profile
    [ $SECONDS -lt 510 ] && BENCH=bench-old run fp8-old-profile 70 $fp8 --profile
    ;;
  ticket)
    suite fp8_amax emulated_blocks adamw_master quantized_linear
    run 1b-fp8-tensorwise-promoted 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise-promoted
    ;;
esac
(cd "$OUT" && tar cJf logs.tar.xz --remove-files -- $(ls *.log *.csv 2>/dev/null))
