"""Decode speed of Hugging Face transformers' `generate`, the peer of `generate --preset`: the
same shape with random bf16 weights, random prompt ids, greedy decoding of a fixed number of
tokens, a static KV cache, which makes `generate` compile its decoding step itself
(transformers' automatic `torch.compile` of the static-cache forward), as transformers
recommends for speed.

    python3 examples/bench/peers/decode.py PRESET BATCH PROMPT_LEN NEW     -> one RESULT line

Two warm-up generations (compilation), then a one-token generation (the prefill) and a full
one, each synchronized: decode time is their difference over NEW - 1 steps.
"""
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "llama-1b": dict(vocab_size=32768, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=16, rope_theta=1e4,
                     max_position_embeddings=2048),
}


def main():
    preset, batch, prompt_len, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    shape = SHAPES[preset]
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(rms_norm_eps=1e-5, **shape)).to(torch.bfloat16).cuda().eval()
    ids = torch.randint(0, shape["vocab_size"], (batch, prompt_len), device="cuda")
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=False, cache_implementation="static", pad_token_id=0, attention_mask=mask)

    def timed(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(2):
        timed(new)
    prefill = timed(1)
    total = timed(new)
    decode = max(total - prefill, 1e-9)
    print("RESULT " + json.dumps({
        "peer": "transformers-static-compile", "preset": preset, "batch": batch, "prompt": prompt_len,
        "new": new, "prefill_tokens_per_s": round(batch * prompt_len / prefill),
        "decode_tokens_per_s": round(batch * (new - 1) / decode),
        "decode_ms_per_step": round(decode * 1e3 / (new - 1), 2)}))


if __name__ == "__main__":
    main()
