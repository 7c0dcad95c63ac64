"""The batched engine's draft decisions on real outputs, timed by a GPU's step costs (an emulation, no GPU needed).

    python lab/engine_emulation.py [--prompts code,json] [--batch 1,5] [--max-tokens 128]
        [--configs plain,mixed,draft,ngram,fixed3,fixed8]

The real pair (llama.cpp on CPU by default) gives the tokens: the target's greedy reply to each prompt once, then,
config by config, the engine runs with the real draft model and an oracle target whose logits are one-hot on that
reply (exact for greedy verification, which reads a row only while the tokens before it are the reply's own). Time
is a virtual clock: each target forward advances it by V(rows), each draft forward by D(rows), each step by the
host's bookkeeping, all from the H200 measurements below; the engine's planner gets exactly those costs. So the
speed-ups printed are what the engine's policy would earn on that device with these outputs. EMULATED: label them so.

Configs: plain; mixed (the default: prompt lookup and the draft model, adaptive); draft (the draft model alone,
adaptive); ngram (prompt lookup alone, adaptive); fixedN (the draft model, N a step). --batch 1 runs each prompt
alone; --batch N runs N requests together (the prompts in turn), the speed-up then being the batch's tokens per ms.
Within a config the prompts run in order in one process, so the shared acceptance prior learns as a server's would
(it starts afresh for each config).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import tempfile
import time

import numpy as np
import torch

import tandem
from tandem.backends.base import BatchedCache
from tandem.bench.suite import load_suite
from tandem.engine import Engine, Request
from tandem.engine.costs import BatchCosts, CostModel

# H200, Qwen2.5-1.5B target / 0.5B draft shapes, bf16, the packed graphed step (bench/results/h200-2026-12-04f-
# batching): 1.59 ms for 1 row, 1.93 for 16, 3.89 for 64; the points past 64 rows are extrapolated (assumed).
TARGET_MS = {1: 1.59, 16: 1.93, 64: 3.89, 128: 5.5, 512: 14.0}
DRAFT_MS = {1: 0.75, 16: 0.9, 64: 1.6, 512: 5.0}  # the 0.5B's step (assumed from its 1-row graphed step)
HOST_MS = (0.25, 0.01)  # the engine's host work a step: fixed, and per sequence (h200-2026-12-04g-engine)


def interpolate(table: dict[int, float], rows: int) -> float:
    xs = sorted(table)
    return float(np.interp(rows, xs, [table[x] for x in xs], right=table[xs[-1]] * rows / xs[-1]))


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1000.0


class Timed(BatchedCache):
    """A batched cache whose forwards advance the virtual clock by the emulated device's cost for their rows (the
    rest is the wrapped cache's)."""

    def __init__(self, cache: BatchedCache, clock: VirtualClock, table: dict[int, float]) -> None:
        self.cache, self.clock, self.table = cache, clock, table
        self.slots, self.capacity, self.can_copy = cache.slots, cache.capacity, cache.can_copy
        self.prefill_align = cache.prefill_align

    def forward(self, batch, last_only):
        self.clock.advance(interpolate(self.table, sum(len(tokens) for _, tokens in batch)))
        return self.cache.forward(batch, last_only)

    def length(self, slot):
        return self.cache.length(slot)

    def rewind(self, slot, length):
        return self.cache.rewind(slot, length)

    def reusable(self, slot, length):
        return self.cache.reusable(slot, length)

    def copy_prefix(self, src, dst, length):
        return self.cache.copy_prefix(src, dst, length)

    def nbytes(self):
        return self.cache.nbytes()

    def close(self):
        self.cache.close()


