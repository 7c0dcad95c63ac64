"""Replay a GPU's step costs on real greedy outputs computed here, to tune draft policies without the GPU.

    python bench/policy_emulation.py [--model PATH] [--draft NAME] [--prompts summary,code-edit] [--step-ms 1.65]
        [--draft-step-ms 0.75] [--sync-ms 0.25] [--configs plain,adaptive,draft,ngram,fixed3,fixed8]

Tokens come from the real models on this machine (llama.cpp on CPU by default); time comes from a virtual clock
that each forward advances by what it would cost on the emulated device: `--step-ms` for a target forward of up to
9 rows (one graphed step on an H200, flat in the rows it holds; more rows replay it again) plus `--sync-ms` when the
forward's logits are read back at once (a verify, as opposed to plain steps queued RUN_AHEAD to a sync), and
`--draft-step-ms` for a draft forward of up to 9 rows (a launch-bound draft: its catch-up on a 60-token prompt is 7
replays). The decode loop and the policy run unchanged and are charged that clock, so the speedups printed are
what the policy would earn on that device with these outputs (which may differ from the GPU's own bf16 outputs).
Configs: adaptive (the default: prompt lookup mixed with the draft), draft (the draft alone, adaptive), ngram
(lookup alone, adaptive), fixedN (the draft alone, N a step), ngram-fixedN (lookup alone, N a step). Requests run
prompt by prompt in one process, so the shared acceptance prior learns as a server's would. Emulated numbers:
label them so.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch

import tandem
from tandem.bench.suite import load_suite
from tandem.sampling import SamplingParams
from tandem.speculative.calibrate import COSTS_DIR_ENV, NGRAM_STEP_MS, policy_for
from tandem.speculative.decoder import RUN_AHEAD, SpeculativeDecoder
from tandem.speculative.policy import CostModel, FixedPolicy
from tandem.speculative.proposer import DraftModelProposer, MixedProposer, NgramProposer

GRAPH_ROWS = 9


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class EmulatedSequence:
    """A real sequence whose forwards advance the virtual clock by the emulated device's cost."""

    def __init__(self, seq, clock: VirtualClock, step_ms: float, sync_ms: float) -> None:
        self.seq, self.clock, self.step_ms, self.sync_ms = seq, clock, step_ms, sync_ms

    def forward(self, tokens, logits="all"):
        replays = -(-len(tokens) // GRAPH_ROWS)
        self.clock.now += (replays * self.step_ms + (self.sync_ms if logits == "all" else 0.0)) / 1000.0
        return self.seq.forward(tokens, logits)

    def rewind(self, length):
        return self.seq.rewind(length)

    def __getattr__(self, name):
        return getattr(self.seq, name)


class OracleSequence:
    """The target's sequence once its greedy reply is known: each row's logits are one-hot on the next token of
    that reply. Exact for greedy verification, which reads a row only while every token before it is the reply's
    own, and it spares recomputing the target per config (minutes a prompt on a busy 2-core CPU)."""

    def __init__(self, reply: list[int], vocab: int, capacity: int) -> None:
        self.reply, self.vocab, self.capacity, self.length = reply, vocab, capacity, 0

    def forward(self, tokens, logits="all"):
        n = len(tokens)
        out = torch.zeros(n, self.vocab)
        for i in range(n):
            position = self.length + i + 1
            out[i, self.reply[position] if position < len(self.reply) else 0] = 1.0
        self.length += n
        return out if logits == "all" else out[-1:]

    def rewind(self, length):
        self.length = length

    def close(self):
        pass


def emulate(model, clock: VirtualClock, step_ms: float, sync_ms: float) -> None:
    new_sequence = model.new_sequence
    model.new_sequence = lambda *a, **k: EmulatedSequence(new_sequence(*a, **k), clock, step_ms, sync_ms)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="draft model ('' for none)")
    p.add_argument("--backend", default="llama.cpp")
    p.add_argument("--prompts", default="code,freeform,json,summary,code-edit")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=1.65, help="one graphed forward of up to 9 rows [H200: 1.65]")
    p.add_argument("--draft-step-ms", type=float, default=0.75, help="a draft forward of up to 9 rows [H200: 0.75]")
    p.add_argument("--sync-ms", type=float, default=0.25, help="a forward read back at once [H200: ~0.25]")
    p.add_argument("--configs", default="plain,adaptive,draft,ngram,fixed3,fixed8")
    args = p.parse_args()
    # Costs measured on the virtual clock must neither land in nor come from the real device's cache.
    os.environ[COSTS_DIR_ENV] = tempfile.mkdtemp(prefix="tandem-emulated-costs-")

    model = tandem.load(args.model, device="cpu", backend=args.backend)
    draft = tandem.load(args.draft, device="cpu", backend=args.backend) if args.draft else None
    clock = VirtualClock()
    time.perf_counter = clock  # the decode loop's and the calibration's clock; nothing else runs in this process
    emulate(model, clock, args.step_ms, args.sync_ms)
    if draft is not None:
        emulate(draft, clock, args.draft_step_ms, 0.0)
    # What calibration would measure on the virtual clock, without its forwards (minutes on a busy 2-core CPU):
    # V(n) replays the step per 9 rows and reads back; a draft step is one replay, a catch-up of 8 tokens too.
    verify_ms = {n: -(-n // GRAPH_ROWS) * args.step_ms + args.sync_ms for n in (1, 2, 9)}
    model.__dict__["_tandem_costs"] = {
        (id(None), 8): CostModel(NGRAM_STEP_MS, dict(verify_ms), 0.0),
        (id(draft), 8): CostModel(args.draft_step_ms, dict(verify_ms), args.draft_step_ms / 8),
    }

    real_sequence = model.new_sequence
    oracle: list[list[int]] = []  # the prompt's full greedy sequence once plain decoding has computed it

    def target_sequence(*a, **k):
        if not oracle:
            return real_sequence(*a, **k)
        return EmulatedSequence(OracleSequence(oracle[0], model.vocab_size, model.n_ctx), clock, args.step_ms,
                                args.sync_ms)

    model.new_sequence = target_sequence

    def decode(ids: list[int], config: str):
        params = SamplingParams()
        lookup = NgramProposer("cpu")
        model_proposer = DraftModelProposer(draft, params, model.vocab_size, "cpu") if draft is not None else None
        kind, _, fixed = config.partition("fixed")
        proposer = {"plain": None, "adaptive": MixedProposer(model_proposer, lookup) if model_proposer else None,
                    "draft": model_proposer, "ngram": lookup, "ngram-": lookup, "": model_proposer}[kind]
        policy = (None if proposer is None else FixedPolicy(int(fixed)) if fixed
                  else policy_for(model, proposer, 8))
        decoder = SpeculativeDecoder(model, params, proposer, policy, max_tokens=args.max_tokens,
                                     run_ahead=RUN_AHEAD)
        tokens = [t for chunk in decoder.run(ids) for t in chunk]
        s = decoder.stats
        return tokens, (s.generated_tokens - 1) / s.decode_ms, s

    configs = [c for c in args.configs.split(",") if c != "plain"]
    prompts = {p.name: p for p in load_suite("default", args.prompts)}
    print(f"EMULATED: target step {args.step_ms} ms for <= {GRAPH_ROWS} rows, sync {args.sync_ms} ms, draft step "
          f"{args.draft_step_ms} ms for <= {GRAPH_ROWS} rows; outputs from {args.backend} on CPU; "
          f"{args.max_tokens} tokens; speed-up over plain decode tok/s (acceptance)")
    ratios: dict[str, list[float]] = {c: [] for c in configs}
    for name, prompt in prompts.items():
        ids = model.tokenizer.encode_chat(list(prompt.messages))
        oracle.clear()
        plain, base, plain_stats = decode(ids, "plain")
        eos = list(model.tokenizer.eos_token_ids)[:1] if plain_stats.generated_tokens < args.max_tokens else []
        oracle.append(ids + plain + eos)
        cells, last_stats = [], {}
        for config in configs:
            tokens, rate, s = decode(ids, config)
            if config == "adaptive":
                last_stats[config] = s
            assert tokens == plain, f"{name}/{config}: output differs from plain decoding"
            ratios[config].append(rate / base)
            cells.append(f"{config} {rate / base:.3f} ({s.acceptance_rate:.2f})")
        print(f"{name:10s} " + " | ".join(cells), flush=True)
        if details := {c: st for c, st in last_stats.items() if st.sources}:
            for config, st in details.items():
                used = ", ".join(f"{src} {v['iterations']} it {v['accepted_tokens']}/{v['draft_tokens']}"
                                 + (f" ev {v['evidence_matches']}/{v['evidence_positions']}"
                                    if v["evidence_positions"] else "") for src, v in st.sources.items())
                print(f"{'':10s}   {config}: k {st.draft_len_counts}; {used}", flush=True)
    geomeans = {c: math.exp(sum(math.log(r) for r in rs) / len(rs)) for c, rs in ratios.items()}
    print("geomean    " + " | ".join(f"{c} {g:.3f}" for c, g in geomeans.items()), flush=True)


if __name__ == "__main__":
    main()
