#!/usr/bin/env python3
"""The loss transformers finds for a Hugging Face export on the held-out chats of a dataset
that `prepare-data` wrote: the mean over the assistant's tokens of the last N conversations
(what `train`'s evaluation reads with `data.held_out` holding those N out and one global batch
of N unpacked samples).

    scripts/export-loss.py EXPORT_DIR DATA_PREFIX --documents N --seq S [--dtype bfloat16]

Each conversation is cut to `S + 1` tokens, as `train` cuts an unpacked sample of `data.seq` S.

Reads Megatron's indexed format (`PREFIX.idx`/`.bin`, and the loss mask `PREFIX-mask`) itself:
the GPU machine has no megatron-core.
"""
import argparse
import struct

import numpy as np
import torch
from transformers import AutoModelForCausalLM

# Megatron's dtype codes (`megatron/core/datasets/indexed_dataset.py`).
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def documents(prefix):
    """Every document of an indexed dataset, as arrays."""
    with open(prefix + ".idx", "rb") as f:
        header = f.read(9 + 8 + 1 + 8 + 8)
    magic, version, code, sequences, docs = struct.unpack("<9sQBQQ", header)
    assert magic == b"MMIDIDX\x00\x00" and version == 1, f"{prefix}.idx: not Megatron's index"
    index = np.memmap(prefix + ".idx", mode="r", offset=len(header))
    sizes = np.frombuffer(index, dtype=np.int32, count=sequences)
    pointers = np.frombuffer(index, dtype=np.int64, count=sequences, offset=4 * sequences)
    bounds = np.frombuffer(index, dtype=np.int64, count=docs, offset=12 * sequences)
    data = np.memmap(prefix + ".bin", mode="r", dtype=DTYPES[code])
    item = np.dtype(DTYPES[code]).itemsize

    def sequence(i):
        start = pointers[i] // item
        return np.array(data[start : start + sizes[i]])

    return [np.concatenate([sequence(s) for s in range(bounds[d], bounds[d + 1])]) for d in range(docs - 1)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export")
    parser.add_argument("prefix")
    parser.add_argument("--documents", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True, help="the job's data.seq")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    tokens = documents(args.prefix)[-args.documents :]
    masks = documents(args.prefix + "-mask")[-args.documents :]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.export, dtype=getattr(torch, args.dtype)).to(device).eval()
    total, counted = 0.0, 0
    with torch.no_grad():
        for ids, mask in zip(tokens, masks):
            ids, mask = ids[: args.seq + 1], mask[: args.seq + 1]
            ids = torch.tensor(ids.astype(np.int64), device=device)
            labels = ids[1:].clone()
            labels[torch.tensor(mask[1:] == 0, device=device)] = -100
            logits = model(ids[None, :-1]).logits[0].float()
            losses = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            total += losses.item()
            counted += int((labels != -100).sum())
    print(f"transformers loss {total / counted:.6f} over {counted} assistant tokens of {len(tokens)} chats")


if __name__ == "__main__":
    main()