class OracleCache(BatchedCache):
    """The target once its greedy replies are known: a row's logits are one-hot on the next token of the reply
    whose prompt its slot holds."""

    can_copy = True

    def __init__(self, replies: list[list[int]], prompts: list[list[int]], vocab: int, slots: int, capacity: int):
        self.replies, self.prompts, self.vocab = replies, prompts, vocab
        self.slots, self.capacity = slots, capacity
        self.history: list[list[int]] = [[] for _ in range(slots)]

    def _reply(self, slot: int) -> list[int]:
        """The reply of the prompt the slot holds; while it holds only part of a prompt (a prefill chunk, whose
        logits the engine does not read) possibly none: then every row is one-hot on token 0."""
        held = self.history[slot]
        for prompt, reply in zip(self.prompts, self.replies, strict=True):
            if held[: len(prompt)] == prompt:
                return reply
        if not any(prompt[: len(held)] == held for prompt in self.prompts):
            raise ValueError(f"slot {slot} holds no known prompt")
        return []

    def forward(self, batch, last_only):
        out = []
        for (slot, tokens), last in zip(batch, last_only, strict=True):
            start = len(self.history[slot])
            self.history[slot] += list(tokens)
            reply = self._reply(slot)
            rows = range(len(tokens) - 1, len(tokens)) if last else range(len(tokens))
            logits = torch.zeros(len(rows), self.vocab)
            for r, i in enumerate(rows):
                position = start + i + 1
                logits[r, reply[position] if position < len(reply) else 0] = 1.0
            out.append(logits)
        return out

    def length(self, slot):
        return len(self.history[slot])

    def rewind(self, slot, length):
        del self.history[slot][length:]

    def copy_prefix(self, src, dst, length):
        self.history[dst] = list(self.history[src][:length])
        return True

    def nbytes(self):
        return 0

    def close(self):
        pass


def emulated_costs(slots: int, draft_max: int) -> BatchCosts:
    costs = BatchCosts()
    b = 1
    while True:
        costs.verify[b] = CostModel(0.0, {b * n: interpolate(TARGET_MS, b * n) for n in (1, 2, draft_max + 1)})
        costs.draft_step[b] = interpolate(DRAFT_MS, b)
        if b >= slots:
            break
        b = min(2 * b, slots)
    costs.catch_up_ms_per_token = interpolate(DRAFT_MS, 64) / 64
    # the emulated costs are the truth
    costs.observe_draft = costs.observe_iteration = lambda *args: None
    return costs


