"""Decode speed with a json_schema constraint over decode speed without it, plain and speculative, on the engine.

Every configuration runs the same chat prompts (asking for JSON) on one Engine per mode (slots=1), unconstrained and
constrained requests interleaved so that drift on a shared machine hits both alike. Speed is decode tokens/s (the
tokens after the first, over the decode steps' time); acceptance is accepted / drafted tokens; processing is the
share of the decode time spent in the constraint's host work (grammar masks, their application, the matcher's
advance and rollback), timed inside the same steps, which shared-machine drift skews far less than the speeds.
The goal is a ratio >= 0.9 (issue 23).

    python bench/structured_throughput.py --tiny                                  # tiny random models (CPU)
    python bench/structured_throughput.py --backend llama.cpp                     # the default pair, llama.cpp
    python bench/structured_throughput.py --backend torch --device cuda --dtype bfloat16   # the default pair, GPU
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

import torch

import tandem
from tandem.engine import Engine, Request
from tandem.logits.options import logits_settings
from tandem.logits.processor import LogitsProcessor
from tandem.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "country": {"type": "string"}},
                    "required": ["street", "city", "country"]},
    },
    "required": ["name", "age", "email", "skills", "address"],
}
# Bounded values, so a random-weight model finishes its documents too.
TINY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 999},
                   "skills": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
    "required": ["name", "age", "skills"], "additionalProperties": False,
}
PROMPTS = [
    "Describe a fictional software engineer as a JSON object with name, age, email, skills and address.",
    "Return a JSON object for a customer record: name, age, email, a list of skills, and a postal address.",
    "Invent a person and give their details as JSON (name, age, email, skills, address with street, city, country).",
]


PROCESSING_MS = [0.0]  # host time inside the constrained requests' logits processing (see time_processing)


def time_processing() -> None:
    """Count the time spent in LogitsProcessor's methods: on a shared machine whole-run speeds drift by more than
    the constraint costs, while this share of the decode time is measured inside the same steps."""
    for name in ("rows", "accept", "usable", "cut_draft"):
        method = getattr(LogitsProcessor, name)

        @functools.wraps(method)
        def timed(*args, _method=method, **kwargs):
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                PROCESSING_MS[0] += 1000.0 * (time.perf_counter() - started)

        setattr(LogitsProcessor, name, timed)


def run(engine: Engine, target, prompt: str, schema: dict | None, max_tokens: int, draft_max: int) -> dict:
    ids = target.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}} if schema else None
    request = Request(ids, SamplingParams(), max_tokens=max_tokens, draft_max=draft_max, draft_policy="fixed",
                      logits=logits_settings(response_format=fmt))
    PROCESSING_MS[0] = 0.0
    result = engine.generate([request])[0]
    s = result.stats
    decoded = max(0, s.generated_tokens - 1)
    return dict(tokens=s.generated_tokens, decode_ms=s.decode_ms, tok_s=1000.0 * decoded / s.decode_ms if s.decode_ms
                else 0.0, drafted=s.draft_tokens, accepted=s.accepted_tokens, finish=result.finish_reason,
                processing_ms=PROCESSING_MS[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tiny", action="store_true", help="tiny random models instead (written to a temp dir)")
    parser.add_argument("--tiny-vocab", type=int, default=None,
                        help="pad the tiny models' vocabulary to this many rows (151936: Qwen's mask sizes)")
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-max", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    time_processing()
    schema = SCHEMA
    if args.tiny:
        from tandem.synthetic.tiny_gguf import write_tiny_gguf

        folder = tempfile.mkdtemp(prefix="tandem-structured-")
        shape = dict(seed=0, d_model=256, d_ffn=1024, n_layers=8, n_heads=4, n_kv_heads=2,
                     vocab_size=args.tiny_vocab)
        args.model = write_tiny_gguf(f"{folder}/target.gguf", **shape)
        args.draft = write_tiny_gguf(f"{folder}/draft.gguf", qtype="Q4_0", **shape)
        args.backend, schema = "torch", TINY_SCHEMA
    target = tandem.load(args.model, device=args.device, dtype=args.dtype, backend=args.backend)
    draft = tandem.load(args.draft, device=args.device, dtype=args.dtype, backend=target.backend)
    print(f"target {args.model}, draft {args.draft}, backend {target.backend}, device {args.device}, "
          f"max_tokens {args.max_tokens}, fixed k={args.draft_max}, {args.repeats} repeats x {len(PROMPTS)} prompts")
    modes = {"plain": Engine(target, None, slots=1), "speculative": Engine(target, draft, slots=1,
                                                                              draft_max=args.draft_max,
                                                                              measure_costs=False)}
    for engine in modes.values():  # warm-up: first forwards, the grammar library's view of the vocabulary
        run(engine, target, PROMPTS[0], schema, 8, args.draft_max)
    print(f"{'mode':<12}{'constraint':<12}{'tok/s':>8}{'tokens':>8}{'acceptance':>12}{'processing':>12}  finish")
    for name, engine in modes.items():
        rows = {"none": [], "json_schema": []}
        for repeat in range(args.repeats):
            for i, prompt in enumerate(PROMPTS):
                order = list(rows) if (repeat + i) % 2 == 0 else list(rows)[::-1]  # neither always goes first
                for constraint in order:
                    rows[constraint].append(run(engine, target, prompt, schema if constraint != "none" else None,
                                                args.max_tokens, args.draft_max))
        speeds, shares = {}, {}
        for constraint, runs in rows.items():
            tok_s = sum(r["tokens"] - 1 for r in runs) / sum(r["decode_ms"] for r in runs) * 1000.0
            drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
            finishes = statistics.multimode(r["finish"] for r in runs)
            speeds[constraint] = tok_s
            acceptance = f"{accepted / drafted:.3f}" if drafted else "-"
            share = sum(r["processing_ms"] for r in runs) / sum(r["decode_ms"] + 1e-9 for r in runs)
            shares[constraint] = share
            print(f"{name:<12}{constraint:<12}{tok_s:>8.1f}{sum(r['tokens'] for r in runs):>8}{acceptance:>12}"
                  f"{100 * share:>11.1f}%  {'/'.join(finishes)}")
        per_prompt = [c["tok_s"] / u["tok_s"] for u, c in zip(rows["none"], rows["json_schema"], strict=True)
                      if u["tok_s"] and c["tok_s"]]
        print(f"{name:<12}{'ratio':<12}{speeds['json_schema'] / speeds['none']:>8.3f}   (per prompt-run median "
              f"{statistics.median(per_prompt):.3f}, range {min(per_prompt):.3f}-{max(per_prompt):.3f}; "
              f"1 - the constrained runs' processing share: {1 - shares['json_schema']:.3f})")


if __name__ == "__main__":
    main()
