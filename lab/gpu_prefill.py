"""Prompt forwards on a CUDA device, three ways: the 9-row step graph replayed chunk by chunk, one forward of the
compiled step (torch.compile, dynamic shapes), one eager forward. Random weights of a real shape: systems numbers.

    python lab/gpu_prefill.py [--shape qwen2.5-1.5b] [--lengths 9,18,27,45,64,125,448]

Prints milliseconds a forward (median of 10 after a warm-up; the compiled step's first call, its compilation, is
printed apart).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.backends.torch_graphs import GRAPH_ROWS
from tandem.backends.torch_sequence import TorchSequence
from tandem.synthetic.shapes import random_model


def timed_ms(fn, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-1.5b")
    p.add_argument("--lengths", default="9,18,27,45,64,125,448")
    args = p.parse_args()
    model = random_model(args.shape, device="cuda", dtype="bfloat16", n_ctx=4096)
    seq = TorchSequence(model, 4096, GRAPH_ROWS)  # captures the step graphs (and compiles the step for 9 rows)
    k, v = seq.cache.k, seq.cache.v
    device = model.torch_device

    def graphs(tokens):
        for start in range(0, len(tokens), GRAPH_ROWS):
            seq.graphs.run(tokens[start : start + GRAPH_ROWS], start, last_only=True)

    def one_forward(forward, tokens):
        positions = torch.arange(len(tokens), device=device)
        forward(tokens, positions, k, v, kv_len=len(tokens), last_only=True)

    print(f"{torch.cuda.get_device_name()}: {args.shape}, synthetic weights", flush=True)
    with torch.inference_mode():
        for n in (int(x) for x in args.lengths.split(",")):
            tokens = torch.randint(0, 1000, (n,), device=device)
            started = time.perf_counter()
            one_forward(model.step, tokens)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - started
            one_forward(model.transformer.forward, tokens)
            row = {"graph chunks": timed_ms(lambda t=tokens: graphs(t)),
                   "compiled": timed_ms(lambda t=tokens: one_forward(model.step, t)),
                   "eager": timed_ms(lambda t=tokens: one_forward(model.transformer.forward, t))}
            cells = "  ".join(f"{name} {ms:.2f} ms" for name, ms in row.items())
            print(f"n={n:4d}  {cells}  (compiled step's first call {first_s:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
