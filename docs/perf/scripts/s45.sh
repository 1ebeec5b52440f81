#!/usr/bin/env bash
# Session 45. The one-GPU calls of `logs/s45` ran `s44.sh` (delayed, delayed-curves, suite) and
# `recipes` below on this session's bundles of 76c10cf (built on a fresh machine, named as
# session 44's: `.gpu11` with gpu-suite, `.gpu12` with bench, train and shakespeare.txt.xz).
# This script also holds the two-GPU rows, not run yet (no pair was lent), for a call on two GPUs
# (nvidia-h100-x2 or nvidia-h200-x2; carry .gpu12, .whl with the torchao wheel, .whl-megatron
# with the megatron-core wheel, .peers = a copy of ../shared/peers; `llama.md` says how to fetch
# them), on the peers' recipe (bf16 compute, fp32 master weights, random ids, 3 warm-up and 10
# timed steps):
#   two-a: llama-1b at tp = 2 + SP beside tp = 2 + SP + compile (the peer twice: it varied
#          64k–104k tokens/s across calls), llama-1b at dp = 2 beside DDP + compile, with the
#          reduction's hidden share (`--profile`), then Megatron Core's local peer on one GPU.
#   two-b: llama-8b at tp = 2 + SP beside tp = 2 + SP + compile, then FP8 promoted at tp = 2
#          beside torchao float8 tensorwise + compile at tp = 2 (issue 16's 1.4× our bf16 and
#          1.1× torchao). llama-8b at tp 2 took 80.2 GiB a GPU by nvidia-smi on H200s
#          (`logs/s7/two-gpu`, PyTorch + compile 80.1): ask for nvidia-h200-x2 with needs_h200,
#          an H100's 80 GB may not hold it.
#   recipes: (one GPU, carry .gpu12) llama-1b, 3 warm-up and 10 timed steps under bf16 and every
#          recipe in turn, each with its peak memory by nvidia-smi and its pools' (`peak_mem_gib`):
#          issue 16's speed and memory of each recipe on one card in one call.
#   gemm:  (one GPU, carry .gpu12 with a bench of 2026-12-07 or later) `bench --gemm --kernels Wgmma`
#          and `gemm_peer.py` (cuBLAS, bf16 and FP8) on every shape, llama-8b's products at tp 2
#          among them: the FP8 GEMM's 1.2 PFLOP/s target on all of them, not one.
# Logs go to $OUT, packed into one $OUT/logs.tgz at the end.
set -u
trap 'tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/logs.tgz "$OUT/"' EXIT
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
rm -rf .gpu && ln -s .gpu12 .gpu
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
megatron() {  # megatron-core 0.19.2 from the carried wheel, on PYTHONPATH
  python3 -m pip install --quiet --no-deps --target /tmp/megatron .whl-megatron/megatron_core-0.19.2-*.whl
  export PYTHONPATH=/tmp/megatron${PYTHONPATH:+:$PYTHONPATH}
}
case ${1:-two-a} in
  two-a)
    run 1b-tp2 100 $bf16 --tp 2 --sp
    TP=2 peers 1b-tp2-a 110 llama-1b tp-torch
    [ $SECONDS -lt 330 ] && run 1b-dp2 110 $bf16 --dp 2 --profile
    [ $SECONDS -lt 380 ] && TP=2 peers 1b-dp2 130 llama-1b dp-torch
    [ $SECONDS -lt 470 ] && TP=2 peers 1b-tp2-b 110 llama-1b tp-torch
    [ $SECONDS -lt 480 ] && { megatron; peers 1b-megatron 110 llama-1b megatron; }
    ;;
  two-b)
    run 8b-tp2 150 --preset llama-8b --steps 10 --warmup 3 --tp 2 --sp
    TP=2 peers 8b-tp2 150 llama-8b tp-torch
    torchao
    [ $SECONDS -lt 400 ] && run 8b-tp2-fp8 130 --preset llama-8b --steps 10 --warmup 3 --tp 2 --sp \
      --precision fp8-tensorwise-promoted
    [ $SECONDS -lt 460 ] && TP=2 peers 8b-tp2-torchao 130 llama-8b tp-fp8
    ;;
  gemm)
    timeout -s KILL 300 bash .gpu/run.sh bench --gemm --kernels Wgmma > "$OUT/gemm-bench.log" 2>&1
    timeout -s KILL 200 python3 examples/bench/gemm_peer.py > "$OUT/gemm-cublas.log" 2>&1
    echo "CHECK lines off bf16's rounding:"
    grep -h '^CHECK' "$OUT/gemm-bench.log" | grep -v '"rel_error": [0-9.]*e-[34]' | cut -c1-300
    gemm_table "$OUT/gemm-bench.log" "$OUT/gemm-cublas.log"
    grep -h 'panicked\|rror' "$OUT"/gemm-*.log | head -5 | cut -c1-300
    ;;
  recipes)
    run 1b-bf16 70 $bf16
    for recipe in fp8-tensorwise fp8-tensorwise-promoted fp8-tensorwise-e4m3 fp8-tensorwise-e4m3-promoted \
      fp8-delayed fp8-blockwise mxfp8 nvfp4; do
      [ $SECONDS -lt 530 ] && run "1b-$recipe" 70 $bf16 --precision "$recipe"
    done
    ;;
esac
