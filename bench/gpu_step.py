"""Time one graphed decode step of random-weight models of real shapes, per variant, on a CUDA device.

    python bench/gpu_step.py [--variants qwen2.5-1.5b:1:17,qwen2.5-0.5b:1:2]   # shape:compile:rows

For each shape: weight bytes, the byte floor (bytes / measured copy bandwidth), and the median time of one forward
of n tokens replayed as a CUDA graph of `rows` rows, eager and compiled. Synthetic weights: systems numbers only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def copy_bandwidth_gb_s(device: str) -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    del x, y
    return 2 * 2 * 1024**3 / seconds / 1e9  # bytes read + written


def time_step(model, rows: int, n: int, repeats: int = 50) -> float:
    from tandem.backends import torch_backend

    seq = torch_backend.TorchSequence(model, 4096, rows)
    seq.forward(list(range(1, 17)), logits="last")
    base = seq.length
    times = []
    for i in range(repeats + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        seq.forward(list(range(n)), logits="all")
        end.record()
        torch.cuda.synchronize()
        seq.rewind(base)
        if i >= 5:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="qwen2.5-1.5b:0:17,qwen2.5-1.5b:1:17,qwen2.5-1.5b:1:1,qwen2.5-0.5b:1:2")
    args = p.parse_args()
    from tandem.models.shapes import random_model, weight_bytes

    bandwidth = copy_bandwidth_gb_s("cuda")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth:.0f} GB/s (read + write)", flush=True)
    for variant in args.variants.split(","):
        shape, compiled, rows = variant.split(":")
        rows = int(rows)
        os.environ["TANDEM_COMPILE"] = compiled
        started = time.perf_counter()
        model = random_model(shape, device="cuda", dtype="bfloat16", n_ctx=4096)
        nbytes = weight_bytes(model) - model.config.vocab_size * model.config.d_model * 2 * (
            0 if model.config.tied_embeddings else 1)  # the input embedding is gathered, not streamed
        floor_ms = nbytes / bandwidth / 1e6
        ns = sorted({1, min(rows, 2), rows})
        ms = {n: time_step(model, rows, n) for n in ns}
        cells = "  ".join(f"n={n}: {v:.3f} ms" for n, v in ms.items())
        print(f"{shape:14s} compile={compiled} rows={rows:2d}  {cells}  | floor {floor_ms:.3f} ms "
              f"({nbytes / 1e9:.2f} GB), step/floor {ms[1] / floor_ms:.2f}  [{time.perf_counter() - started:.0f} s]",
              flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
