#!/usr/bin/env bash
# Session 24, one H200 (carry .gpu with gpu-suite and bench, .peers (../shared/peers) and .whl
# with torchao 0.18's wheel).
#   ptx:  `bench --attention` with CUBECL_CUDA_DUMP_PTX, then Triton's ptxas over the kernels
#         that issue wgmma: registers, spills and whether it serialized the wgmmas (C7513),
#         then attn's kernel test and timings.
#   ptxall: the same ptxas report over every wgmma kernel `bench --gemm` and `bench --grouped`
#         launch (the bf16 GEMM, the grouped GEMM), or with RECIPES a one-step llama-1b run under
#         each (the FP8 tensorwise and blockwise GEMMs).
#   attn: flash attention's kernel test, then its forward and backward alone beside PyTorch's
#         SDPA backends (`bench --attention`, `examples/bench/attention_peer.py`), then llama-1b
#         under bf16 beside PyTorch + compile and FP8 tensorwise beside torchao float8
#         tensorwise + compile, and both of ours again if time is left (fp32 master weights,
#         random ids, 3 warm-up and 10 timed steps; AGAIN=0 leaves out the second runs;
#         PTX=1 takes the timings through ptxcheck, with its ptxas report).
# Logs go to $OUT/logs.tar.xz (a device call brings back a few files).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-attn}
ptxcheck() {
  mkdir -p /tmp/ptx && rm -f /tmp/ptx/*
  CUBECL_CUDA_DUMP_PTX=/tmp/ptx timeout -s KILL 90 bash .gpu/run.sh bench --attention > "$OUT/bench-attention.log" 2>&1
  ptxreport /tmp/ptx
  (cd /tmp/ptx && tar cJf "$OUT/ptx.tar.xz" *.ptx)
}
case $part in
  ptxall)
    mkdir -p /tmp/ptx /tmp/ptxall
    # Kernels whose dumped names collide overwrite each other: keep every version seen.
    (while true; do for f in /tmp/ptx/*.ptx; do [ -f "$f" ] && cp "$f" "/tmp/ptxall/$(md5sum "$f" | cut -c1-12).ptx"; done; sleep 0.1; done) &
    copier=$!
    if [ -n "${RECIPES:-}" ]; then  # the FP8 GEMMs as a short llama-1b run launches them
      for recipe in $RECIPES; do
        CUBECL_CUDA_DUMP_PTX=/tmp/ptx timeout -s KILL 90 bash .gpu/run.sh bench --preset llama-1b --steps 1 --warmup 1 --precision "$recipe" > "$OUT/bench-$recipe.log" 2>&1
      done
    else
      CUBECL_CUDA_DUMP_PTX=/tmp/ptx timeout -s KILL 150 bash .gpu/run.sh bench --gemm > "$OUT/bench-gemm.log" 2>&1
      CUBECL_CUDA_DUMP_PTX=/tmp/ptx timeout -s KILL 90 bash .gpu/run.sh bench --grouped > "$OUT/bench-grouped.log" 2>&1
    fi
    sleep 0.5; kill $copier
    grep -h '"shape": "1b.w13.fwd"' "$OUT/bench-gemm.log" | cut -c1-250
    ptxreport
    (cd /tmp/ptxall && tar cJf "$OUT/ptx.tar.xz" $(grep -l wgmma *.ptx))
    ;;
  ptx)
    ptxcheck
    grep -h "ATTENTION\|panicked\|error" "$OUT/bench-attention.log" | cut -c1-400
    suite ${TESTS:-flash_attention}
    ;;
  attn)
    suite ${TESTS:-flash_attention}
    if [ "${PTX:-0}" = 1 ]; then
      ptxcheck
    else
      timeout -s KILL 90 bash .gpu/run.sh bench --attention > "$OUT/bench-attention.log" 2>&1
    fi
    grep -h "ATTENTION\|panicked\|error" "$OUT/bench-attention.log" | cut -c1-400
    timeout -s KILL 90 python3 examples/bench/attention_peer.py > "$OUT/peer-attention.log" 2>&1
    grep -h "ATTENTION\|Error" "$OUT/peer-attention.log" | cut -c1-400
    llama_rows
    ;;
esac
(cd "$OUT" && tar cJf logs.tar.xz --remove-files -- $(ls *.log *.csv 2>/dev/null))
