"""Time one graphed decode step of random-weight models of real shapes, per variant, on a CUDA device.

    python lab/gpu_step.py [--variants qwen2.5-1.5b:1:9,qwen2.5-0.5b:1:9] [--contexts 16,700] [--decode 256]
    # variant = shape:compile:rows[:decode_kernel[:projections[:split_k[:pdl]]]]; 0 = attention as matmuls
    # (TANDEM_DECODE_KERNEL), projections unfused (TANDEM_FUSED_PROJECTIONS), output projections by cuBLAS
    # (TANDEM_SPLIT_K), kernels launched without programmatic dependent launch (TANDEM_PDL)
    python lab/gpu_step.py --set SPLIT_BLOCK_N=32,decode_attention.CHUNK=64   # other launch configurations
    # (tandem.models.fused_projections' constants, or another module's named) for every variant

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


def time_step(model, rows: int, n: int, context: int = 16, repeats: int = 50) -> float:
    from tandem.backends import torch_sequence

    seq = torch_sequence.TorchSequence(model, 4096, rows)
    seq.forward([1 + i % 200 for i in range(context)], logits="last")
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


def decode(model, n_tokens: int, run_ahead: int, ngram: bool = False) -> tuple[float, list[int], float]:
    """Greedy decoding on the engine, one sequence (what tandem.generate runs): (best tokens a second after the
    first, tokens, acceptance)."""
    from tandem.engine import Engine, Request

    best, tokens, acceptance = 0.0, [], 0.0
    engine = Engine(model, "ngram" if ngram else None, slots=1, draft_max=4, measure_costs=False,
                    run_ahead=run_ahead)
    for _ in range(3):
        engine.target_kv.rewind(0, 0)  # no prefix reuse between rounds
        result = engine.generate([Request([1 + i % 7 for i in range(64)], max_tokens=n_tokens, ignore_eos=True,
                                          draft_policy="fixed")])[0]
        s = result.stats
        best, tokens, acceptance = max(best, 1000.0 * (s.generated_tokens - 1) / s.decode_ms), result.tokens, \
            s.acceptance_rate
    return best, tokens, acceptance


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="qwen2.5-1.5b:1:9:1,qwen2.5-1.5b:1:9:0,qwen2.5-0.5b:1:9:1")
    p.add_argument("--contexts", default="16,700", help="tokens in the cache before the timed step")
    p.add_argument("--decode", type=int, default=0, help="also time plain decoding of this many tokens, "
                   "one step per sync and RUN_AHEAD steps per sync")
    p.add_argument("--set", default="", help="[MODULE.]NAME=INT,...: launch constants of tandem.models' "
                   "fused_projections (the default module) or decode_attention to use instead")
    args = p.parse_args()
    from tandem.models import decode_attention, fused_projections

    modules = {"fused_projections": fused_projections, "decode_attention": decode_attention}
    for name, value in (item.split("=") for item in args.set.split(",") if item):
        module_name, _, name = name.rpartition(".")
        module = modules.get(module_name or "fused_projections")
        if module is None or not hasattr(module, name):
            raise SystemExit(f"no launch constant {module_name or 'fused_projections'}.{name}")
        setattr(module, name, int(value))
        print(f"{module.__name__}.{name} = {value}", flush=True)
    from tandem.synthetic.shapes import random_model, weight_bytes

    bandwidth = copy_bandwidth_gb_s("cuda")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth:.0f} GB/s (read + write)", flush=True)
    for variant in args.variants.split(","):
        shape, compiled, rows, *kernels = variant.split(":")
        rows = int(rows)
        os.environ["TANDEM_COMPILE"] = compiled
        os.environ["TANDEM_DECODE_KERNEL"] = kernels[0] if kernels else "1"
        os.environ["TANDEM_FUSED_PROJECTIONS"] = kernels[1] if len(kernels) > 1 else "1"
        os.environ["TANDEM_SPLIT_K"] = kernels[2] if len(kernels) > 2 else "1"
        os.environ["TANDEM_PDL"] = kernels[3] if len(kernels) > 3 else "1"
        started = time.perf_counter()
        model = random_model(shape, device="cuda", dtype="bfloat16", n_ctx=4096)
        nbytes = weight_bytes(model) - model.config.vocab_size * model.config.d_model * 2 * (
            0 if model.config.tied_embeddings else 1)  # the input embedding is gathered, not streamed
        floor_ms = nbytes / bandwidth / 1e6
        for context in (int(c) for c in args.contexts.split(",")):
            ns = sorted({1, min(rows, 2), rows})
            ms = {n: time_step(model, rows, n, context) for n in ns}
            cells = "  ".join(f"n={n}: {v:.3f} ms" for n, v in ms.items())
            print(f"{variant:20s} context={context:4d}  {cells}  | floor {floor_ms:.3f} ms ({nbytes / 1e9:.2f} GB), "
                  f"step/floor {ms[1] / floor_ms:.2f}  [{time.perf_counter() - started:.0f} s]", flush=True)
        if args.decode:
            from tandem.engine.run_ahead import RUN_AHEAD

            (one, plain, _), (ahead, _, _) = decode(model, args.decode, 1), decode(model, args.decode, RUN_AHEAD)
            ngram, spec, acceptance = decode(model, args.decode, RUN_AHEAD, ngram=True)
            print(f"{variant:20s} plain decode of {args.decode} tokens: {one:.0f} tok/s one step per sync, "
                  f"{ahead:.0f} tok/s {RUN_AHEAD} steps per sync; n-gram k=4 {ngram:.0f} tok/s, acceptance "
                  f"{acceptance:.2f}, tokens identical to plain: {spec == plain}", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
