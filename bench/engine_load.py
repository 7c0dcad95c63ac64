"""A server's load in process: N clients each sending requests back to back into one engine, config by config in
interleaved rounds, tokens/s and each config's ratio to plain decoding without a draft (no HTTP, no GPU needed).

    python bench/engine_load.py --clients 8,32 --configs plain,adaptive,fixed1,fixed2,fixed3 --rounds 3
    python bench/engine_load.py --clients 16 --configs plain,adaptive --profile 30   # and where adaptive's time goes
    python bench/engine_load.py --clients 16 --configs plain,adaptive-draft,fixed1,fixed2,fixed3 --gap-ms 3 \
        --synthetic-shape "tiny:n_layers=6,d_model=256,d_ffn=768,n_heads=4;tiny-draft" --synthetic-acceptance 0.7

Each config is an engine as `tandem serve` builds one (slots = the most clients): `plain` has no draft loaded,
`adaptive` the draft with the default policy (prompt lookup mixed in), `fixedK` the draft at draft length K. Clients
keep one request each in flight: when one finishes, that client's next joins at the next step, so the batch changes
as a served one does. Greedy, every request generating --max-tokens tokens. Also printed: the share of tokens that
came from accepted drafts, and the draft model's forwards per generated token (the draft's presence, counted).
Default models: tiny random ones as the tests build them (target F32; the draft the target's weights in Q4_0, so it
agrees often, or --draft-seed N for a draft that never does).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time

import torch

import tandem
from tandem.engine import Engine, Request

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox jumps over the lazy dog. " * 3, "{\"name\": \"tandem\", "
           "\"items\": [1, 2,", "Once upon a time", "import numpy as np\n\ndef mean(xs):\n", "SELECT name FROM users "
           "WHERE id IN (SELECT user_id FROM orders)", "Dear team,\nthe release", "1, 2, 3, 4, 5, 6, 7,"]


class Counted:
    """Counts the forwards of a batched cache (the draft's) without changing them."""

    def __init__(self, kv) -> None:
        self.forwards = self.rows = 0
        for name in ("forward", "forward_picking"):
            if hasattr(kv, name):
                setattr(kv, name, self._counting(getattr(kv, name)))

    def _counting(self, forward):
        def counted(batch, *args, **kw):
            self.forwards += 1
            self.rows += sum(len(rows) for _, rows in batch)
            return forward(batch, *args, **kw)
        return counted


def serve(engine: Engine, prompts: list[list[int]], clients: int, per_client: int, max_tokens: int,
          policy: str, draft_max: int, gap_ms: float = 0.0) -> tuple[float, int, int]:
    """Clients x per_client requests, each client's next sent when its last finishes; gap_ms between steps stands
    for a server's work between them (its streams). Returns (seconds, tokens generated, tokens that came from
    accepted drafts)."""
    def request(i: int) -> Request:
        return Request(prompts[i % len(prompts)], max_tokens=max_tokens, ignore_eos=True, draft_policy=policy,
                       draft_max=draft_max)

    engine.kv.forget_prefixes()
    sent = 0
    live = {}
    for c in range(clients):
        live[engine.add(request(sent)).id] = c
        sent += 1
    left = {c: per_client - 1 for c in range(clients)}
    tokens = accepted = 0
    started = time.perf_counter()
    while engine.busy:
        if gap_ms:
            time.sleep(gap_ms / 1000.0)
        for gen, chunk in engine.step():
            tokens += len(chunk.tokens)
            if chunk.finish_reason is not None:
                accepted += chunk.stats.accepted_tokens
                c = live.pop(gen.id)
                if left[c]:
                    left[c] -= 1
                    live[engine.add(request(sent)).id] = c
                    sent += 1
    return time.perf_counter() - started, tokens, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model"), ap.add_argument("--draft")
    ap.add_argument("--device", default="cpu"), ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="torch", choices=["torch", "llama.cpp"])
    ap.add_argument("--clients", default="8", help="comma-separated client counts")
    ap.add_argument("--configs", default="plain,adaptive,fixed1,fixed2,fixed3",
                    help="plain, adaptive (prompt lookup and the draft), adaptive-draft (the draft alone), fixedK")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--draft-seed", type=int, default=0, help="tiny draft's weights: 0 = the target's (agrees)")
    ap.add_argument("--synthetic-shape", help="TARGET,DRAFT: random weights of these shapes (tandem.synthetic.shapes); "
                    "TARGET;DRAFT where a shape has overrides (tiny:n_layers=6,d_model=256;tiny-draft)")
    ap.add_argument("--synthetic-acceptance", type=float, default=None)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="host time between steps, as a server spends serving its streams (H100, 16 clients: ~2.3)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="then cProfile one more run, top N functions")
    ap.add_argument("--profile-config", default="adaptive", help="the config --profile runs")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.synthetic_shape:
        from tandem.synthetic.shapes import parse_shape, random_model

        shapes = args.synthetic_shape.split(";" if ";" in args.synthetic_shape else ",")
        target = random_model(parse_shape(shapes[0]), device=args.device, dtype=args.dtype, seed=0)
        draft = random_model(parse_shape(shapes[1]), device=args.device, dtype=args.dtype, seed=1)
        print(f"models: {', '.join(shapes)} with random weights (synthetic)")
    elif args.model is None:
        from tandem.synthetic.tiny_gguf import write_tiny_gguf

        folder = tempfile.mkdtemp(prefix="tandem-bench-")
        args.model = write_tiny_gguf(os.path.join(folder, "t.gguf"), qtype="F32", seed=0, context_length=1024)
        args.draft = write_tiny_gguf(os.path.join(folder, "d.gguf"), qtype="Q4_0", seed=args.draft_seed,
                                     context_length=1024)
        print(f"models: tiny random (synthetic), target F32, draft Q4_0 seed {args.draft_seed}")
    if not args.synthetic_shape:
        target = tandem.load(args.model, device=args.device, dtype=args.dtype, backend=args.backend)
        draft = tandem.load(args.draft, device=args.device, dtype=args.dtype, backend=args.backend)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    configs = args.configs.split(",")
    for clients in (int(c) for c in args.clients.split(",")):
        engines, counters = {}, {}
        for name in configs:
            engines[name] = Engine(target, None if name == "plain" else draft, slots=clients,
                                   draft_max=args.draft_max, synthetic_acceptance=args.synthetic_acceptance,
                                   measure_costs=name.startswith("adaptive"), prompt_lookup=name != "adaptive-draft")
            if engines[name].drafter is not None:
                counters[name] = Counted(engines[name].drafter.kv)
        policy = {n: ("fixed" if n.startswith("fixed") else "adaptive") for n in configs}
        k = {n: (int(n[5:]) if n.startswith("fixed") else args.draft_max) for n in configs}
        def run(n: str, engines=engines, clients=clients, policy=policy, k=k) -> tuple[float, int, int]:
            return serve(engines[n], prompts, clients, args.requests_per_client, args.max_tokens, policy[n], k[n],
                         args.gap_ms)
        for name in configs:  # warm-up: compiles, first shapes, the shared prior's first requests
            run(name)
        rates: dict[str, list[float]] = {n: [] for n in configs}
        drafted: dict[str, float] = {}
        forwards: dict[str, float] = {}
        for _ in range(args.rounds):
            for name in configs:
                before = counters[name].forwards if name in counters else 0
                seconds, tokens, accepted = run(name)
                rates[name].append(tokens / seconds)
                drafted[name] = accepted / tokens
                forwards[name] = ((counters[name].forwards - before) / tokens) if name in counters else 0.0
        print(f"{clients} clients x {args.requests_per_client} requests x {args.max_tokens} tokens; tokens/s, median "
              f"of {args.rounds} interleaved rounds")
        base = statistics.median(rates[configs[0]])
        print(f"{'config':<10} {'tok/s':>9} {'x ' + configs[0]:>9} {'drafted':>8} {'draft fwd/tok':>14}")
        for name in configs:
            rate = statistics.median(rates[name])
            print(f"{name:<10} {rate:>9.1f} {rate / base:>9.3f} {drafted[name]:>8.1%} {forwards[name]:>14.3f}")
        for name in configs:
            times = getattr(getattr(engines[name], "policy", engines[name]), "step_times", {})
            if times:
                rows = sorted(times.items(), key=lambda kv: (kv[0][0], kv[0][1] or ''))
                label = {None: "p", "lookup": "l"}
                figures = "  ".join(f"{b}{label.get(d, 'm')}:{n} {p / n:.2f}/{m / n:.2f}"
                                    for (b, d), (n, p, m) in rows if n >= 3)
                print(f"  {name}: steady steps, the planner's / measured ms a step, each to the next's start (batch, "
                      f"p plain / l lookup / m the draft model: steps):  {figures}")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            run(args.profile_config)
            profiler.disable()
            print(f"profile of {args.profile_config}, one more run")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
