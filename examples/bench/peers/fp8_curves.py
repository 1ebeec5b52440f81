"""FP8's loss gap to bf16 in PyTorch, beside ours: is FP8 tensorwise's gap on the plays the
format's at this size, or our implementation's? llama-1b (torch_llama.py's Llama) trained as
`scripts/gpu/rows.sh curves` trains ours (`train --preset llama-1b --data shakespeare.txt
--batch 1 --steps 300 --lr 3e-4 --seed N`): byte tokens, the windows `Corpus::window` draws for
each step, bf16 autocast over fp32 master weights, AdamW (0.9, 0.999, 1e-8, weight decay 0.01,
no clipping), weights drawn normal(0, 0.02) from the seed; then the same with torchao float8 tensorwise on the block
linears (the output layer bf16), as torch_fp8.py converts them. Eager, no torch.compile: the
numbers, not the speed. One line a run: the mean loss over its last 20 steps.

  python3 examples/bench/peers/fp8_curves.py --data data/shakespeare.txt [--seeds 1 2 3] [--steps 300]
      (torchao 0.18 on PYTHONPATH)
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

MASK = (1 << 64) - 1


def window_start(step, index, seq, n):
    """`Corpus::window`'s start for sequence `index` of `step` (u64 arithmetic; pinned against
    the Rust by `examples/train/data.rs`'s `window_starts_match_the_peer_script`)."""
    h = ((step * 0x9E3779B97F4A7C15) & MASK) ^ ((index * 0xBF58476D1CE4E5B9) & MASK)
    h ^= h >> 29
    return h % (n - seq - 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--recipes", nargs="+", default=["bf16", "float8-tensorwise"])
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; runs that would start later are skipped")
    args = ap.parse_args()
    from common import PRESETS
    from torch_llama import Llama

    p = dict(PRESETS["llama-1b"])
    seq = p["seq"]
    # `Corpus::from_path` on one file: its bytes, then a newline.
    tokens = torch.tensor(list(open(args.data, "rb").read() + b"\n"), dtype=torch.long)
    starts = [window_start(step, 0, seq, len(tokens)) for step in range(1, args.steps + 1)]
    windows = torch.stack([tokens[s:s + seq + 1] for s in starts]).cuda()
    began = time.time()
    for seed in args.seeds:
        for recipe in args.recipes:
            if time.time() - began > args.budget:
                print(json.dumps({"recipe": recipe, "seed": seed, "skipped": "no time left"}), flush=True)
                continue
            torch.manual_seed(seed)
            model = Llama(p).cuda()
            with torch.no_grad():
                for m in model.modules():
                    if isinstance(m, (nn.Linear, nn.Embedding)):
                        m.weight.normal_(0.0, 0.02)
            if recipe == "float8-tensorwise":
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training
                from torch_fp8 import float8_filter
                convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                           module_filter_fn=float8_filter)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                    weight_decay=0.01, fused=True)
            losses = []
            start = time.time()
            for step in range(args.steps):
                inputs, labels = windows[step:step + 1, :-1], windows[step:step + 1, 1:]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
            losses = [float(x) for x in losses]
            print(json.dumps({
                "recipe": recipe, "seed": seed, "steps": args.steps,
                "last20_mean": round(sum(losses[-20:]) / 20, 4),
                "at": {s: round(losses[s - 1], 4) for s in (1, 100, 200, 300) if s <= args.steps},
                "seconds": round(time.time() - start, 1),
                "torch": torch.__version__,
            }), flush=True)
            print("LOSSES " + json.dumps({"recipe": recipe, "seed": seed, "losses": [round(x, 4) for x in losses]}),
                  flush=True)
            del model, opt


if __name__ == "__main__":
    main()
