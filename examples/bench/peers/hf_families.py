#!/usr/bin/env python3
"""Hugging Face transformers peer for the model families beyond Llama: the family's transformers
model trained on one GPU as a transformers user would: random initialization, bf16 autocast over
fp32 weights, fused AdamW (lr 1e-4), SDPA attention, --compile on each decoder layer, uniformly
random token ids, next-token cross-entropy over the logits.

  python3 hf_families.py --preset qwen3-1.7b --compile [--batch B] [--seq S]

FLOPs a step: batch x seq x (6 x the matmul parameters a token uses + 6 x layers x seq x heads x
(qk head dim + v head dim)). A token uses the attention projections, its dense MLP or its top-k
routed experts with the shared ones and the router, and the output layer (the input embedding
is a lookup); for a Llama this is the project's formula. MFU is against the dense bf16 peak.
"""
import argparse

import torch
import torch.nn.functional as F
import transformers

import common

# Each preset: the family, the batch and sequence it trains at, and the transformers config.
PRESETS = {
    # Qwen3-1.7B's shape: q/k RMSNorm, 16 query heads over 8 kv heads of 128, tied embeddings.
    "qwen3-1.7b": ("qwen3", 4, 2048, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    # Qwen3-MoE's layout at one GPU's size: 64 experts of ffn 512 in every layer, top 8 normalized.
    "qwen3-moe-2b": ("qwen3_moe", 4, 2048, dict(
        vocab_size=32768, hidden_size=1536, intermediate_size=4096, moe_intermediate_size=512,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.0, tie_word_embeddings=False,
        rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    # DeepSeek-V3's layout at one GPU's size: multi-head latent attention (q rank 768, kv rank
    # 512, qk 128 + 64 rotary, v 128), block 0 dense, then 32 routed experts of ffn 768 (top 4
    # within the best 2 of 4 groups, sigmoid scores) and one shared expert.
    "dsv3-2b": ("deepseek_v3", 4, 2048, dict(
        vocab_size=32768, hidden_size=1536, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=1, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=2.5, norm_topk_prob=True,
        tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=4096)),
}

CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def flops_per_step(c, family, batch, seq):
    h, layers, heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
    if family == "deepseek_v3":
        qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        attention = (h * c.q_lora_rank + c.q_lora_rank * heads * qk  # q down, q up
                     + h * (c.kv_lora_rank + c.qk_rope_head_dim)  # kv down with the shared rotary key
                     + c.kv_lora_rank * heads * (c.qk_nope_head_dim + v)  # k and v up
                     + heads * v * h)  # output projection
        dense = 3 * h * c.intermediate_size
        moe = 3 * h * c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts) + h * c.n_routed_experts
        mlp = c.first_k_dense_replace * dense + (layers - c.first_k_dense_replace) * moe
    else:
        qk = v = c.head_dim
        attention = h * c.head_dim * 2 * (heads + c.num_key_value_heads)  # q, o; k, v
        if family == "qwen3_moe":
            mlp = layers * (3 * h * c.moe_intermediate_size * c.num_experts_per_tok + h * c.num_experts)
        else:
            mlp = layers * 3 * h * c.intermediate_size
    matmul = layers * attention + mlp + c.vocab_size * h
    return batch * seq * (6 * matmul + 6 * layers * seq * heads * (qk + v))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-1.7b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile-steps", action="store_true")
    args = ap.parse_args()
    family, batch, seq, settings = PRESETS[args.preset]
    batch, seq = args.batch or batch, args.seq or seq
    config_class, model_class = (getattr(transformers, name) for name in CLASSES[family])
    config = config_class(**settings, attn_implementation="sdpa")
    device = common.local_device(args)
    torch.manual_seed(0)
    model = model_class(config).to(device=device, dtype=torch.float32).train()
    if args.compile:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    p = dict(batch=batch, seq=seq, vocab=config.vocab_size)
    inputs, labels = common.random_tokens(p, device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    seconds, loss, peak = common.timed_steps(step, args, device)
    common.report("transformers" + ("+compile" if args.compile else ""), args.preset, p, seconds, loss, peak,
                  flops=flops_per_step(config, family, batch, seq), family=family,
                  params=sum(w.numel() for w in model.parameters()), transformers=transformers.__version__)


if __name__ == "__main__":
    main()
