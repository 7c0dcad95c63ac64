"""Replay a GPU's step costs on real greedy outputs computed here, to tune draft policies without the GPU.

    python bench/policy_emulation.py [--model PATH] [--prompts summary,code-edit] [--step-ms 1.65] [--sync-ms 0.25]

Tokens come from the real model on this machine (llama.cpp on CPU by default); time comes from a virtual clock
that each target forward advances by what it would cost on the emulated device: `--step-ms` for up to 9 rows (one
graphed step on an H200, flat in the rows it holds; more rows replay it again) plus `--sync-ms` when the forward's
logits are read back at once (a verify, as opposed to plain steps queued RUN_AHEAD to a sync). The decode loop and
the policy run unchanged and are charged that clock, so the speedups printed are what the policy would earn on
that device with these outputs (which may differ from the GPU's own bf16 outputs). Prompt lookup only: a draft
model's costs would need its own emulated step. Emulated numbers: label them so.
"""

from __future__ import annotations

import argparse
import time

import tandem
from tandem.bench.suite import load_suite
from tandem.sampling import SamplingParams
from tandem.spec.calibrate import policy_for
from tandem.spec.decoder import RUN_AHEAD, SpeculativeDecoder
from tandem.spec.policy import FixedPolicy
from tandem.spec.proposer import NgramProposer

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

    def __getattr__(self, name):
        return getattr(self.seq, name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--backend", default="llama.cpp")
    p.add_argument("--prompts", default="code,freeform,json,summary,code-edit")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=1.65, help="one graphed forward of up to 9 rows [H200: 1.65]")
    p.add_argument("--sync-ms", type=float, default=0.25, help="a forward read back at once [H200: ~0.25]")
    p.add_argument("--configs", default="adaptive,fixed8")
    args = p.parse_args()

    model = tandem.load(args.model, device="cpu", backend=args.backend)
    clock = VirtualClock()
    time.perf_counter = clock  # the decode loop's and the calibration's clock; nothing else runs in this process
    new_sequence = model.new_sequence
    model.new_sequence = lambda *a, **k: EmulatedSequence(new_sequence(*a, **k), clock, args.step_ms, args.sync_ms)

    def decode(ids: list[int], config: str):
        proposer = None if config == "plain" else NgramProposer("cpu")
        policy = (None if proposer is None else FixedPolicy(int(config[5:])) if config.startswith("fixed")
                  else policy_for(model, proposer, 8))
        decoder = SpeculativeDecoder(model, SamplingParams(), proposer, policy, max_tokens=args.max_tokens,
                                     run_ahead=RUN_AHEAD)
        tokens = [t for chunk in decoder.run(ids) for t in chunk]
        s = decoder.stats
        return tokens, (s.generated_tokens - 1) / s.decode_ms, s

    prompts = {p.name: p for p in load_suite("default", args.prompts)}
    print(f"EMULATED: step {args.step_ms} ms for <= {GRAPH_ROWS} rows, sync {args.sync_ms} ms; outputs from "
          f"{args.backend} on CPU")
    for name, prompt in prompts.items():
        ids = model.tokenizer.encode_chat(list(prompt.messages))
        plain, base, _ = decode(ids, "plain")
        cells = []
        for config in args.configs.split(","):
            tokens, rate, s = decode(ids, config)
            assert tokens == plain, f"{name}/{config}: output differs from plain decoding"
            cells.append(f"{config} {rate / base:.2f}x (acceptance {s.acceptance_rate:.2f})")
        print(f"{name:10s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
