"""Where a decode step's GPU time goes: per-kernel CUDA time of forwards of a random-weight model (profiler).

    python lab/gpu_profile.py SHAPE ROWS COMPILED [SPAN]   # e.g. qwen2.5-1.5b 1 1 1024 (cache slots attended)
"""

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from tandem.backends import torch_sequence
from tandem.synthetic.shapes import random_model

shape, rows, compiled = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
span = int(sys.argv[4]) if len(sys.argv) > 4 else 256
os.environ["TANDEM_COMPILE"] = "1" if compiled else "0"
model = random_model(shape, device="cuda", dtype="bfloat16", n_ctx=4096)
seq = torch_sequence.TorchSequence(model, 4096, rows, graphs=False)
cache = seq.cache
tokens = torch.arange(rows, device="cuda")
positions = torch.arange(16, 16 + rows, device="cuda")
with torch.inference_mode():
    for _ in range(3):
        model.step(tokens, positions, cache.k, cache.v, span)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            model.step(tokens, positions, cache.k, cache.v, span)
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))
