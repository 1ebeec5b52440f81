#!/usr/bin/env python3
"""Megatron Core peer: the benchmark Llama built with Megatron Core 0.19 (the megatron-core
wheel) from its own layers only: the "local" spec, no Transformer Engine, no Apex.

GPTModel with RMSNorm, SwiGLU, RoPE, no biases, untied output layer; bf16 parameters (Megatron's
bf16 mode), PyTorch's fused AdamW at lr 1e-4; --tp N (torchrun, N GPUs) Megatron's tensor
parallelism. Without Apex or Transformer Engine the local RMSNorm refuses sequence parallelism,
so tp runs without it. The model pieces are shared by megatron_moe.py.

  torchrun --standalone --nproc-per-node 1 megatron_llama.py --preset llama-1b
  torchrun --standalone --nproc-per-node 2 megatron_llama.py --preset llama-1b --tp 2
"""
import torch
import torch.nn.functional as F

import common


def transformer_config(p, **parallel):
    """Megatron's config for preset p, every fusion that needs Apex or TE off; a preset with
    experts gets MoE layers (softmax top-k router in fp32, Switch aux loss 1e-2, all-to-all
    dispatch, experts as a loop of SwiGLU MLPs)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    moe = {}
    if "experts" in p:
        moe = dict(num_moe_experts=p["experts"], moe_router_topk=p["topk"], moe_ffn_hidden_size=p["ffn"],
                   moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                   moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", moe_grouped_gemm=False)
    return TransformerConfig(
        num_layers=p["layers"], hidden_size=p["hidden"], num_attention_heads=p["heads"],
        ffn_hidden_size=p["ffn"], normalization="RMSNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=False,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        **moe, **parallel)


def gpt_model(p, config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    spec = get_gpt_layer_local_spec(num_experts=p.get("experts"), moe_grouped_gemm=False, normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=p["vocab"],
                    max_sequence_length=p["seq"], position_embedding_type="rope",
                    share_embeddings_and_output_weights=False).cuda()


def start(args, **sizes):
    """The process group, Megatron's parallel state of `sizes`, and its seeded RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    device = common.local_device(args)
    torch.distributed.init_process_group("nccl")
    parallel_state.initialize_model_parallel(**sizes)
    model_parallel_cuda_manual_seed(1234)
    return device


def positions(p):
    return torch.arange(p["seq"], device="cuda").unsqueeze(0).expand(p["batch"], -1)


def version():
    import megatron.core
    return getattr(megatron.core, "__version__", "?")


def main():
    ap = common.arguments(__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    p = common.preset(args)
    device = start(args, tensor_model_parallel_size=args.tp)
    model = gpt_model(p, transformer_config(p, tensor_model_parallel_size=args.tp))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inputs, labels = common.random_tokens(p, device)  # the same on every tensor-parallel rank
    where = positions(p)

    def step():
        loss = model(inputs, where, None, labels=labels).float().mean()  # the model returns each token's loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    seconds, loss, peak = common.timed_steps(step, args, device)
    common.report("megatron-core-local", args.preset, p, seconds, loss, common.max_over_ranks(peak, device),
                  gpus=args.tp, tp=args.tp, megatron_core=version())
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
