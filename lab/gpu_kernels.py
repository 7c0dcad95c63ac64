"""Sweep tandem.models.fused_projections' launch configurations against the unfused projections they replace.

    python lab/gpu_kernels.py [--shapes qwen2.5-1.5b,qwen2.5-0.5b] [--rows 9]

Each variant runs for every layer of the shape, each layer with its own weights (cold in L2, as in a real step),
captured in one CUDA graph; printed: microseconds a layer, median of replays. Synthetic weights: systems numbers.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
from unittest import mock

import torch
import torch.nn.functional as F

from tandem.models import fused_projections as fp
from tandem.models.transformer import apply_rope, rope_tables
from tandem.synthetic.shapes import get_shape


def graph_us(fn, n_layers: int, replays: int = 30) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / n_layers)
    return statistics.median(times)


def sweep(name: str, T: int) -> None:
    dev, dt = "cuda", torch.bfloat16
    c = get_shape(name)
    L, d, H, Hkv, D, Fd = c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ffn
    qkv_w = [torch.randn((H + 2 * Hkv) * D, d, device=dev, dtype=dt) * 0.02 for _ in range(L)]
    qkv_b = [torch.randn((H + 2 * Hkv) * D, device=dev, dtype=dt) * 0.02 for _ in range(L)]
    gu_w = [torch.randn(2 * Fd, d, device=dev, dtype=dt) * 0.02 for _ in range(L)]
    ck = [torch.zeros(1, Hkv, 1024, D, device=dev, dtype=dt) for _ in range(L)]
    cv = [torch.zeros(1, Hkv, 1024, D, device=dev, dtype=dt) for _ in range(L)]
    x = torch.randn(T, d, device=dev, dtype=dt)
    sum_sq = fp.sum_squares(x)  # the fused kernels normalise x
    rope = rope_tables(c, c.rope_base, 1.0, 1100, dt, dev)
    positions = torch.arange(300, 300 + T, device=dev)

    @torch.compile(dynamic=False)
    def qkv_unfused(x, w, b, k_cache, v_cache):
        qkv = F.linear(x, w) + b
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = (t.view(1, T, -1, D).transpose(1, 2) for t in (q, k, v))
        cos, sin = rope[:, positions]
        k_cache.index_copy_(2, positions, apply_rope(k, cos, sin, False))
        v_cache.index_copy_(2, positions, v)
        return apply_rope(q, cos, sin, False)

    @torch.compile(dynamic=False)
    def gate_up_unfused(x, w):
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(gate) * up

    def each_layer(fn):
        return lambda: [fn(i) for i in range(L)]

    print(f"{name}: T={T}, {torch.cuda.get_device_name()}", flush=True)
    base = graph_us(each_layer(lambda i: qkv_unfused(x, qkv_w[i], qkv_b[i], ck[i], cv[i])), L)
    gemm = graph_us(each_layer(lambda i: F.linear(x, qkv_w[i])), L)
    print(f"  qkv unfused (compiled): {base:.2f} us/layer; its GEMM alone {gemm:.2f}", flush=True)
    results = []
    for pairs, bk, warps, stages in itertools.product((8, 16), (128, 256), (2, 4), (3, 4)):
        if (D // 2) % pairs:
            continue
        fp.QKV_PAIRS, fp.QKV_BLOCK_K, fp.QKV_LAUNCH = pairs, bk, dict(num_warps=warps, num_stages=stages)
        try:
            us = graph_us(each_layer(lambda i: fp.qkv_rope(x, sum_sq, 1e-6, qkv_w[i], qkv_b[i], rope,
                                                            positions, ck[i], cv[i], H, False)), L)
        except Exception as e:  # a configuration that does not compile (shared memory)
            print(f"  qkv pairs={pairs} bk={bk} w={warps} s={stages}: {type(e).__name__}", flush=True)
            continue
        results.append((us, f"pairs={pairs} bk={bk} warps={warps} stages={stages}"))
    for us, cfg in sorted(results)[:6]:
        print(f"  qkv fused {cfg}: {us:.2f} us/layer ({base / us:.2f}x)", flush=True)

    base = graph_us(each_layer(lambda i: gate_up_unfused(x, gu_w[i])), L)
    gemm = graph_us(each_layer(lambda i: F.linear(x, gu_w[i])), L)
    print(f"  gate_up unfused (compiled): {base:.2f} us/layer; its GEMM alone {gemm:.2f}; "
          f"bytes floor at 4.25 TB/s {2 * Fd * d * 2 / 4.25e6:.2f}", flush=True)
    results = []
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4)):
        fp.GATE_UP_BLOCK_N, fp.GATE_UP_BLOCK_K = bn, bk
        fp.GATE_UP_LAUNCH = dict(num_warps=warps, num_stages=stages)
        try:
            us = graph_us(each_layer(lambda i: fp.gate_up_act(x, sum_sq, 1e-6, gu_w[i], False)), L)
        except Exception as e:
            print(f"  gate_up bn={bn} bk={bk} w={warps} s={stages}: {type(e).__name__}", flush=True)
            continue
        results.append((us, f"bn={bn} bk={bk} warps={warps} stages={stages}"))
    for us, cfg in sorted(results)[:6]:
        print(f"  gate_up fused {cfg}: {us:.2f} us/layer ({base / us:.2f}x)", flush=True)


def sweep_split_k(name: str, T: int) -> None:
    """The output and down projections with the residual add and the sums of squares after them (what the next
    layer's fused norm reads): compiled cuBLAS + elementwise against add_linear_split_k's configurations."""
    dev, dt = "cuda", torch.bfloat16
    c = get_shape(name)
    L, d, Fd, q_width = c.n_layers, c.d_model, c.d_ffn, c.n_heads * c.head_dim
    residual = torch.randn(T, d, device=dev, dtype=dt)

    @torch.compile(dynamic=False)
    def unfused(x, w, residual):
        out = residual + F.linear(x, w)
        return out, fp.sum_squares(out)

    for what, k in (("o", q_width), ("down", Fd)):
        ws = [torch.randn(d, k, device=dev, dtype=dt) * 0.02 for _ in range(L)]
        x = torch.randn(T, k, device=dev, dtype=dt)

        def each_layer(fn, x=x, ws=ws):
            return lambda: [fn(x, ws[i]) for i in range(L)]

        base = graph_us(each_layer(lambda x, w: unfused(x, w, residual)), L)

        def split_k_us(each_layer=each_layer) -> float:  # under fp's constants as they stand
            arrivals = torch.zeros(fp.split_k_tiles(d), dtype=torch.int32, device=dev)
            return graph_us(each_layer(lambda h, w: fp.add_linear_split_k(h, w, residual, arrivals)), L)

        results = []
        for slices, bn, (bk, stages) in itertools.product((3, 4, 6, 8, 12), (32, 64), ((128, 4), (64, 4))):
            fp.SPLIT_SLICES, fp.SPLIT_MIN_SLICE, fp.SPLIT_BLOCK_N, fp.SPLIT_BLOCK_K = slices, 1, bn, bk
            fp.SPLIT_LAUNCH = dict(num_warps=4, num_stages=stages)
            try:
                us = split_k_us()
            except Exception as e:
                print(f"  {what} slices={slices} bn={bn} bk={bk} s={stages}: {type(e).__name__}", flush=True)
                continue
            results.append((us, (fp.k_slices(k)[0], bn, bk, stages)))
        print(f"  {what} ({d}x{k}) + residual + sums of squares: cuBLAS + compiled {base:.2f} us/layer; "
              f"bytes floor at 4.25 TB/s {d * k * 2 / 4.25e6:.2f}", flush=True)
        for us, (slices, bn, bk, stages) in sorted(results)[:6]:
            print(f"  {what} add_linear_split_k slices={slices} bn={bn} bk={bk} stages={stages}: {us:.2f} us/layer "
                  f"({base / us:.2f}x)", flush=True)
        _, (slices, bn, bk, stages) = min(results)
        fp.SPLIT_SLICES, fp.SPLIT_BLOCK_N, fp.SPLIT_BLOCK_K = slices, bn, bk
        fp.SPLIT_LAUNCH = dict(num_warps=4, num_stages=stages)
        with mock.patch.dict(os.environ, {"TANDEM_PDL": "0"}):  # then as the caller set it, for later sweeps
            print(f"  {what} the best without PDL: {split_k_us():.2f} us/layer", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-0.5b")
    p.add_argument("--rows", type=int, default=9)
    p.add_argument("--only", choices=("inputs", "outputs"), help="sweep only the input or the output projections")
    args = p.parse_args()
    for name in args.shapes.split(","):
        if args.only != "outputs":
            sweep(name, args.rows)
        if args.only != "inputs":
            sweep_split_k(name, args.rows)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
