#!/usr/bin/env bash
# Session 11, one H200 (carry .gpu with ptq; SmolLM2's GGUF file and the plays in /tmp/m, put
# there by the two calls before, which carried them in two parts): the PTQ table at full size,
# in two parts a call (`eight`: the int8, FP8 and NVFP4 rows; `int4`: the int4 rows). bf16
# compute, 64 calibration windows of 512 tokens, 64 held-out windows of 512.
set -u
cd "$(dirname "$0")/../../.."
part=${1:-eight}
case $part in
  eight) only=int8,fp8,nvfp4 ;;
  int4) only=int4 ;;
esac
timeout -s KILL 570 bash .gpu/run.sh ptq --device cuda --model /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf \
  --data /tmp/m/shakespeare.txt --calibration 64 --calibration-seq 512 --eval-windows 64 \
  --eval-seq 512 --only $only > "$OUT/ptq-gpu-$part.log" 2>&1
cut -c1-160 "$OUT/ptq-gpu-$part.log"
