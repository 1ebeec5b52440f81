#!/usr/bin/env bash
# Session 39, one GPU:
#   test:   (carry .gpu2 with gpu-suite and bench, .gpu2/run.sh) attention with RoPE inside the op
#           (`rotary_attention`: dQ and dK unrotated as the backward's kernels write them): the
#           flash kernels' test with and without it, RoPE's kernel test, the attention layer at
#           tp 1 and at tp 2 on one GPU (ranks as threads), the transformers fixtures (f32: the
#           reference path, RoPE apart), the model's AdamW steps; then ncu's times of the
#           attention's and RoPE's kernels over three bench steps.
#   gated:  (carry .gpu2 with gpu-suite and bench) the gate and up projections and the SwiGLU in
#           one GEMM (`gated_projection`): its kernel test, the GEMM's, the MLP layer at tp 1 and
#           at tp 2 on one GPU, the model's AdamW steps; then ncu's times of the GEMMs and the
#           SwiGLU's kernels over three bench steps. MORE set (even empty) leaves out the tp 2
#           run; MORE=NAMES runs those kernel tests in place of the GEMM's and the SwiGLU's.
#   ab:     (carry .gpu with bench0, the bench of the commit before, and bench; .peers) the llama-1b step
#           before and after, alternating, 40 timed steps each with the clocks sampled, and
#           PyTorch + compile between; then the rows (s6-common's: FP8 promoted beside torchao
#           float8 + compile, bf16 beside PyTorch + compile) if time is left and ROWS is not 0.
#   final:  (carry .gpu2 with gpu-suite and bench, .peers) the gated GEMM's tests and ncu as
#           `MORE= gated` runs them, then bench's llama-1b step (40 steps) twice with PyTorch +
#           compile's between, then the rows with ROWS=1 (.whl carried too) if time is left (one
#           call: machines were scarce).
# Logs go to $OUT, packed into one $OUT/logs.tgz at the end (the device tool returns a few files).
set -u
[ -z "${S39_NESTED:-}" ] && trap 'tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/logs.tgz "$OUT/"' EXIT
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-test}
suite2() {  # LOG ARGS...: one gpu-suite run from .gpu2
  local log=$1; shift
  timeout -s KILL 150 bash .gpu2/run.sh gpu-suite "$@" > "$OUT/suite-$log.log" 2>&1
  echo "-- $log: rc $?"; grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$log.log" | cut -c1-600
}
case $part in
  test)
    for test in kernel_suite::flash_attention kernel_suite::rope layer_suite::attention \
      hf_suite::llama2_matches_transformers hf_suite::llama3_matches_transformers model_suite::adamw_steps_match; do
      suite2 "${test#*::}" --world 1 --filter "$test"
    done
    suite2 attention-tp2 --one-gpu --world 2 --filter layer_suite::attention
    timeout -s KILL 200 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
      -k regex:'rope|dqkv|dq_out|delta_kernel|forward_kernel' \
      bash .gpu2/run.sh bench --preset llama-1b --steps 1 --warmup 1 > "$OUT/ncu-attention.csv" 2>&1
    # (call1 ran an awk here that read each time without its unit; ncu_table.py since.)
    python3 docs/perf/scripts/ncu_table.py "$OUT/ncu-attention.csv" "$OUT/steady-attention.txt" "$OUT/ordered-attention.txt"
    cat "$OUT/steady-attention.txt"; rm -f "$OUT/ncu-attention.csv"
    ;;
  gated | gated-tests)
    for test in kernel_suite::gated_gemm ${MORE:-kernel_suite::wgmma_gemm kernel_suite::swiglu} layer_suite::mlp \
      model_suite::adamw_steps_match; do
      suite2 "${test#*::}" --world 1 --filter "$test"
    done
    [ -z "${MORE+x}" ] && suite2 mlp-tp2 --one-gpu --world 2 --filter layer_suite::mlp
    [ "$part" = gated-tests ] && exit 0
    timeout -s KILL 200 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
      -k regex:'gemm|gated|swiglu' bash .gpu2/run.sh bench --preset llama-1b --steps 1 --warmup 1 > "$OUT/ncu-gated.csv" 2>&1
    python3 docs/perf/scripts/ncu_table.py "$OUT/ncu-gated.csv" "$OUT/steady-gated.txt" "$OUT/ordered-gated.txt"
    head -12 "$OUT/steady-gated.txt"; rm -f "$OUT/ncu-gated.csv"
    ;;
  final)
    S39_NESTED=1 MORE= bash "$0" gated
    ln -sfn .gpu2 .gpu
    ours after-1
    compiled compile
    ours after-2
    [ "${ROWS:-0}" = 1 ] && [ $SECONDS -lt 330 ] && rows
    ;;
  ab)
    for round in 1 2; do
      [ $SECONDS -lt 470 ] && BENCH=bench0 ours "before-$round"
      [ $SECONDS -lt 500 ] && ours "after-$round"
      [ $round = 1 ] && [ $SECONDS -lt 420 ] && compiled compile
    done
    [ "${ROWS:-1}" = 1 ] && [ $SECONDS -lt 300 ] && rows
    ;;
esac
