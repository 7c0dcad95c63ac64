"""The logits projection: tandem's row-invariant kernel (fused_projections.norm_logits) against rms_norm + cuBLAS,
on a CUDA device, for a 1.5B/0.5B vocabulary (151936 x d_model, bf16): median us per call by CUDA graph replay.

    python lab/gpu_logits.py [--d 1536] [--rows 1,9,16,64,144,576]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def graph_us(fn, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 100)  # ms for 10 calls -> us a call
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", default="1,9,16,64,144,576")
    p.add_argument("--block-rows", type=int, default=0, help="fused_projections.BLOCK_ROWS to use instead")
    args = p.parse_args()
    from tandem.models import fused_projections as fp

    if args.block_rows:
        fp.BLOCK_ROWS = args.block_rows
        print(f"fused_projections.BLOCK_ROWS = {args.block_rows}")
    from tandem.models.transformer import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(args.vocab, args.d, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    norm = torch.ones(args.d, dtype=torch.bfloat16, device="cuda")
    print(f"logits projection [{args.vocab} x {args.d}] bf16 ({weight.nbytes / 1e6:.0f} MB); synthetic weights")
    for n in (int(r) for r in args.rows.split(",")):
        x = torch.randn(n, args.d, device="cuda", generator=gen).to(torch.bfloat16)
        sum_sq = x.float().pow(2).sum(-1)[None].contiguous()
        rows = torch.arange(n, device="cuda")
        out = torch.empty(n, args.vocab, device="cuda")
        ours = graph_us(lambda: fp.norm_logits(x, sum_sq, rows, norm, 1e-6, weight, out))  # noqa: B023
        cublas = graph_us(lambda: F.linear(rms_norm(x, norm, 1e-6), weight).float())  # noqa: B023
        print(f"rows {n:4d}: norm_logits {ours:7.1f} us ({weight.nbytes / ours / 1e6:.2f} TB/s)   "
              f"rms_norm + cuBLAS + float {cublas:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
