#!/usr/bin/env python3
"""Runs the PyTorch peer (peer_torch.py, unchanged) with the CUDA profiler started after its
warm-up steps, so `ncu --profile-from-start off` times exactly its timed steps' kernels.

  cd .peers && ncu --profile-from-start off ... python3 ../docs/perf/scripts/peer_step_ncu.py \
      --preset llama-1b --compile --steps 1

The peer calls torch.cuda.reset_peak_memory_stats once, right after the warm-up's synchronize;
the profiler starts there.
"""
import os
import runpy
import sys

import torch

reset = torch.cuda.reset_peak_memory_stats


def reset_then_profile(*args, **kwargs):
    reset(*args, **kwargs)
    torch.cuda.profiler.start()


torch.cuda.reset_peak_memory_stats = reset_then_profile
sys.argv = ["peer_torch.py", *sys.argv[1:]]
sys.path.insert(0, os.getcwd())  # the peers' `common`, beside peer_torch.py
runpy.run_path("peer_torch.py", run_name="__main__")
