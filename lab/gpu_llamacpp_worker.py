"""On a CUDA box: llama.cpp's CUDA build beside torch's CUDA, through the worker process (tandem.backends.
llamacpp_worker). Run with a CUDA build of llama-cpp-python first on PYTHONPATH:

    python lab/gpu_llamacpp_worker.py --model T.gguf --draft D.gguf [--max-tokens 128] [--json OUT]

torch's CUDA is initialised first (the order that crashed at llama_model_load_from_file), then both models load on
device="cuda" (isolation auto: the worker), and it checks: this process never loaded libllama/libggml (only the
worker did), greedy plain == greedy speculative (draft k = 3 and the adaptive policy), a batch of 3 == alone, and
reports decode tok/s of each and which CUDA runtime and cuBLAS files each process mapped (the clash: two copies).
CUDA kernels are not batch-invariant (docs/backends.md): the equality flags are reported, not required.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import tandem
from tandem.engine import Engine, Request

PROMPTS = ["Write a Python function that checks whether a number is prime.", "Explain what a hash map is.",
           "Write a JSON object describing a book with title, author and year."]


def mapped(pid: int | str, names=("libcudart", "libcublas", "libggml", "libllama")) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split()[-1] for line in f if "/" in line}
    return sorted(p for p in paths if any(n in p for n in names))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.zeros(1, device="cuda")  # torch's CUDA first
    target = tandem.load(args.model, backend="llama.cpp", device="cuda")
    draft = tandem.load(args.draft, backend="llama.cpp", device="cuda")
    out: dict = {"isolation": getattr(target, "isolation", "none"), "device": target.device_description,
                 "parent_maps": mapped("self"), "worker_maps": mapped(target.worker_pid)}
    assert not any("ggml" in m or "llama" in m for m in out["parent_maps"]), out["parent_maps"]
    runs = {}
    for name, options in [("plain", {}), ("fixed3", dict(draft=draft, draft_max=3, draft_policy="fixed")),
                          ("adaptive", dict(draft=draft))]:
        rows = []
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            tandem.generate(target, messages=messages, max_tokens=8, **options)  # warm-up
            result = tandem.generate(target, messages=messages, max_tokens=args.max_tokens, **options)
            rows.append({"tokens": result.tokens, "decode_tps": result.stats.decode_tokens_per_second,
                         "accepted": result.stats.accepted_tokens, "drafted": result.stats.draft_tokens})
        runs[name] = rows
    for name in ("fixed3", "adaptive"):
        pairs = zip(runs[name], runs["plain"], strict=True)
        out[f"{name}_equals_plain"] = [a["tokens"] == b["tokens"] for a, b in pairs]
    engine = Engine(target, draft, slots=3, draft_max=3)
    batched = engine.generate([Request(target.tokenizer.encode_chat([{"role": "user", "content": p}]),
                                       max_tokens=args.max_tokens) for p in PROMPTS])
    out["batched_equals_alone"] = [r.tokens == a["tokens"] for r, a in zip(batched, runs["plain"], strict=True)]
    out["decode_tps"] = {name: [round(r["decode_tps"], 1) for r in rows] for name, rows in runs.items()}
    out["acceptance"] = {name: [r["accepted"] / r["drafted"] if r["drafted"] else None for r in rows]
                         for name, rows in runs.items() if name != "plain"}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "runs": runs}, f, indent=1)
    target.close()
    draft.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
