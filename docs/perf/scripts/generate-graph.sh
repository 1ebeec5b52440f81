#!/usr/bin/env bash
# One H200 (carry .gpu with generate and gpu-suite): decoding with the step replayed as a CUDA
# graph beside the eager step (`--eager`) and transformers' `generate` (static cache +
# torch.compile, `examples/generate/peer.py`), on SmolLM2-135M and llama-1b shapes at batch 1 and
# 32, 128 prompt tokens, 128 new tokens, greedy, in one call. Logs: $OUT/{suite,gen,peer}.log.
#   generate-graph.sh [suite] [peers]   suite: the kernel suite and the decoding tests first;
#                                       peers: transformers after each of our pairs
set -u
cd "$(dirname "$0")/../../.."
case " $* " in *" suite "*)
  timeout -s KILL 200 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite > "$OUT/suite.log" 2>&1
  timeout -s KILL 200 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter decod >> "$OUT/suite.log" 2>&1
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