def real_replies(target, prompts: list[list[int]], args) -> list[list[int]]:
    """Each prompt followed by the target's greedy reply (and EOS where it stopped), computed once: every prompt
    batched, plain (batched == alone on the CPU), and kept in --replies (minutes on a busy 2-core CPU)."""
    key = hashlib.sha256(json.dumps([str(target.path), prompts, args.max_tokens]).encode()).hexdigest()[:16]
    path = args.replies or os.path.join(tempfile.gettempdir(), f"tandem-emulation-replies-{key}.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved["key"] == key:
            print(f"replies: from {path}")
            return saved["replies"]
    started = time.perf_counter()
    engine = Engine(target, None, slots=len(prompts), n_ctx=args.n_ctx)
    results = engine.generate([Request(ids, max_tokens=args.max_tokens) for ids in prompts])
    engine.target_kv.close()
    eos = min(target.tokenizer.eos_token_ids)
    replies = [ids + r.tokens + ([eos] if r.finish_reason == "stop" else [])
               for ids, r in zip(prompts, results, strict=True)]
    print(f"replies: {[len(r.tokens) for r in results]} tokens in {time.perf_counter() - started:.0f} s (real)")
    with open(path, "w") as f:
        json.dump({"key": key, "replies": replies}, f)
    return replies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--backend", default="llama.cpp")
    p.add_argument("--prompts", default="code,freeform,json,summary,code-edit")
    p.add_argument("--batch", default="1", help="comma list: requests decoded together (1: each prompt alone)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--configs", default="plain,mixed,draft,ngram,fixed3,fixed8")
    p.add_argument("--detail", default="mixed", help="comma list of configs whose per-prompt choices are printed")
    p.add_argument("--replies", help="where the real replies are kept between runs [a file in the temp dir]")
    args = p.parse_args()
    target = tandem.load(args.model, device="cpu", backend=args.backend, n_ctx=args.n_ctx)
    draft = tandem.load(args.draft, device="cpu", backend=args.backend, n_ctx=args.n_ctx)
    suite = load_suite("default", args.prompts)
    prompts = [target.tokenizer.encode_chat(list(s.messages)) for s in suite]
    names = [s.name for s in suite]

    replies = real_replies(target, prompts, args)

    clock = VirtualClock()
    real_clock, time.perf_counter = time.perf_counter, clock  # the engine's clock; nothing else times here
    print(f"EMULATED (H200 costs): target V(rows) {TARGET_MS} ms, draft D(rows) {DRAFT_MS} ms, host "
          f"{HOST_MS[0]} ms + {HOST_MS[1]} ms a sequence a step; outputs from {args.backend} on CPU; greedy, "
          f"{args.max_tokens} tokens")

    def run(config: str, batch: int) -> tuple[float, list[list[int]], list]:
        kind, _, fixed = config.partition("fixed")
        model = {"plain": None, "mixed": draft, "draft": draft, "ngram": "ngram", "": draft}[kind]
        target.__dict__.pop("_tandem_priors", None)  # each config learns its own shared prior from scratch
        engine = Engine(target, model, slots=batch, n_ctx=args.n_ctx, draft_max=int(fixed or args.draft_max),
                        measure_costs=False, prompt_lookup=kind == "mixed")
        engine.target_kv.close()
        engine.target_kv = Timed(OracleCache(replies, prompts, target.vocab_size, batch, args.n_ctx), clock,
                                 TARGET_MS)
        if engine.drafter is not None:
            engine.drafter.kv = Timed(engine.drafter.kv, clock, DRAFT_MS)
        if model is not None:
            engine.costs = emulated_costs(batch, engine.draft_max)
        policy = "fixed" if fixed else "adaptive"
        order = [i % len(prompts) for i in range(len(prompts) if batch == 1 else batch)]
        begin, tokens, stats = clock.now, [], []
        groups = [[i] for i in order] if batch == 1 else [order]
        per_group = []
        for group in groups:
            start = clock.now
            gens = [engine.add(Request(prompts[i], max_tokens=args.max_tokens, draft_policy=policy)) for i in group]
            while engine.busy:
                n = len(engine.batch.running)
                engine.step()
                clock.advance(HOST_MS[0] + HOST_MS[1] * n)
            per_group.append(sum(g.emitted for g in gens) / (1000.0 * (clock.now - start)))
            tokens += [g.tokens[g.prompt_len :][: g.emitted] for g in gens]
            stats += [g.stats for g in gens]
        if engine.drafter is not None:
            engine.drafter.kv.close()
        total = sum(len(t) for t in tokens) / (1000.0 * (clock.now - begin))
        return total, tokens, stats, per_group

    for batch in (int(b) for b in args.batch.split(",")):
        print(f"\nbatch {batch}: " + ("each prompt alone" if batch == 1 else f"{batch} requests together") +
              "; speed-up over plain (acceptance)")
        base, plain_tokens, _, plain_groups = run("plain", batch)
        rows: dict[str, list] = {}
        details: dict[str, list] = {}
        for config in [c for c in args.configs.split(",") if c != "plain"]:
            rate, tokens, stats, groups = run(config, batch)
            assert tokens == plain_tokens, f"{config}: output differs from plain decoding"
            rows[config] = [g / pg for g, pg in zip(groups, plain_groups, strict=True)] + [rate / base]
            drafted = sum(s.draft_tokens for s in stats)
            accepted = sum(s.accepted_tokens for s in stats)
            rows[config].append(accepted / drafted if drafted else float("nan"))
            details[config] = stats
        labels = names if batch == 1 else []
        print(f"{'config':8s} " + " ".join(f"{n:>10s}" for n in labels) + f" {'overall':>8s} {'accept':>6s}")
        for config, values in rows.items():
            cells = values[:-2] if batch == 1 else []
            print(f"{config:8s} " + " ".join(f"{v:10.3f}" for v in cells) + f" {values[-2]:8.3f} {values[-1]:6.2f}")
        if batch == 1 and len(rows) > 1:
            best = {n: max(rows[c][i] for c in rows if c != "mixed") for i, n in enumerate(names)}
            print("mixed / best other: " + ", ".join(f"{n} {rows['mixed'][i] / best[n]:.3f}"
                                                     for i, n in enumerate(names) if "mixed" in rows))
            geo = {c: math.exp(sum(math.log(v) for v in rows[c][: len(names)]) / len(names)) for c in rows}
            print("geomean: " + ", ".join(f"{c} {g:.3f}" for c, g in geo.items()))
        for config in [c for c in args.detail.split(",") if c in details and batch == 1]:
            for name, s in zip(names, details[config], strict=True):
                used = ", ".join(f"{src} {v['iterations']} it {v['accepted_tokens']}/{v['draft_tokens']}"
                                 + (f" ev {v['evidence_matches']}/{v['evidence_positions']}"
                                    if v["evidence_positions"] else "") for src, v in s.sources.items())
                print(f"  {config} {name}: k {dict(sorted(s.draft_len_counts.items()))}; {used}")
    time.perf_counter = real_clock


if __name__ == "__main__":
    main()
