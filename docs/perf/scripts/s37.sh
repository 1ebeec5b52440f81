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
#   order:  (carry .gpu with bench0 and bench) attention's blocks heaviest first over groups of
#           16 heads: bench --attention before and after beside FA2 and cuDNN (attention_peer.py),
#           then the llama-1b step before and after, alternating, and PyTorch + compile.
#   final:  (carry .gpu with gpu-suite and bench, .peers, .whl) with the group of heads sized to
#           about 256 blocks: flash attention's kernel tests, bench --attention, then the rows
#           beside the peers (s6-common's rows: FP8 promoted beside torchao float8 + compile,
#           bf16 beside PyTorch + compile) and 40 bf16 steps with the clocks sampled.
#   lag:    (carry .gpu with bench) the GEMM's second consumer started one or two slices behind
#           the first, so the two warpgroups' stores stop coinciding: bench --gemm, twice in
#           opposite orders.
#   rows:   (carry .gpu with gpu-suite and bench, .peers, .whl) context parallelism's tests on
#           one GPU (two ranks as threads: attention split over ranks against one rank's), then
#           the rows beside the peers and 40 bf16 steps, as final.
#   fold:   (carry .gpu with bench0, the bench of 9eed5a0, and bench) the forward's softmax with
#           the scale folded into the exponential's argument (max over the raw scores):
#           bench --attention and the llama-1b step, before and after alternating, twice each.
#   foldtest: (carry .gpu2 with gpu-suite, .gpu2/run.sh) flash attention's kernel tests.
#   pair:   (as fold, bench0 the bench of b1c51b8) the backward's dV update and dP issued
#           together and waited for once; foldtest for its kernel tests.
# pairs and again ran a build with `Schedule::PersistentPairs` (`WgmmaPairs`), removed after
# call 2, lag one with `WgmmaLag1`/`WgmmaLag2` and pair one with the backward's paired chains,
# both removed after their calls (`logs/s37/README.md`); with today's bench, name the kernels
# (gemm bench Wgmma) and compare builds as fold does.
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
  gemm_table "$OUT/gemm-$bin.log"
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
  order)
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
    for b in bench0 bench; do
      timeout -s KILL 90 bash .gpu/run.sh $b --attention > "$OUT/attention-$b.log" 2>&1
      grep -h '^ATTENTION' "$OUT/attention-$b.log" | sed "s/^/$b /" | cut -c1-260
    done
    timeout -s KILL 120 python3 examples/bench/attention_peer.py > "$OUT/attention-peer.log" 2>&1
    grep -h '^ATTENTION' "$OUT/attention-peer.log" | cut -c1-260
    for b in bench0 bench; do
      BENCH=$b ours "$b-1"
      grep -h '^warmup' "$OUT/bench-$b-1.log" | tr '\n' ' '; echo
    done
    compiled compile-1
    for b in bench0 bench; do
      [ $SECONDS -lt 500 ] && BENCH=$b ours "$b-2"
    done
    ;;
  lag)
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
    gemm bench Wgmma,WgmmaLag1,WgmmaLag2
    cp "$OUT/gemm-bench.log" "$OUT/gemm-first.log"
    gemm bench WgmmaLag2,WgmmaLag1,Wgmma
    ;;
  rows)
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
    timeout -s KILL 150 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter context_suite > "$OUT/suite-context.log" 2>&1
    grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-context.log" | cut -c1-300
    rows
    [ $SECONDS -lt 500 ] && ours bf16-40
    ;;
  fold|pair)
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
    for i in 1 2; do
      for b in bench0 bench; do
        timeout -s KILL 90 bash .gpu/run.sh $b --attention > "$OUT/attention-$b-$i.log" 2>&1
        grep -h '^ATTENTION' "$OUT/attention-$b-$i.log" | sed "s/^/$b /" | cut -c1-200
      done
    done
    for i in 1 2; do
      for b in bench0 bench; do
        BENCH=$b ours "$b-$i"
        [ $i = 1 ] && { grep -h '^warmup' "$OUT/bench-$b-$i.log" | tr '\n' ' '; echo; }
      done
    done
    ;;
  foldtest)
    timeout -s KILL 150 bash .gpu2/run.sh gpu-suite --world 1 --filter kernel_suite::flash_attention > "$OUT/suite-flash.log" 2>&1
    grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-flash.log" | cut -c1-600
    ;;
  final)
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
    suite flash_attention
    timeout -s KILL 90 bash .gpu/run.sh bench --attention > "$OUT/attention-bench.log" 2>&1
    grep -h '^ATTENTION' "$OUT/attention-bench.log" | cut -c1-260
    rows
    [ $SECONDS -lt 500 ] && ours bf16-40
    ;;
esac
