"""`tandem.generate` as `tandem bench` and lab/gpu_report_regime.py run it, at a GPU's measured costs on a virtual
clock (no GPU needed). EMULATED: label what it prints so.

    python lab/generate_emulation.py --graph vulkan --verify-excess-ms 0.8 \
        --regime bench/results/h100-2026-12-06g-remeasure/1-vulkan/regime_vulkan_Q4_0_1.5b.json

One engine serves every run, as tandem.generate's kept engine does: per prompt a short warm-up of the adaptive and
the fixed-length request, then rounds of both, each run's prompt read afresh (forget_prefixes), each seeded by the
prompt's name as the bench seeds them. Each run prints its iterations (`k:accepted`, `.` a plain step): what showed
that two rejected drafts at the start kept a Vulkan request plain to its end. The draft's catch-up is priced per row
as the call measured it (--catch-up-ms-per-token; regime_emulation.py prices it at 0.22).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib

import numpy as np
from engine_emulation import HOST_MS, VirtualClock  # bench/
from regime_emulation import GRAPH_MS, Emulated, costs_of
from step_parts import iterations, iterations_traced

import tandem
from tandem.engine import Engine, Request
from tandem.engine.generation import DRAFT_MODEL
from tandem.sampling import SamplingParams
from tandem.synthetic.tiny_gguf import write_tiny_gguf

PROMPT_TOKENS = 48
WARMUP_TOKENS = 16  # tandem.bench.bench's warm-up length


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regime", required=True, help="a regime run's JSON (its costs.batched)")
    p.add_argument("--graph", default="vulkan", choices=["cuda", "vulkan", "none"])
    p.add_argument("--verify-excess-ms", type=float, default=0.0, help="in-loop verifies cost this much more")
    p.add_argument("--catch-up-ms-per-token", type=float, default=0.67, help="a catch-up row (H100, Vulkan: 0.67)")
    p.add_argument("--acceptance", type=float, default=0.8)
    p.add_argument("--prompts", default="code0,code1", help="names: each seeds its runs' draws")
    p.add_argument("--fixed", type=int, default=2, help="the fixed draft length run beside adaptive")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    with open(args.regime) as f:
        regime = json.load(f)
    target_cost, step_cost = costs_of(regime)

    def draft_cost(sequences: int, rows: int) -> float:
        extra = max(0, rows - sequences) * args.catch_up_ms_per_token
        return step_cost(sequences, sequences) + extra

    root = tempfile.mkdtemp(prefix="tandem-emulation-")
    target, draft = (tandem.load(write_tiny_gguf(os.path.join(root, f"{name}.gguf"), seed=seed, context_length=2048),
                                 backend="llama.cpp", n_ctx=1024) for name, seed in (("t", 1), ("d", 2)))
    draft.steady_shapes = args.graph != "none"
    clock = VirtualClock()
    graph = GRAPH_MS.get(args.graph, {"target": 0.0, "draft": 0.0})
    real_clock, time.perf_counter = time.perf_counter, clock  # the engine's clock; nothing else times here
    try:
        engine = Engine(target, draft, slots=1, n_ctx=1024, draft_max=8, synthetic_acceptance=args.acceptance,
                        prompt_lookup=False, measure_costs=False)
        engine.target_kv = Emulated(engine.target_kv, clock, target_cost, graph["target"], 0.0, args.verify_excess_ms)
        engine.drafter.kv = Emulated(engine.drafter.kv, clock, draft_cost, graph["draft"], 0.0)
        engine.target_kv.calibrating = True
        engine.calibrate()
        engine.target_kv.calibrating = False
        rng = np.random.default_rng(0)
        print(f"EMULATED: {regime['costs'].get('device_name', '?')}, acceptance {args.acceptance}, in-loop verifies "
              f"+{args.verify_excess_ms} ms, a catch-up row {args.catch_up_ms_per_token} ms")

        def run(name: str, prompt: list[int], policy: str, k: int, tokens: int) -> tuple[float, str]:
            engine.kv.forget_prefixes()
            gen = engine.add(Request(prompt, SamplingParams(seed=zlib.crc32(name.encode())), max_tokens=tokens,
                                     ignore_eos=True, draft_max=k, draft_policy=policy))
            started = clock.now
            while engine.busy:
                engine.step()
                clock.advance(HOST_MS[0] + HOST_MS[1])
            return gen.emitted / (clock.now - started), iterations(gen.stats)

        for name in args.prompts.split(","):
            prompt = rng.integers(10, target.vocab_size - 10, PROMPT_TOKENS).tolist()
            configs = (("adaptive", "adaptive", 8), (f"fixed{args.fixed}", "fixed", args.fixed))
            for _, policy, k in configs:
                run(name, prompt, policy, k, WARMUP_TOKENS)
            for r in range(args.rounds):
                for label, policy, k in configs:
                    with iterations_traced():
                        rate, steps = run(name, prompt, policy, k, args.max_tokens)
                    print(f"{name} round {r} {label:9s} {rate:6.1f} tok/s (virtual, its prompt read included)  {steps}")
            print(f"  prior after {name}: {tuple(round(x, 2) for x in engine.prior.counts(DRAFT_MODEL))}")
    finally:
        time.perf_counter = real_clock
    return 0


if __name__ == "__main__":
    sys.exit(main())
