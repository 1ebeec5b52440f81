#!/usr/bin/env bash
# Session 33, one GPU (carry .gpu with gpu-suite and bench; `rows` also .peers and .whl):
#   memory: the AdamW master kernel updating the optimizer's state in place: its kernel test and
#           the model suite's optimizer tests (one GPU, ranks as threads), then llama-1b bf16 and
#           FP8 promoted with bench's MEMORY lines (CubeCL's pools at the start of a step and
#           after each piece) and nvidia-smi's peak; bf16 again with the state written anew each
#           step (TEMP_ADAMW_COPY, the build of this call only) for the before.
#   lmem:   (carry .gpu with bench) where the device memory outside CubeCL's pools goes: llama-1b
#           bf16 with the driver's count beside the pools at each MEMORY mark, every kernel's PTX
#           dumped, and ptxas's stack frame (local memory a thread) for each, largest first.
#   flush:  (carry .gpu with bench) llama-1b bf16 and FP8 promoted once the optimizer step flushes
#           the device (CubeCL frees the pages its pools gave back only at a flush): the driver's
#           count at each MEMORY mark should be the pools' plus the context's ~0.6 GiB.
#   rows:   FP8 promoted beside torchao float8 + compile, bf16 beside PyTorch + compile (fp32
#           master weights, random ids, 3 warm-up and 10 timed steps), with memory: each of our
#           runs' MEMORY marks (at, tensors, pools, driver) and nvidia-smi's peak; with the
#           optimizer step's flush the driver's count should sit ~0.6 GiB over the pools.
# Logs go to $OUT.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-memory}
model() {  # FILTER NAME LIMIT: gpu-suite's tests matching FILTER on one GPU, ranks as threads
  timeout -s KILL "$3" bash .gpu/run.sh gpu-suite --one-gpu --filter "$1" > "$OUT/suite-$2.log" 2>&1
  grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$2.log" | cut -c1-600
}
case $part in
  memory)
    suite adamw_master
    model adamw_steps_match adamw 120
    model zero1_matches_unsharded zero1 120
    model optimizer_keeps_weight_amaxes kept-amaxes 120
    run 1b-bf16 70 $bf16; memory 1b-bf16 1500
    export TEMP_ADAMW_COPY=1; run 1b-bf16-copy 70 $bf16; memory 1b-bf16-copy 1500; unset TEMP_ADAMW_COPY
    run 1b-fp8-tensorwise-promoted 90 $fp8; memory 1b-fp8-tensorwise-promoted 1500
    ;;
  lmem)
    mkdir -p /tmp/ptx /tmp/ptxall
    # Kernels whose dumped names collide overwrite each other: keep every version seen.
    (while true; do for f in /tmp/ptx/*.ptx; do [ -f "$f" ] && cp "$f" "/tmp/ptxall/$(md5sum "$f" | cut -c1-12).ptx"; done; sleep 0.1; done) &
    copier=$!
    export CUBECL_CUDA_DUMP_PTX=/tmp/ptx
    run 1b-bf16-ptx 120 $bf16; memory 1b-bf16-ptx 1500
    unset CUBECL_CUDA_DUMP_PTX
    sleep 0.5; kill $copier
    ptxas=$(python3 -c "import triton, os; print(os.path.dirname(triton.__file__))")/backends/nvidia/bin/ptxas
    ls /tmp/ptxall | wc -l
    for f in /tmp/ptxall/*.ptx; do
      sed -i 's/^\.version 9\.0/.version 8.7/' "$f"
      "$ptxas" -arch=sm_90a -v "$f" -o /dev/null 2>&1 | awk -v f="$(basename "$f")" '
        /Compiling entry function/ {name = $4}
        /bytes stack frame/ {print $1, name, f}'
    done | sort -rn | head -25 | tee "$OUT/stack-frames.txt"
    (cd /tmp/ptxall && tar cJf "$OUT/ptx.tar.xz" *.ptx)
    ;;
  flush)
    run 1b-bf16-flush 70 $bf16; memory 1b-bf16-flush
    run 1b-fp8-flush 90 $fp8; memory 1b-fp8-flush
    ;;
  rows)
    torchao
    run 1b-fp8-tensorwise-promoted 90 $fp8; memory 1b-fp8-tensorwise-promoted
    peers 1b-torchao 150 llama-1b fp8
    run 1b-bf16 70 $bf16; memory 1b-bf16
    [ $SECONDS -lt 430 ] && peers 1b-compile 150 llama-1b compile
    ;;
esac
