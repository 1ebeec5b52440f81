#!/usr/bin/env bash
# Session 25, one H200 (carry .gpu with gpu-suite and bench, .peers (../shared/peers) and .whl
# with torchao 0.18's wheel).
#   gemm: the GEMM kernel tests (bf16 in both schedules, FP8), then
#         `bench --gemm --kernels Wgmma` with CUBECL_CUDA_DUMP_PTX and Triton's
#         ptxas over the wgmma kernels it launched (registers, spills, C7513: serialized wgmmas),
#         then cuBLAS on the same shapes (`examples/bench/gemm_peer.py`).
#   ncu:  ncu's full set on one GEMM launch of `bench --gemm --kernels Wgmma`, by default the
#         13th `gemm_kernel` launch (12 checks, then bf16 1b.w13.fwd; SKIP=78 is bf16
#         1b.qkvo.fwd, SKIP=89 its FP8 product: 11 launches a kernel and shape), the details
#         page and the SASS with its stall samples (`NAME`, default `gemm`: `$NAME.ncu-rep`,
#         `$NAME-details.log`, `$NAME-sass.csv.xz`).
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
    suite ${TESTS:-wgmma_gemm fp8_gemm}
    mkdir -p /tmp/ptx /tmp/ptxall
    # Kernels whose dumped names collide overwrite each other: keep every version seen.
    (while true; do for f in /tmp/ptx/*.ptx; do [ -f "$f" ] && cp "$f" "/tmp/ptxall/$(md5sum "$f" | cut -c1-12).ptx"; done; sleep 0.1; done) &
    copier=$!
    CUBECL_CUDA_DUMP_PTX=/tmp/ptx timeout -s KILL 150 bash .gpu/run.sh bench --gemm --kernels Wgmma > "$OUT/bench-gemm.log" 2>&1
    sleep 0.5; kill $copier
    grep -h 'GEMM\|CHECK.*rror\|panicked' "$OUT/bench-gemm.log" | grep -v '"kernel": "burn"' | cut -c1-250
    timeout -s KILL 90 python3 examples/bench/gemm_peer.py > "$OUT/peer-gemm.log" 2>&1
    grep -h 'GEMM\|Error' "$OUT/peer-gemm.log" | cut -c1-250
    ptxreport
    (cd /tmp/ptxall && tar cJf "$OUT/ptx.tar.xz" $(grep -l wgmma *.ptx))
    ;;
  ncu)
    name=${NAME:-gemm}
    timeout -s KILL 300 ncu --set full --import-source no -k regex:gemm_kernel --launch-skip "${SKIP:-12}" --launch-count 1 \
      -o "$OUT/$name" bash .gpu/run.sh bench --gemm --kernels Wgmma > "$OUT/ncu-run-$name.log" 2>&1
    tail -3 "$OUT/ncu-run-$name.log"
    ncu -i "$OUT/$name.ncu-rep" --page details > "$OUT/$name-details.log" 2>&1
    ncu -i "$OUT/$name.ncu-rep" --page source --print-source sass --csv > "$OUT/$name-sass.csv" 2>&1
    grep -E "^ +(Duration|Elapsed Cycles|SM Active Cycles|SM Frequency|Grid Size|Registers Per)" "$OUT/$name-details.log"
    xz -9 "$OUT/$name-sass.csv"
    ;;
  rows)
    llama_rows
    ;;
esac
(cd "$OUT" && tar cJf logs.tar.xz --remove-files -- $(ls *.log *.csv 2>/dev/null))
