"""The batched forward's step time against batch size on a CUDA device: random weights of real shapes (synthetic).

    python lab/gpu_batched_step.py [--shapes qwen2.5-1.5b,qwen2.5-0.5b] [--batches 1,2,4,8,16,32,64]
                                     [--rows 1,9] [--context 700] [--single] [--eager 4,16]

Per shape: the start-up capture of TorchBatchedCache's graphs (PackedGraphs), then per (sequences, rows each) the
median ms of one batched forward (every sequence at `context` tokens, the pool holding random keys and values),
output tokens/s if each row were a token (sequences x rows / step), and whether each sequence's logits in the
largest batch equal its logits alone, bit for bit. --single: the batch-1 path (TorchSequence's StepGraph, the
compiled step) for comparison; --eager: Transformer.forward_ragged (the eager batched forward this replaces) at
these batch sizes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-0.5b")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--rows", default="1,9")
    p.add_argument("--context", type=int, default=700)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--single", action="store_true")
    p.add_argument("--eager", default="")
    p.add_argument("--block-rows", type=int, default=0, help="fused_projections.BLOCK_ROWS to use instead")
    args = p.parse_args()
    if args.block_rows:
        from tandem.models import fused_projections

        fused_projections.BLOCK_ROWS = args.block_rows
        print(f"fused_projections.BLOCK_ROWS = {args.block_rows}")
    from tandem.synthetic.shapes import random_model

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; synthetic weights (random, real shapes)")
    for shape in args.shapes.split(","):
        bench_shape(random_model(shape, device="cuda", dtype="bfloat16", n_ctx=4096), shape, args)
        torch.cuda.empty_cache()


def bench_shape(model, shape: str, args) -> None:
    from tandem.backends.torch_batched import TorchBatchedCache

    batches = [int(b) for b in args.batches.split(",")]
    row_counts = [int(r) for r in args.rows.split(",")]
    slots = max(batches)
    started = time.perf_counter()
    cache = TorchBatchedCache(model, slots, 4096)
    torch.cuda.synchronize()
    graphs = len(cache.packed.graphs) if cache.packed is not None else 0
    print(f"{shape}: {slots} slots, {graphs} graphs captured in {time.perf_counter() - started:.1f} s, "
          f"KV pool {cache.nbytes / 2**30:.1f} GiB", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in cache.pool.k + cache.pool.v:
        t.normal_(0.0, 1.0, generator=gen)
    for s in range(slots):  # every slot holds `context` positions (random keys and values)
        if cache.packed is not None:
            cache.lengths[s] = args.context
        else:
            cache.sequences[s].cache.length = args.context
    print(f"{'sequences':>9} {'rows':>4} {'step ms':>8} {'rows/s':>9} {'ms/seq':>7}", flush=True)
    results = {}
    for rows in row_counts:
        for b in batches:
            batch = [(s, [1 + (7 * s + j) % 300 for j in range(rows)]) for s in range(b)]

            def step(batch=batch):
                out = cache.forward(batch, [False] * len(batch))
                for s, _ in batch:
                    cache.rewind(s, args.context)
                return out

            ms = timed(step, args.repeats)
            results[b, rows] = ms
            print(f"{b:>9} {rows:>4} {ms:>8.3f} {b * rows / ms * 1000:>9.0f} {ms / b:>7.3f}", flush=True)
        # Exactness: each sequence of the largest batch, alone
        big = [(s, [1 + (7 * s + j) % 300 for j in range(rows)]) for s in range(max(batches))]
        together = [t.clone() for t in cache.forward(big, [False] * len(big))]
        for s, _ in big:
            cache.rewind(s, args.context)
        same = 0
        for (s, tokens), expected in zip(big, together, strict=True):
            alone = cache.forward([(s, tokens)], [False])[0]
            cache.rewind(s, args.context)
            same += torch.equal(alone, expected)
        print(f"  {rows} rows: logits of each of {len(big)} sequences batched == alone, bit for bit: "
              f"{same}/{len(big)}", flush=True)
    if args.eager:
        pool = cache.pool
        for b in (int(x) for x in args.eager.split(",")):
            for rows in row_counts:
                n = b * rows
                tokens = torch.tensor([1 + j % 300 for j in range(n)], device="cuda")
                positions = torch.tensor([args.context + j % rows for j in range(n)], device="cuda")
                slots_t = torch.tensor([j // rows for j in range(n)], device="cuda")
                spans = [(s * rows, (s + 1) * rows, s, args.context + rows) for s in range(b)]
                out_rows = torch.arange(n, device="cuda")
                with torch.inference_mode():
                    ms = timed(lambda: model.transformer.forward_ragged(  # noqa: B023
                        tokens, positions, slots_t, spans, pool.k, pool.v, out_rows), 5)  # noqa: B023
                print(f"  eager forward_ragged (before): {b} sequences x {rows} rows: {ms:.2f} ms "
                      f"(packed graphs: {results.get((b, rows), float('nan')):.3f} ms)", flush=True)
    if args.single:
        from gpu_step import time_step

        for rows in row_counts:
            ms = time_step(model, 9, rows, args.context)
            print(f"  batch-1 path (TorchSequence, StepGraph of 9 rows): {rows} rows {ms:.3f} ms "
                  f"(packed graphs, 1 sequence: {results.get((1, rows), float('nan')):.3f} ms)", flush=True)


if __name__ == "__main__":
    main()
