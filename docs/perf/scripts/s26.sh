#!/usr/bin/env bash
# Session 26, one H200 (carry .gpu with gpu-suite and bench, .peers (../shared/peers) and .whl
# with torchao 0.18's wheel).
#   gemm: `bench --gemm --kernels Wgmma` (bf16 and FP8 on every shape, the fused projections'
#         included), then cuBLAS on the same shapes, bf16 and FP8 (`examples/bench/gemm_peer.py`).
#   fused: the kernel tests of the packed ops and of what they changed (flash attention's
#         stores, RoPE), then the rows below.
#   ab:   llama-1b bf16 and FP8 tensorwise, the projections fused and apart in turn, twice, then
#         bf16 both ways with `--profile`: needs a bench built at the fused projections' commit
#         with `fused::fusable` returning false when APART is set (a one-line local change).
#   curves: (carry .gpu with shakespeare.txt.xz: xz of what scripts/fetch-shakespeare.sh writes)
#         PyTorch's llama-1b on the plays under bf16 and under torchao float8 tensorwise, from
#         each of SEEDS (default 1–6), on the windows `train` draws
#         (`examples/bench/fp8_curves_peer.py`): the FP8 gap beside ours (`fp8.md`).
#   promoted: (carry .gpu with gpu-suite, train and shakespeare.txt.xz: three CUDA binaries pass
#         the 64 MiB a call carries; not yet run) every recipe's product on CUDA against the CPU
#         (`kernel_suite::quantized_linear`, the promoted recipe's included), then our llama-1b
#         on the plays under fp8-tensorwise-promoted from each of SEEDS (default 1–6), as
#         `s23.sh curves` trains the others; then a bench row where bench was carried too.
#   rows: llama-1b under bf16 beside PyTorch + compile and FP8 tensorwise beside torchao float8
#         tensorwise + compile (fp32 master weights, random ids, 3 warm-up and 10 timed steps),
#         then both of ours again if time is left (AGAIN=0 leaves them out).
# Logs go to $OUT/logs.tar.xz (a device call brings back a few files).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-rows}
case $part in
  gemm)
    [ -n "${TESTS:-}" ] && suite $TESTS
    timeout -s KILL 200 bash .gpu/run.sh bench --gemm --kernels Wgmma > "$OUT/bench-gemm.log" 2>&1
    grep -h 'GEMM\|CHECK.*rror\|panicked' "$OUT/bench-gemm.log" | grep -v '"kernel": "burn"' | cut -c1-250
    timeout -s KILL 120 python3 examples/bench/gemm_peer.py > "$OUT/peer-gemm.log" 2>&1
    grep -h 'GEMM\|Error' "$OUT/peer-gemm.log" | cut -c1-250
    ;;
  fused)
    suite ${TESTS:-packed_attention_heads swiglu_packed_halves flash_attention rope swiglu}
    llama_rows
    ;;
  ab)
    for i in 1 2; do
      run fused-bf16-$i 90 --preset llama-1b --steps 10 --warmup 3
      APART=1 run apart-bf16-$i 90 --preset llama-1b --steps 10 --warmup 3
      run fused-fp8-$i 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
      APART=1 run apart-fp8-$i 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
    done
    run fused-bf16-profile 90 --preset llama-1b --steps 10 --warmup 3 --profile
    APART=1 run apart-bf16-profile 90 --preset llama-1b --steps 10 --warmup 3 --profile
    ;;
  curves)
    mkdir -p data && xz -dc .gpu/shakespeare.txt.xz > data/shakespeare.txt
    torchao
    timeout -s KILL 560 python3 examples/bench/fp8_curves_peer.py --data data/shakespeare.txt \
      --seeds ${SEEDS:-1 2 3 4 5 6} --budget 480 > "$OUT/curves-peer.log" 2>&1
    grep -v '^LOSSES' "$OUT/curves-peer.log" | cut -c1-300
    ;;
  promoted)
    suite quantized_linear
    mkdir -p data && xz -dc .gpu/shakespeare.txt.xz > data/shakespeare.txt
    for seed in ${SEEDS:-1 2 3 4 5 6}; do
      [ $SECONDS -gt 470 ] && { echo "no time left for seed $seed"; continue; }
      log="$OUT/train-fp8-tensorwise-promoted-seed$seed.log"
      timeout -s KILL 100 bash .gpu/run.sh train --preset llama-1b --device cuda --dtype bf16 \
        --init per-shard --precision fp8-tensorwise-promoted --data data/shakespeare.txt --steps 300 --batch 1 \
        --lr 3e-4 --sample-every 0 --seed "$seed" > "$log" 2>&1
      echo "fp8-tensorwise-promoted seed $seed: $(grep -c '^step' "$log") steps, last 20 mean $(grep '^step' "$log" | tail -n 20 \
        | awk '{for (i = 1; i < NF; i++) if ($i == "loss") s += $(i + 1)} END {printf "%.4f", s / NR}')"
    done
    [ -f .gpu/bench.xz ] && [ $SECONDS -lt 520 ] && run 1b-fp8-tensorwise-promoted 60 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise-promoted
    ;;
  rows)
    llama_rows
    ;;
esac
(cd "$OUT" && tar cJf logs.tar.xz --remove-files -- $(ls *.log *.csv 2>/dev/null))
