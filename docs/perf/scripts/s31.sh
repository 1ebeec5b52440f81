#!/usr/bin/env bash
# Session 31, one GPU:
#   check:  (carry .gpu with gpu-suite and bench, .peers and .whl) the kernel tests of the amaxes
#           taken by the AdamW master kernel and by flash attention's forward (and of the kernels
#           they changed), the optimizer's kept amaxes on a model (dp 1, ZeRO-1 at dp 2), ncu on
#           one steady FP8-promoted step (`s15.sh steady`), then llama-1b under
#           fp8-tensorwise-promoted beside torchao float8 tensorwise + compile (bf16 compute, fp32
#           master weights, random ids, 3 warm-up and 10 timed steps), ours twice.
#   fused:  (carry .gpu with gpu-suite and bench, .peers and .whl) the same after RMSNorm's
#           backward adds the residual stream's gradient (and notes its amax) and flash attention
#           notes its warps' maxima: the kernel tests of both, the model tests on one GPU, ncu on
#           one steady FP8-promoted step, FP8 promoted beside torchao (ours twice), bf16 once.
#   final:  (carry .gpu with gpu-suite and bench, .peers and .whl) the same after the products
#           that share a norm's output hand their gradients to its backward (`fan_out`): the
#           norm's kernel tests, the model tests on one GPU, FP8 promoted beside torchao (ours
#           twice), bf16, then ncu on one steady FP8-promoted step if time is left.
#   rows:   (carry .gpu with bench, .peers and .whl) FP8 promoted beside torchao (ours twice), and
#           bf16 beside PyTorch + compile.
#   curves: (carry .gpu with train and shakespeare.txt.xz: xz of what scripts/fetch-shakespeare.sh
#           writes) llama-1b trained 300 steps on the plays under bf16 and fp8-tensorwise-promoted
#           from each of SEEDS' initializations (default 1 to 6), as `s23.sh curves` trains them
#           (batch 1 × 2048, lr 3e-4), the two recipes alternating: bf16's baseline and the FP8
#           runs on one GPU model and today's code.
#   suites: (carry .gpu with gpu-suite) the model suite on one GPU (ranks as threads: FP8 at tp 2,
#           delayed scaling), the data-parallel model tests and the quantized products' kernel
#           tests.
# Logs go to $OUT/logs.tar.xz.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-check}
fp8="--preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise-promoted"
model() {  # FILTER NAME LIMIT: gpu-suite's tests matching FILTER on one GPU, ranks as threads
  timeout -s KILL "$3" bash .gpu/run.sh gpu-suite --one-gpu --filter "$1" > "$OUT/suite-$2.log" 2>&1
  grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$2.log" | cut -c1-600
}
case $part in
  check)
    suite adamw_master amax_notes flash_attention
    model optimizer_keeps_weight_amaxes kept-amaxes 150
    RECIPES=fp8-tensorwise-promoted bash docs/perf/scripts/s15.sh steady
    torchao
    run 1b-fp8-tensorwise-promoted 90 $fp8
    peers 1b-torchao 150 llama-1b fp8
    [ $SECONDS -lt 500 ] && run 1b-fp8-tensorwise-promoted-2 90 $fp8
    ;;
  fused)
    suite rms_norm amax_notes flash_attention
    model model_suite models 200
    RECIPES=fp8-tensorwise-promoted bash docs/perf/scripts/s15.sh steady
    torchao
    run 1b-fp8-tensorwise-promoted 90 $fp8
    peers 1b-torchao 150 llama-1b fp8
    [ $SECONDS -lt 480 ] && run 1b-fp8-tensorwise-promoted-2 90 $fp8
    [ $SECONDS -lt 530 ] && run 1b-bf16 60 --preset llama-1b --steps 10 --warmup 3
    ;;
  final)
    suite rms_norm amax_notes
    model model_suite models 200
    torchao
    run 1b-fp8-tensorwise-promoted 90 $fp8
    peers 1b-torchao 150 llama-1b fp8
    run 1b-fp8-tensorwise-promoted-2 90 $fp8
    [ $SECONDS -lt 380 ] && run 1b-bf16 60 --preset llama-1b --steps 10 --warmup 3
    [ $SECONDS -lt 400 ] && RECIPES=fp8-tensorwise-promoted bash docs/perf/scripts/s15.sh steady
    ;;
  rows)
    torchao
    run 1b-fp8-tensorwise-promoted 90 $fp8
    peers 1b-torchao 150 llama-1b fp8
    run 1b-fp8-tensorwise-promoted-2 90 $fp8
    run 1b-bf16 70 --preset llama-1b --steps 10 --warmup 3
    [ $SECONDS -lt 430 ] && peers 1b-compile 150 llama-1b compile
    ;;
  curves)
    mkdir -p data && xz -dc .gpu/shakespeare.txt.xz > data/shakespeare.txt
    for seed in ${SEEDS:-1 2 3 4 5 6}; do
      for precision in default fp8-tensorwise-promoted; do
        [ $SECONDS -gt 520 ] && { echo "no time left for $precision seed $seed"; continue; }
        log="$OUT/train-$precision-seed$seed.log"
        timeout -s KILL 75 bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
          --init per-shard --precision "$precision" --data data/shakespeare.txt --steps 300 --batch 1 \
          --lr 3e-4 --sample-every 0 --seed "$seed" > "$log" 2>&1
        echo "$precision seed $seed: $(grep -c '^step' "$log") steps, last 20 mean $(grep '^step' "$log" | tail -n 20 \
          | awk '{for (i = 1; i < NF; i++) if ($i == "loss") s += $(i + 1)} END {printf "%.4f", s / NR}'); $(tail -n 2 "$log" | head -n 1 | cut -c1-80)"
      done
    done
    ;;
  suites)
    model model_suite models 360
    suite quantized_linear weight_codes shared_input fp8_amax
    ;;
esac
(cd "$OUT" && tar cJf logs.tar.xz --remove-files -- $(ls *.log *.csv 2>/dev/null))
