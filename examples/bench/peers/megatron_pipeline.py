#!/usr/bin/env python3
"""Megatron Core's own pipeline schedule on the peer model of megatron_llama.py:
the same Llama-style GPTModel (Megatron's local layers, bf16 parameters, PyTorch's fused AdamW),
split over --pp stages (--vpp model chunks a rank: Megatron's interleaved 1F1B), each step one
call of get_forward_backward_func() over --microbatches microbatches of the --batch sequences.
Prints one RESULT line (rank 0; the loss is the last stage's).

  torchrun --standalone --nproc-per-node 2 examples/bench/peers/megatron_pipeline.py \
      --preset llama-8b --pp 2 --batch 8 --microbatches 8      (megatron-core on PYTHONPATH)
  … --vpp 2    (the interleaved schedule; the layers split into pp · vpp chunks)
"""
import argparse
import os
import time

import torch
import torch.nn.functional as F

import common
from common import PRESETS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-8b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    p = dict(PRESETS[args.preset])
    if args.batch:
        p["batch"] = args.batch
    m = args.microbatches or args.pp
    if p["batch"] % m:
        raise SystemExit(f"{p['batch']} sequences do not split into {m} microbatches")
    mbs = p["batch"] // m

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl")
    vpp = args.vpp if args.vpp > 1 else None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    model_parallel_cuda_manual_seed(1234)

    config = TransformerConfig(
        num_layers=p["layers"], hidden_size=p["hidden"], num_attention_heads=p["heads"],
        ffn_hidden_size=p["ffn"], normalization="RMSNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=1, sequence_parallel=False,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=vpp,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    chunks = []
    for vp in range(args.vpp):
        stage = vp if vpp else None
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=p["vocab"], max_sequence_length=p["seq"],
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            position_embedding_type="rope", share_embeddings_and_output_weights=False,
            vp_stage=stage,
        ).cuda())
    params = [q for chunk in chunks for q in chunk.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    # The same tokens on every stage: the first reads the ids, the last the labels.
    gen = torch.Generator(device="cuda").manual_seed(1234)
    tokens = torch.randint(0, p["vocab"], (p["batch"], p["seq"] + 1), device="cuda", generator=gen)
    positions = torch.arange(p["seq"], device="cuda").unsqueeze(0).expand(mbs, -1)
    micro = [dict(ids=tokens[i * mbs:(i + 1) * mbs, :-1].contiguous(),
                  labels=tokens[i * mbs:(i + 1) * mbs, 1:].contiguous()) for i in range(m)]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["ids"], positions, None, labels=batch["labels"])

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    forward_backward = get_forward_backward_func()

    def step():
        iterators = [iter(micro) for _ in chunks]
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if vpp else iterators[0],
            model=chunks, num_microbatches=m, seq_length=p["seq"], micro_batch_size=mbs,
            forward_only=False,
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        return losses

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        losses = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps

    # The mean over the microbatches, from the last stage to every rank.
    local = torch.stack([d["lm loss"] for d in losses]).mean() if losses else torch.zeros((), device="cuda")
    torch.distributed.all_reduce(local)
    import megatron.core as mc
    peak = common.max_over_ranks(torch.cuda.max_memory_allocated(), torch.device("cuda"))
    common.report("megatron-core-local-pp", args.preset, p, dt, local, peak, gpus=args.pp,
                  pp=args.pp, vpp=args.vpp, microbatches=m, megatron_core=getattr(mc, "__version__", "?"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
