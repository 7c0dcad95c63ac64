"""Batched engine: N requests decoded together vs the same N one after another, side by side in one run.

    python bench/batching.py                       # tiny random models (as the tests build), torch backend, CPU
    python bench/batching.py --model T.gguf --draft D.gguf --device cuda --dtype bfloat16
    python bench/batching.py --synthetic-shape qwen2.5-1.5b,qwen2.5-0.5b --device cuda --dtype bfloat16 \
        --requests 1,4,16,64   # random weights of real shapes: systems numbers only (acceptance near zero)

Prints output tokens/s of each way and their ratio, plain and with the draft (fixed draft length and adaptive);
greedy, every request generating exactly --max-tokens tokens (EOS ignored), and checks that each request's tokens
are the same both ways.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import tandem
from tandem.engine import Engine, Request

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "{\"name\": \"tandem\", \"items\": [1, 2,",
           "Once upon a time", "import numpy as np\n", "SELECT name FROM users WHERE", "Dear team,", "1, 2, 3, 4,"]


def run(engine: Engine, reqs: list[Request], together: bool) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    if together:
        results = engine.generate(reqs)
    else:
        results = [engine.generate([r])[0] for r in reqs]
    seconds = time.perf_counter() - started
    return sum(len(r.tokens) for r in results) / seconds, [r.tokens for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model"), ap.add_argument("--draft")
    ap.add_argument("--device", default="cpu"), ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="torch", choices=["torch", "llama.cpp"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads [every core]")
    ap.add_argument("--synthetic-shape",
                    help="TARGET[,DRAFT]: random weights of these shapes (tandem.synthetic.shapes)")
    ap.add_argument("--requests", default="8", help="comma-separated: one run of each count")
    ap.add_argument("--configs", default="plain,fixed,adaptive", help="of plain, fixed, adaptive")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="median of this many runs each way")
    args = ap.parse_args()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1)))
    if args.synthetic_shape:
        from tandem.synthetic.shapes import random_model

        shapes = args.synthetic_shape.split(",")
        target = random_model(shapes[0], device=args.device, dtype=args.dtype, seed=0)
        draft = random_model(shapes[1], device=args.device, dtype=args.dtype, seed=1) if len(shapes) > 1 else None
        print(f"models: {', '.join(shapes)} with random weights (synthetic)")
    elif args.model is None:
        from tandem.synthetic.tiny_gguf import write_tiny_gguf

        folder = tempfile.mkdtemp(prefix="tandem-bench-")
        quantized = args.backend == "llama.cpp"  # llama.cpp's CPU rows are batch-invariant for quantized weights
        args.model = write_tiny_gguf(os.path.join(folder, "t.gguf"), qtype="Q8_0" if quantized else "F32", seed=0)
        args.draft = write_tiny_gguf(os.path.join(folder, "d.gguf"), qtype="Q4_0", seed=0)
        print(f"models: tiny random (synthetic), target {'Q8_0' if quantized else 'F32'}, draft the same weights "
              "in Q4_0")
    if not args.synthetic_shape:
        target = tandem.load(args.model, device=args.device, dtype=args.dtype, backend=args.backend)
        draft = tandem.load(args.draft, device=args.device, dtype=args.dtype, backend=args.backend) \
            if args.draft else None
    for n in (int(r) for r in args.requests.split(",")):
        compare(target, draft, n, args)


def compare(target, draft, n_requests: int, args) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n_requests)]
    print(f"{n_requests} requests x {args.max_tokens} tokens, greedy; tokens/s, median of {args.repeats}")
    print(f"{'config':<18} {'one after another':>18} {'together':>10} {'ratio':>7}  same tokens  start-up s")
    configs = {"plain": ("plain", None, "fixed"), "fixed": (f"draft fixed {args.draft_max}", draft, "fixed"),
               "adaptive": ("draft adaptive", draft, "adaptive")}
    for name, model, policy in (configs[c] for c in args.configs.split(",")):
        if name != "plain" and draft is None:
            continue
        started = time.perf_counter()
        engine = Engine(target, model, slots=n_requests, draft_max=args.draft_max,
                        measure_costs=policy == "adaptive")
        startup = time.perf_counter() - started
        reqs = lambda policy=policy: [Request(target.tokenizer.encode(p), max_tokens=args.max_tokens,  # noqa: E731
                                              ignore_eos=True, draft_policy=policy) for p in prompts]
        rates = {False: [], True: []}
        outputs = {}
        for _ in range(args.repeats):
            for together in (False, True):
                rate, tokens = run(engine, reqs(), together)
                rates[together].append(rate)
                outputs[together] = tokens
        alone, batched = sorted(rates[False])[len(rates[False]) // 2], sorted(rates[True])[len(rates[True]) // 2]
        same = outputs[False] == outputs[True]
        print(f"{name:<18} {alone:>18.1f} {batched:>10.1f} {batched / alone:>6.2f}x  {str(same):<11}  {startup:.1f}",
              flush=True)
        del engine


if __name__ == "__main__":
    main()
