"""The draft policy against fixed draft lengths with a server-like host gap between steps, in process (issue 52;
results in bench/results/cpu-2026-12-08b-step-overhead). For an A/B, run it once per tree:

    PYTHONPATH=<tree> python lab/step_overhead_ab.py --clients 16 --gaps 0,3 --rounds 3

A 6-layer 256-wide random target and a 1-layer 32-wide random draft, synthetic acceptance 0.7, torch on one thread:
each config's tokens/s over plain's in the same round (median of interleaved rounds) and the share of tokens that
came from accepted drafts. The gap is slept before each step (bench/engine_load.py's serve).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from engine_load import PROMPTS, serve  # noqa: E402

from tandem.engine import Engine  # noqa: E402
from tandem.synthetic.shapes import parse_shape, random_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--gaps", default="0,3", help="ms between steps, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--target", default="tiny:n_layers=6,d_model=256,d_ffn=768,n_heads=4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = random_model(parse_shape(args.target), dtype="float32", seed=0)
    draft = random_model("tiny-draft", dtype="float32", seed=1)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    clients, acceptance = args.clients, args.acceptance
    for gap in (float(g) for g in args.gaps.split(",")):
        engines = {"plain": Engine(target, None, slots=clients, draft_max=8, measure_costs=False,
                                   synthetic_acceptance=acceptance)}
        for k in (1, 2, 3):
            engines[f"fixed{k}"] = Engine(target, draft, slots=clients, draft_max=8, measure_costs=False,
                                          synthetic_acceptance=acceptance)
        engines["adaptive"] = Engine(target, draft, slots=clients, draft_max=8, prompt_lookup=False,
                                     synthetic_acceptance=acceptance)

        def run(name: str, gap: float = gap, engines: dict = engines) -> tuple[float, int, int]:
            fixed = name.startswith("fixed")
            return serve(engines[name], prompts, clients, 3, 48, "fixed" if fixed else "adaptive",
                         int(name[5:]) if fixed else 8, gap)

        for name in engines:  # warm-up
            run(name)
        rates: dict[str, list[float]] = {n: [] for n in engines}
        drafted: dict[str, list[float]] = {n: [] for n in engines}
        for _ in range(args.rounds):
            for name in engines:
                seconds, tokens, accepted = run(name)
                rates[name].append(tokens / seconds)
                drafted[name].append(accepted / tokens)
        print(f"{clients} clients, gap {gap} ms: plain {statistics.median(rates['plain']):.0f} tok/s; ratio to plain "
              f"(median of {args.rounds}), drafted share")
        for name in engines:
            ratio = statistics.median(r / p for r, p in zip(rates[name], rates["plain"], strict=True))
            print(f"  {name:9s} {ratio:.3f}  {statistics.median(drafted[name]):.0%}")


if __name__ == "__main__":
    main()
