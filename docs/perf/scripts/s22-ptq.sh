#!/usr/bin/env bash
# Session 22, one H200: the PTQ table's FP8 input-tile rows at full size on the GPU. SmolLM2's
# GGUF file (98 MB) travels in two parts, one call each, while the machine stays warm:
#   a:   (carry .xfer1: the file's first 49 MB) into /tmp/m;
#   b:   (carry .xfer2: the rest, and the plays) joined in /tmp/m;
#   run: (carry .gpu with ptq and gpu-suite) `ptq --only "fp8-tiles gptq"` (the tiles with GPTQ) (bf16 compute, 64
#        calibration windows of 512 tokens, 64 held-out windows of 512, as the table of
#        2026-12-01), the tiles' best row exported and read back by transformers
#        (`examples/ptq/check_compressed.py`), then the grouped-product and order kernels of the
#        final build.
set -u
cd "$(dirname "$0")/../../.."
part=${1:-run}
case $part in
  a) mkdir -p /tmp/m && cp .xfer1/gguf.part00 /tmp/m/ && ls -la /tmp/m ;;
  b) cat /tmp/m/gguf.part00 .xfer2/gguf.part01 > /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf \
       && cp .xfer2/shakespeare.txt /tmp/m/ && rm /tmp/m/gguf.part00 && ls -la /tmp/m ;;
  run)
    # The table's rows, then the tiles' best row exported in compressed-tensors' layout and
    # loaded back (one calibration for both), then read by transformers without our code (the
    # same held-out windows).
    timeout -s KILL 400 bash .gpu/run.sh ptq --device cuda --model /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf \
      --data /tmp/m/shakespeare.txt --calibration 64 --calibration-seq 512 --eval-windows 64 \
      --eval-seq 512 --only "fp8-tiles gptq" --export /tmp/m/tiles \
      --export-row "w:fp8-channel-max a:fp8-tiles gptq-act-order" > "$OUT/ptq-gpu-fp8-tiles.log" 2>&1
    cut -c1-160 "$OUT/ptq-gpu-fp8-tiles.log"
    timeout -s KILL 120 python3 examples/ptq/check_compressed.py /tmp/m/tiles /tmp/m/shakespeare.txt \
      > "$OUT/check-compressed-tiles.log" 2>&1
    tail -3 "$OUT/check-compressed-tiles.log" | cut -c1-300
    for t in grouped_gemm expert_order; do
      timeout -s KILL 60 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::$t" > "$OUT/suite-$t.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$t.log" | cut -c1-400
    done
    ;;
esac
