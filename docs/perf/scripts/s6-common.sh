# Sourced by the session-6 row scripts: memory sampling and one bench run with its peak memory.
sample() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/mem-$1.csv" & }
peak() { awk -F', ' '{if ($2 > m[$1]) m[$1] = $2} END {for (g in m) printf "gpu%s=%s ", g, m[g]}' "$OUT/mem-$1.csv"; }
run() {  # NAME LIMIT ARGS...: one bench run with its memory sampled
  local name=$1 limit=$2; shift 2
  sample "$name"; local smi=$!
  timeout -s KILL "$limit" bash .gpu/run.sh bench "$@" > "$OUT/bench-$name.log" 2>&1
  kill $smi
  grep -h 'RESULT\|PROFILE\|panicked\|error' "$OUT/bench-$name.log" | cut -c1-400
  echo "$name peak MiB per GPU: $(peak "$name")"
}
peers() {  # NAME LIMIT PRESET WHICH: peers with their memory sampled
  local name=$1 limit=$2; shift 2
  sample "peer-$name"; local smi=$!
  (cd .peers && PEER_TIMEOUT=$((limit - 5)) timeout -s KILL "$limit" bash run_peers.sh "$@" > "$OUT/peers-$name.log" 2>&1)
  kill $smi
  grep -h 'RESULT' "$OUT/peers-$name.log" | cut -c1-400
  echo "peer $name peak MiB per GPU: $(peak "peer-$name")"
}
