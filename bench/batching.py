"""Batched engine: N requests decoded together vs the same N one after another, side by side in one run.

    python bench/batching.py                       # tiny random models (as the tests build), torch backend, CPU
    python bench/batching.py --model T.gguf --draft D.gguf --device cuda --dtype bfloat16

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
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="median of this many runs each way")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    if args.model is None:
        from tandem.loading.synthetic import write_tiny_gguf

        folder = tempfile.mkdtemp(prefix="tandem-bench-")
        args.model = write_tiny_gguf(os.path.join(folder, "t.gguf"), seed=0)
        args.draft = write_tiny_gguf(os.path.join(folder, "d.gguf"), qtype="Q4_0", seed=0)
        print("models: tiny random (synthetic), target F32, draft the same weights in Q4_0")
    target = tandem.load(args.model, device=args.device, dtype=args.dtype, backend="torch")
    draft = tandem.load(args.draft, device=args.device, dtype=args.dtype, backend="torch") if args.draft else None
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    print(f"{args.requests} requests x {args.max_tokens} tokens, greedy; tokens/s, median of {args.repeats}")
    print(f"{'config':<18} {'one after another':>18} {'together':>10} {'ratio':>7}  same tokens")
    for name, model, policy in [("plain", None, "fixed"), (f"draft fixed {args.draft_max}", draft, "fixed"),
                                ("draft adaptive", draft, "adaptive")]:
        if name != "plain" and draft is None:
            continue
        engine = Engine(target, model, slots=args.requests, draft_max=args.draft_max,
                        measure_costs=policy == "adaptive")
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
        print(f"{name:<18} {alone:>18.1f} {batched:>10.1f} {batched / alone:>6.2f}x  {outputs[False] == outputs[True]}")


if __name__ == "__main__":
    main()
