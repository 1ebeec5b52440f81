#!/usr/bin/env python3
"""PyTorch + torchao float8 peer: torch_llama's model trained with torchao 0.18's float8 linears,
as torchtitan trains it.

Every block linear becomes a torchao Float8Linear with dynamic scaling (--recipe tensorwise, one
scale a tensor, or rowwise); the output layer stays bf16. Otherwise `torch_llama.py --compile`:
bf16 autocast over fp32 master weights, fused AdamW, SDPA, each block compiled (always: float8
without compile is slow). --tp N (torchrun): torch_llama's tensor + sequence parallel plan after
the conversion, with torchao's float8 styles in the blocks for tensorwise (activations gathered
in float8), plain styles for rowwise. FLOPs count as bf16's and MFU divides by the bf16 peak.
Needs torchao 0.18 importable (scripts/gpu/rows.sh installs it from the carried wheel).

  python3 torch_fp8.py --preset llama-1b [--recipe rowwise]
  torchrun --standalone --nproc-per-node 2 torch_fp8.py --preset llama-8b --tp 2
"""
import sys

import torch
import torch.nn as nn

import common
from torch_llama import Llama, adamw, compile_blocks, tensor_parallel, training_step

try:
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
except ImportError as error:
    sys.exit(f"torch_fp8: torchao is not importable ({error}): carry the torchao 0.18.0 wheel")


def float8_filter(module, name):
    """torchtitan's filter: the float8 GEMMs need both dimensions divisible by 16, and the output
    layer stays in bf16."""
    return (isinstance(module, nn.Linear) and name != "output"
            and all(d % 16 == 0 for d in module.weight.shape))


def main():
    ap = common.arguments(__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    p = common.preset(args)
    if (p["hidden"] // args.tp) % 16 or (p["ffn"] // args.tp) % 16:
        sys.exit(f"torch_fp8: {args.preset} at tp {args.tp} has shards not divisible by 16")
    device = common.local_device(args)
    if torch.cuda.get_device_capability(device) < (8, 9):
        sys.exit("torch_fp8: float8 GEMMs need a GPU of compute capability 8.9 or later")
    torch.manual_seed(0)

    mesh = None
    if args.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (args.tp,))

    model = Llama(p).to(device)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(args.recipe),
                               module_filter_fn=float8_filter)
    if args.recipe == "rowwise":
        # As torchtitan does for rowwise scaling: the compiled casts round as eager ones do.
        from torch._inductor import config as inductor_config
        inductor_config.emulate_precision_casts = True
    if mesh is not None:
        tensor_parallel(model, mesh, float8=args.recipe == "tensorwise")
    compile_blocks(model)
    opt = adamw(model, device, dtensor=mesh is not None)
    if common.rank() == 0:
        count = sum(isinstance(m, Float8Linear) for m in model.modules())
        print(f"torch_fp8: torchao {torchao.__version__}, {args.recipe}, {count} float8 linears", flush=True)

    inputs, labels = common.random_tokens(p, device)
    step = training_step(model, opt, inputs, labels, device, vocab_parallel=mesh is not None)
    seconds, loss, peak = common.timed_steps(step, args, device)
    common.report(f"pytorch+compile+float8-{args.recipe}", args.preset, p, seconds, loss,
                  common.max_over_ranks(peak, device), gpus=args.tp, tp=args.tp)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
