#!/usr/bin/env bash
# Session 30, one GPU:
#   notes: (carry .gpu with gpu-suite and bench, .peers and .whl) the kernel tests of SwiGLU's
#          kernels noting the amaxes of what they write (and the tests they touch), then
#          llama-1b under fp8-tensorwise-promoted beside torchao float8 tensorwise + compile
#          (bf16 compute, fp32 master weights, random ids, 3 warm-up and 10 timed steps), ours
#          twice, and bf16 once.
#   check: (carry .gpu with gpu-suite and bench) the notes' kernel test, then ncu on one steady
#          FP8-promoted step (`s15.sh steady`): the amax launches a step, and every kernel's time;
#          with ROWS=1 then FP8 promoted beside torchao, ours twice.
#   final: (carry .gpu with gpu-suite and bench, .peers and .whl) the kernel tests of the notes
#          (SwiGLU, RMSNorm's output and RoPE's input gradient) and of the kernels they changed,
#          ncu on one steady FP8-promoted step, FP8 promoted beside torchao (ours twice), bf16.
#   rows:  (carry .gpu with bench, .peers and .whl) FP8 promoted beside torchao again, ours twice.
#   suites: (carry .gpu with gpu-suite) the model suite on one GPU (ranks as threads: FP8 at tp 2,
#          delayed scaling) and the quantized products' kernel tests, on the final build.
# Logs go to $OUT/logs.tar.xz.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-notes}
fp8="--preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise-promoted"
case $part in
  notes)
    suite amax_notes swiglu quantized_linear shared_input fp8_amax
    torchao
    run 1b-fp8-tensorwise-promoted 90 $fp8
    peers 1b-torchao 150 llama-1b fp8
    run 1b-fp8-tensorwise-promoted-2 90 $fp8
    [ $SECONDS -lt 500 ] && run 1b-bf16 70 --preset llama-1b --steps 10 --warmup 3
    ;;
  check)
    suite amax_notes fp8_amax
    RECIPES=fp8-tensorwise-promoted bash docs/perf/scripts/s15.sh steady
    if [ "${ROWS:-0}" = 1 ]; then
      torchao
      run 1b-fp8-tensorwise-promoted 90 $fp8
      peers 1b-torchao 150 llama-1b fp8
      [ $SECONDS -lt 500 ] && run 1b-fp8-tensorwise-promoted-2 90 $fp8
    fi
    ;;
  final)
    suite amax_notes fp8_amax swiglu rms_norm rope shared_input
    RECIPES=fp8-tensorwise-promoted bash docs/perf/scripts/s15.sh steady
    torchao
    run 1b-fp8-tensorwise-promoted 90 $fp8
    peers 1b-torchao 150 llama-1b fp8
    [ $SECONDS -lt 480 ] && run 1b-fp8-tensorwise-promoted-2 90 $fp8
    [ $SECONDS -lt 530 ] && run 1b-bf16 60 --preset llama-1b --steps 10 --warmup 3
    ;;
  rows)
    torchao
    run 1b-fp8-tensorwise-promoted 90 $fp8
    peers 1b-torchao 150 llama-1b fp8
    run 1b-fp8-tensorwise-promoted-2 90 $fp8
    ;;
  suites)
    timeout -s KILL 300 bash .gpu/run.sh gpu-suite --one-gpu --filter model_suite > "$OUT/suite-model.log" 2>&1
    grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-model.log" | cut -c1-400
    suite quantized_linear weight_codes emulated_blocks
    ;;
esac
(cd "$OUT" && tar cJf logs.tar.xz --remove-files -- $(ls *.log *.csv 2>/dev/null))
