"""A quick correctness and speed check of the CUDA path (graphs vs eager, speculative vs plain), for a GPU box.
More: docs/internals.md."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import tandem
from tandem.bench.suite import load_suite


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    started = time.perf_counter()
    target = tandem.load(args.model, device=args.device, dtype=args.dtype)
    draft = tandem.load(args.draft, device=args.device, dtype=args.dtype)
    print(f"loaded in {time.perf_counter() - started:.1f} s on {torch.cuda.get_device_name()}", flush=True)

    ids = target.tokenizer.encode_chat([{"role": "user", "content": "Write quicksort in Python."}])
    eager = target.logits(ids + [11, 12, 13, 14])[-5:]
    seq = target.new_sequence()
    seq.forward(ids, logits="last")
    graphed = seq.forward(ids[-1:] + [11, 12, 13, 14], logits="all").clone()
    seq.close()
    graph_diff = (graphed - target.logits(ids + ids[-1:] + [11, 12, 13, 14])[-5:]).abs().max().item()
    print(f"graphed vs eager verify logits: max |diff| = {graph_diff:.4f} (bf16)", flush=True)
    del eager

    rows = []
    for prompt in load_suite("default"):
        opts = dict(messages=list(prompt.messages), max_tokens=args.max_tokens)
        tandem.generate(target, **opts)  # warm-up: graph capture, cuBLAS heuristics
        tandem.generate(target, draft=draft, **opts)
        plain = tandem.generate(target, **opts)
        row = {"name": prompt.name, "plain_tps": plain.stats.tokens_per_second}
        for label, kwargs in (("adaptive", {}), ("fixed4", dict(draft_policy="fixed", draft_max=4)),
                              ("ngram", dict(draft="ngram"))):
            spec = tandem.generate(target, **{"draft": draft, **opts, **kwargs})
            row[label] = {"tps": spec.stats.tokens_per_second, "acceptance": spec.stats.acceptance_rate,
                          "draft_tokens": spec.stats.draft_tokens, "k_counts": spec.stats.draft_len_counts,
                          "first_difference": first_difference(plain.tokens, spec.tokens)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"graph_vs_eager_max_abs_diff": graph_diff, "prompts": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
