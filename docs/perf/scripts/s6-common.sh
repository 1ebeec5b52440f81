# Sourced by the session scripts since session 6: memory sampling, one bench run with its peak
# memory, the peers, torchao's wheel installed, kernel tests by name, and ptxas's report.
# Every 200 ms: memory used, and (since session 26) the SM clock, power drawn and utilization.
# Since session 33: llama-1b's bench arguments on the peers' recipe, and a run's MEMORY lines.
# Since session 45: the GEMM bench's lines as one row a shape.
bf16="--preset llama-1b --steps 10 --warmup 3"
fp8="$bf16 --precision fp8-tensorwise-promoted"
memory() { grep -h '^MEMORY' "$OUT/bench-$1.log" | cut -c1-"${2:-160}"; }  # NAME [WIDTH]
sample() { nvidia-smi --query-gpu=index,memory.used,clocks.sm,power.draw,utilization.gpu --format=csv,noheader,nounits -lms 200 > "$OUT/mem-$1.csv" & }
peak() { awk -F', ' '{if ($2 > m[$1]) m[$1] = $2} END {for (g in m) printf "gpu%s=%s ", g, m[g]}' "$OUT/mem-$1.csv"; }
busy() {  # NAME: the median SM clock (MHz) and mean power (W) over the samples with the GPU busy
  local f="$OUT/mem-$1.csv"
  local clock power
  clock=$(awk -F', ' 'NF >= 5 && $5 >= 90 {print $3}' "$f" | sort -n | awk '{c[NR] = $1} END {if (NR) print c[int((NR + 1) / 2)]}')
  power=$(awk -F', ' 'NF >= 5 && $5 >= 90 {p += $4; n++} END {if (n) printf "%.0f W over %d samples", p / n, n}' "$f")
  [ -n "$clock" ] && echo "busy: median SM clock $clock MHz, mean power $power"
}
run() {  # NAME LIMIT ARGS...: one bench run (the binary $BENCH, default bench) with its memory sampled
  local name=$1 limit=$2; shift 2
  sample "$name"; local smi=$!
  timeout -s KILL "$limit" bash .gpu/run.sh "${BENCH:-bench}" "$@" > "$OUT/bench-$name.log" 2>&1
  kill $smi
  grep -h 'RESULT\|PROFILE\|panicked\|error' "$OUT/bench-$name.log" | cut -c1-400
  echo "$name peak MiB per GPU: $(peak "$name"); $(busy "$name")"
}
peers() {  # NAME LIMIT PRESET WHICH: peers with their memory sampled
  local name=$1 limit=$2; shift 2
  sample "peer-$name"; local smi=$!
  (cd .peers && PEER_TIMEOUT=$((limit - 5)) timeout -s KILL "$limit" bash run_peers.sh "$@" > "$OUT/peers-$name.log" 2>&1)
  kill $smi
  grep -h 'RESULT' "$OUT/peers-$name.log" | cut -c1-400
  echo "peer $name peak MiB per GPU: $(peak "peer-$name"); $(busy "peer-$name")"
}
torchao() {  # torchao 0.18 from the carried wheel, on PYTHONPATH
  python3 -m pip install --quiet --no-deps --target /tmp/torchao .whl/torchao-0.18.0-*.whl
  export PYTHONPATH=/tmp/torchao
}
suite() {  # TEST...: gpu-suite's kernel tests by name, one log each
  for test in "$@"; do
    timeout -s KILL 150 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::$test" > "$OUT/suite-$test.log" 2>&1
    grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$test.log" | cut -c1-600
  done
}
ptxreport() {  # [DIR]: every kernel dumped in DIR (/tmp/ptxall) that issues wgmma, through Triton's ptxas
  local ptxas
  ptxas=$(python3 -c "import triton, os; print(os.path.dirname(triton.__file__))")/backends/nvidia/bin/ptxas
  for f in $(grep -l wgmma "${1:-/tmp/ptxall}"/*.ptx); do
    sed -i 's/^\.version 9\.0/.version 8.7/' "$f"
    "$ptxas" -arch=sm_90a -v "$f" -o /dev/null 2>&1 | grep -h "entry function\|registers\|spill\|C7513\|rror" | cut -c1-300
  done
}
llama_rows() {  # llama-1b bf16 beside PyTorch + compile, FP8 tensorwise beside torchao + compile;
  # both of ours again if time is left (AGAIN=0 leaves them out)
  run 1b-bf16 90 --preset llama-1b --steps 10 --warmup 3
  peers 1b-compile 150 llama-1b compile
  torchao
  run 1b-fp8-tensorwise 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
  peers 1b-torchao 150 llama-1b fp8
  [ "${AGAIN:-1}" = 1 ] && [ $SECONDS -lt 430 ] && run 1b-bf16-2 90 --preset llama-1b --steps 10 --warmup 3
  [ "${AGAIN:-1}" = 1 ] && [ $SECONDS -lt 480 ] && run 1b-fp8-tensorwise-2 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
}
rows() {  # FP8 promoted beside torchao float8 + compile, bf16 beside PyTorch + compile (since session 34)
  torchao
  run 1b-fp8 90 $fp8; memory 1b-fp8
  peers 1b-torchao 150 llama-1b fp8
  run 1b-bf16 70 $bf16; memory 1b-bf16
  [ $SECONDS -lt 430 ] && peers 1b-compile 150 llama-1b compile
}
# Since session 36: nvidia-smi every 50 ms with the clock-event reasons over 40 timed steps,
# ours ($BENCH) and PyTorch + compile's, each run's busy samples summarized.
fields=timestamp,clocks.sm,power.draw,temperature.gpu,temperature.memory,utilization.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$fields --format=csv,noheader,nounits > /dev/null 2>&1 ||
  fields=${fields/clocks_event_reasons/clocks_throttle_reasons}
dense() { nvidia-smi --query-gpu=$fields --format=csv,noheader,nounits -lms 50 > "$OUT/clk-$1.csv" & }
report() {  # NAME: the busy samples (utilization >= 90%) of one run
  python3 - "$OUT/clk-$1.csv" "$1" <<'EOF'
import sys, collections
rows = [l.strip().split(", ") for l in open(sys.argv[1]) if l.count(",") >= 6]
busy = [r for r in rows if r[5].strip().isdigit() and int(r[5]) >= 90]
if not busy:
    sys.exit(print(f"{sys.argv[2]}: no busy samples of {len(rows)}"))
clock = sorted(int(r[1]) for r in busy)
power = [float(r[2]) for r in busy]
q = lambda p: clock[min(len(clock) - 1, int(p * len(clock)))]
names = {0x1: "idle", 0x2: "app-clocks", 0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x10: "sync-boost",
         0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display"}
reasons = collections.Counter()
for r in busy:
    bits = int(r[6], 16) if r[6].startswith("0x") else 0
    reasons.update(n for b, n in names.items() if bits & b) if bits else reasons.update(["none"])
share = ", ".join(f"{n} {100 * c / len(busy):.0f}%" for n, c in reasons.most_common())
print(f"{sys.argv[2]}: {len(busy)} busy samples; SM clock p10/p50/p90 {q(0.1)}/{q(0.5)}/{q(0.9)} MHz; "
      f"power mean {sum(power) / len(power):.0f} W, max {max(power):.0f} W; GPU temp max {max(int(r[3]) for r in busy)} C, "
      f"memory temp max {max(r[4] for r in busy)} C; reasons: {share}")
EOF
}
ours() {  # NAME: 40 llama-1b steps of $BENCH (default bench)
  dense "$1"; local smi=$!
  timeout -s KILL 120 bash .gpu/run.sh "${BENCH:-bench}" $bf16 --steps 40 > "$OUT/bench-$1.log" 2>&1
  kill $smi; grep -h 'RESULT\|panicked' "$OUT/bench-$1.log" | cut -c1-300; report "$1"
}
compiled() {  # NAME
  dense "$1"; local smi=$!
  (cd .peers && timeout -s KILL 200 python3 peer_torch.py --preset llama-1b --compile --steps 40) > "$OUT/peer-$1.log" 2>&1
  kill $smi; grep -h 'RESULT' "$OUT/peer-$1.log" | cut -c1-300; report "$1"
}
gemm_table() {  # FILE...: `bench --gemm`'s and gemm_peer.py's GEMM lines, one row a shape: every kernel's TFLOP/s but Burn's
  grep -h '^GEMM' "$@" | python3 -c '
import sys, json, collections
rows = collections.OrderedDict()
for line in sys.stdin:
    r = json.loads(line[5:])
    rows.setdefault(r["shape"], {})[r["kernel"]] = r.get("tflops", r.get("error"))
for shape, ks in rows.items():
    print(shape, " ".join(f"{k}={v}" for k, v in ks.items() if k != "burn"))'
}
