#!/usr/bin/env python3
"""Reads `examples/ptq --export DIR`'s compressed-tensors checkpoint without our code: each block
linear's F8_E4M3 / I8 codes times `weight_scale` into transformers' LlamaForCausalLM (f32), each
input through its static `input_scale` (or its own per-token scale, or one scale a tile of
`group_size` features, the last tile ragged) by a forward pre-hook, and prints the perplexity on
the held-out tenth of the text over the windows `examples/ptq` uses.

    python3 check_compressed.py DIR shakespeare.txt [--windows 64] [--seq 512]
"""
import argparse
import json
import math
import os

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("text")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    a = p.parse_args()
    raw = json.load(open(os.path.join(a.dir, "config.json")))
    scheme = raw.pop("quantization_config")
    group = scheme["config_groups"]["group_0"]
    fp8 = group["weights"]["type"] == "float"
    inputs = group["input_activations"]
    tensors = load_file(os.path.join(a.dir, "model.safetensors"))
    state, input_scales = {}, {}
    for name, t in tensors.items():
        if name.endswith("weight_scale") or name.endswith("input_scale"):
            continue
        stem = name[: -len(".weight")]
        if stem + ".weight_scale" in tensors:
            t = t.float() * tensors[stem + ".weight_scale"].float()
            if stem + ".input_scale" in tensors:
                input_scales[stem] = tensors[stem + ".input_scale"].float().item()
        state[name] = t.float()
    model = LlamaForCausalLM(LlamaConfig(**raw)).float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    top = 448.0 if fp8 else 127.0

    def fake(x, scale):
        y = (x / scale).clamp(-top, top)
        y = y.to(torch.float8_e4m3fn).float() if fp8 else torch.round(y)
        return y * scale

    def tiled(x, g):
        n = x.shape[-1]
        padded = torch.nn.functional.pad(x, (0, -n % g)).unflatten(-1, (-1, g))
        scale = padded.abs().amax(-1, keepdim=True).clamp_min(1e-30) / top
        return fake(padded, scale).flatten(-2)[..., :n]

    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head" or inputs is None:
            continue
        if inputs["strategy"] == "tensor":
            s = input_scales[name]
            module.register_forward_pre_hook(lambda m, x, s=s: (fake(x[0], s),))
        elif inputs["strategy"] == "group":
            g = inputs["group_size"]
            module.register_forward_pre_hook(lambda m, x, g=g: (tiled(x[0], g),))
        else:
            module.register_forward_pre_hook(
                lambda m, x: (fake(x[0], x[0].abs().amax(-1, keepdim=True).clamp_min(1e-30) / top),))
    model = model.cuda().eval()
    text = open(a.text, "rb").read()
    cut = len(text) - len(text) // 10
    while cut > 0 and (text[cut] & 0xC0) == 0x80:
        cut -= 1
    ids = Tokenizer.from_file(os.path.join(a.dir, "tokenizer.json")).encode(
        text[cut:].decode(), add_special_tokens=False).ids
    stride = max((len(ids) - (a.seq + 1)) // a.windows, 1)
    losses = []
    with torch.no_grad():
        for w in range(a.windows):
            chunk = torch.tensor(ids[w * stride: w * stride + a.seq + 1], device="cuda")[None]
            logits = model(chunk[:, :-1]).logits.float()
            losses.append(torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:]).item())
    print(f"transformers on {a.dir}: perplexity {math.exp(sum(losses) / len(losses)):.3f} "
          f"({len(losses)} windows of {a.seq} tokens, f32, {len(input_scales)} static input scales)")


if __name__ == "__main__":
    main()
