#!/usr/bin/env bash
# One H200 (carry .gpu with generate and gpu-suite): decoding with the step replayed as a CUDA
# graph beside the eager step (`--eager`) and transformers' `generate` (static cache +
# torch.compile, `examples/generate/peer.py`), on SmolLM2-135M and llama-1b shapes at batch 1 and
# 32, 128 prompt tokens, 128 new tokens, greedy, in one call. Logs: $OUT/{suite,gen,peer}.log.
#   generate-graph.sh [suite] [peers] [ncu]   suite: the decoding kernels' and models' tests
#                                             first; peers: transformers after each of our
#                                             pairs; ncu: then every kernel of eager llama-1b
#                                             steps at batch 32 timed by ncu, summed by name
set -u
cd "$(dirname "$0")/../../.."
case " $* " in *" suite "*)
  for test in decode_step graph_replay greedy_choice skinny_gemm; do
    timeout -s KILL 60 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite::$test >> "$OUT/suite.log" 2>&1
  done
  timeout -s KILL 120 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter decoding >> "$OUT/suite.log" 2>&1
  grep -h '^test\|passed' "$OUT/suite.log" | cut -c1-400 ;;
esac
for preset in smollm2-135m llama-1b; do
  for batch in 1 32; do
    for flag in "" --eager; do
      timeout -s KILL 120 bash .gpu/run.sh generate --preset $preset --device cuda --batch $batch \
        --prompt-len 128 --max-new 128 $flag >> "$OUT/gen.log" 2>&1
    done
    case " $* " in *" peers "*)
      timeout -s KILL 100 python3 examples/generate/peer.py $preset $batch 128 128 >> "$OUT/peer.log" 2>&1 ;;
    esac
  done
done
grep -h 'RESULT\|panicked\|rror' "$OUT/gen.log" "$OUT/peer.log" 2>/dev/null | cut -c1-400
case " $* " in *" ncu "*)
  timeout -s KILL 120 ncu --clock-control none --target-processes all --metrics gpu__time_duration.sum -c 8000 \
    bash .gpu/run.sh generate --preset llama-1b --device cuda --batch 32 --prompt-len 128 --max-new 4 --eager \
    > "$OUT/ncu.log" 2>&1
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$OUT/ncu.log" | paste - - | awk '{print $1, $2, $3, $4, $NF}' \
    | sed 's/_[0-9a-f]\{8\} / /' \
    | awk '{k=$1" "$2" "$3" "$4; t[k]+=$5; c[k]++} END {for (n in t) printf "%10.1f %5d %8.1f  %s\n", t[n], c[n], t[n]/c[n], n}' \
    | sort -rn | head -30 > "$OUT/ncu-summary.txt"
  rm -f "$OUT/ncu.log"; cat "$OUT/ncu-summary.txt" ;;
esac
