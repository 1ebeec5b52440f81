#!/usr/bin/env bash
# Session 37, one GPU:
#   pairs:  (carry .gpu with bench0, the bench of 527e4e2, and bench, whose layers run the
#           GEMM's blocks in pairs sharing B) bench --gemm with both schedules (the CHECK lines,
#           bf16 and FP8 rates), then the llama-1b step before and after, alternating, beside
#           PyTorch + compile, 40 timed steps each with the clocks sampled; FP8 promoted before
#           and after. The warm-up losses of before and after agree to the atomics' rounding.
#   again:  (as pairs, the pairs' kernel now its own launch, the lone one without a cluster
#           attribute) bench0's GEMM beside bench's two schedules and cuBLAS, then the step
#           before and after, alternating, and both with --profile.
#   suite:  (carry .gpu with gpu-suite and bench) the GEMM kernel tests, both schedules.
# pairs and again ran a build with `Schedule::PersistentPairs` (`WgmmaPairs`), removed after
# call 2 (`logs/s37/README.md`); with today's bench, name the kernels: gemm bench Wgmma.
# Logs go to $OUT.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-pairs}
gemm() {  # [BIN [KERNELS]]: the GEMM bench, CHECK lines off bf16's rounding, then every rate
  local bin=${1:-bench}
  timeout -s KILL 200 bash .gpu/run.sh "$bin" --gemm --kernels "${2:-Wgmma,WgmmaPairs}" > "$OUT/gemm-$bin.log" 2>&1
  echo "$bin CHECK lines: $(grep -c '^CHECK' "$OUT/gemm-$bin.log"); any not at bf16's rounding:"
  grep -h '^CHECK' "$OUT/gemm-$bin.log" | grep -v '"rel_error": [0-9.]*e-3\|"rel_error": [0-9.]*e-4' | cut -c1-300
  grep -h '^GEMM' "$OUT/gemm-$bin.log" | python3 -c '
import sys, json, collections
rows = collections.OrderedDict()
for line in sys.stdin:
    r = json.loads(line[5:])
    rows.setdefault(r["shape"], {})[r["kernel"]] = r.get("tflops", r.get("error"))
for shape, ks in rows.items():
    print(shape, " ".join(f"{k}={v}" for k, v in ks.items() if k != "burn"))'
  grep -h 'panicked\|rror' "$OUT/gemm-$bin.log" | head -5 | cut -c1-300
}
case $part in
  pairs)
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
    gemm
    for b in bench0 bench; do
      BENCH=$b run fp8-$b 90 $fp8
      grep -h '^warmup' "$OUT/bench-fp8-$b.log" | tr '\n' ' '; echo
    done
    for i in 1 2; do
      for b in bench0 bench; do
        BENCH=$b ours "$b-$i"
      done
      [ $i = 1 ] && compiled compile-1
      [ $SECONDS -gt 430 ] && break
    done
    ;;
  again)
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
    gemm bench0 Wgmma
    gemm bench
    python3 examples/bench/gemm_peer.py > "$OUT/gemm-cublas.log" 2>&1
    grep -h '"cublas"' "$OUT/gemm-cublas.log" | python3 -c 'import sys, json
rows = [json.loads(l[5:]) for l in sys.stdin]
print("cublas", " ".join("%s=%s" % (r["shape"], r["tflops"]) for r in rows))'
    for i in 1 2; do
      for b in bench0 bench; do
        BENCH=$b ours "$b-$i"
      done
    done
    for b in bench0 bench; do
      [ $SECONDS -lt 480 ] && BENCH=$b run profile-$b 60 $bf16 --profile
    done
    ;;
  suite)
    suite wgmma_gemm fp8_gemm
    gemm
    ;;
esac
