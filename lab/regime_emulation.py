"""The batched engine at a GPU's measured costs, its learning on: plain against adaptive, at synthetic acceptance, on
a virtual clock (no GPU needed). EMULATED: label what it prints so.

    python lab/regime_emulation.py --regime bench/results/h100-2026-12-05f-regime/regime_cuda_before.json \
        --graph cuda --acceptance 0.8 --concurrency 1,2,4

Every forward advances the clock by what the regime run (lab/gpu_report_regime.py --json) timed for its batch
and rows: the target's V(B, rows) and the draft's step, interpolated as the planner does (random-weight tiny models
give the tokens; synthetic acceptance makes them irrelevant). A graph model adds what a change of shape costs:
llama.cpp rebuilds a context's graph when a forward's rows differ from the one before, and its CUDA build runs that
forward uncaptured and captures the next (ggml-cuda's warm-up) before it replays:
  --graph cuda    the first forward after a change +FIRST ms, the second +SECOND where its kernels are those of the
                  graph ggml holds captured (both at most KERNEL_ROWS rows, or both more: the graph is updated in
                  place), else +CAPTURE (a new graph instantiated)
  --graph vulkan  the first +FIRST (the second reuses the graph)
  --graph none
--verify-excess-ms X adds X to every target forward of more rows than sequences (a verify) and nothing to the
calibration's timings (which set the clock's costs aside while the engine measures): an in-loop cost no
calibration sees, as on the H100 at 2 requests (4- and 6-row verifies 23.0 and 25.9 ms in the loop against 15.2
and 19.5 timed alone: the captures, priced too low then).
FIRST defaults to what lab/llamacpp_graph_reuse.py measured on an H100 (h100-2026-12-05f-regime: target +2.9 ms
CUDA, +4.1 Vulkan; a 1.5B draft +2.3 / +1.7). CUDA's SECOND and CAPTURE for the target are from the H100's changes
(h100-2026-12-06c-switch-price: 1 <-> 2 rows 7.2 ms a change in all, 1 <-> 4 rows 17.6); the draft's are FIRST and
twice FIRST, an assumption (its steady shapes make them rare). The engine measures its costs at start-up through
the same clock, so its calibration sees what a GPU's would, and refines them from its steps as it would there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from engine_emulation import HOST_MS, Timed, VirtualClock  # bench/: its virtual clock and timed cache

import tandem
from tandem.backends.base import BatchedCache
from tandem.engine import Engine, Request
from tandem.engine.costs import CostModel
from tandem.sampling import SamplingParams
from tandem.synthetic.tiny_gguf import write_tiny_gguf

GRAPH_MS = {"cuda": {"target": 2.9, "draft": 2.3}, "vulkan": {"target": 4.1, "draft": 1.7}}
CAPTURE_MS = {"target": (4.3, 14.7), "draft": (2.3, 4.6)}  # CUDA's second forward: (graph updated, instantiated)
KERNEL_ROWS = 2  # forwards of at most this many rows and of more take other kernels (ggml-cuda's attention)
PROMPT_TOKENS = 48
DRAFT_LENS: dict[int, int] = {}  # draft length -> iterations, of the runs since cleared (a sequence each)


class Emulated(Timed):
    """A batched cache whose forwards advance the clock by `cost(sequences, rows)` plus the graph model's price of
    a change of shape (rows differing from the forward before)."""

    def __init__(self, cache: BatchedCache, clock: VirtualClock, cost, first_ms: float, second_ms: float,
                 excess_ms: float = 0.0, capture_ms: float | None = None, readout_ms: float = 0.0) -> None:
        super().__init__(cache, clock, {})
        self.cost, self.excess_ms, self.calibrating, self.readout_ms = cost, excess_ms, False, readout_ms
        self.first_ms, self.second_ms = first_ms, second_ms
        self.capture_ms = second_ms if capture_ms is None else capture_ms
        self.rows, self.run, self.captured = None, 0, None

    def forward(self, batch, last_only):
        rows = sum(len(tokens) for _, tokens in batch)
        self.run = self.run + 1 if rows == self.rows else 1
        self.rows = rows
        extra = self.first_ms if self.run == 1 else 0.0
        if self.run == 2:
            kernels = rows <= KERNEL_ROWS
            extra = self.second_ms if kernels == self.captured else self.capture_ms
            self.captured = kernels
        if rows > len(batch) and not self.calibrating:
            extra += self.excess_ms
        read = sum(1 if last else len(tokens) for (_, tokens), last in zip(batch, last_only, strict=True))
        extra += self.readout_ms * (read - len(batch))
        self.clock.advance(self.cost(len(batch), rows) + extra)
        return self.cache.forward(batch, last_only)


def costs_of(regime: dict):
    """(target cost, draft cost) functions of (sequences, rows) from a regime run's batched costs."""
    batched = {int(b): c for b, c in regime["costs"]["batched"].items()}
    verify = {b: CostModel(0.0, {int(n): v for n, v in c["verify_ms"].items()}) for b, c in batched.items()}
    sizes = sorted(batched)

    def bucket(n: int) -> int:
        return min([b for b in sizes if b >= n], default=sizes[-1])

    widest = verify[sizes[-1]]

    def target(sequences: int, rows: int) -> float:
        # past the rows a batch size was timed at (a prompt's, say), the widest batch's table: a line from its
        # last points (one batch size's last slope, Vulkan's 8-to-9-row cliff, would price a prompt at seconds)
        table = verify[bucket(sequences)]
        return table.verify(rows) if rows <= max(table.verify_ms) else max(widest.verify(rows), table.verify(
            max(table.verify_ms)))

    def draft(sequences: int, rows: int) -> float:
        per_step = float(np.interp(sequences, sizes, [batched[b]["draft_step_ms"] for b in sizes]))
        # a catch-up over more rows than sequences: the regime's one-sequence base and slope (a few ms), else a step
        return per_step if rows <= sequences else per_step + 0.22 * (rows - sequences)

    return target, draft


def run(engine: Engine, clock: VirtualClock, n: int, max_tokens: int, vocab: int, round_: int) -> tuple[float, int]:
    """n requests together: their tokens per second (virtual), and the draft tokens they verified."""
    rng = np.random.default_rng(round_)
    requests = [Request(rng.integers(10, vocab - 10, PROMPT_TOKENS).tolist(), SamplingParams(seed=round_ * 100 + i),
                        max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    start = clock.now
    gens = [engine.add(r) for r in requests]
    while engine.busy:
        running = len(engine.batch.running)
        engine.step()
        clock.advance(HOST_MS[0] + HOST_MS[1] * running)
    for g in gens:
        for k, count in g.stats.draft_len_counts.items():
            DRAFT_LENS[k] = DRAFT_LENS.get(k, 0) + count
    return sum(g.emitted for g in gens) / (clock.now - start), sum(g.stats.draft_tokens for g in gens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regime", required=True, help="a regime run's JSON (its costs.batched)")
    p.add_argument("--graph", default="cuda", choices=["cuda", "vulkan", "none"])
    p.add_argument("--first-ms", type=float, help="target's first forward after a change [measured: see above]")
    p.add_argument("--second-ms", type=float, help="target's second forward after a change, the graph updated")
    p.add_argument("--capture-ms", type=float, help="... a new graph instantiated (other kernels)")
    p.add_argument("--verify-excess-ms", type=float, default=0.0, help="in-loop verifies cost this much more")
    p.add_argument("--acceptance", default="0.8")
    p.add_argument("--concurrency", default="1,2,4")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds after a warm-up round (median)")
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--readout-ms", type=float, default=0.0, help="the draft's logits row read back, past a forward's "
                   "last (an evidence read's; a calibration reading every row)")
    args = p.parse_args(argv)
    with open(args.regime) as f:
        regime = json.load(f)
    target_cost, draft_cost = costs_of(regime)
    graph = GRAPH_MS.get(args.graph, {"target": 0.0, "draft": 0.0})
    first = {"target": args.first_ms if args.first_ms is not None else graph["target"], "draft": graph["draft"]}
    second = {k: (CAPTURE_MS[k][0] if args.graph == "cuda" else 0.0) for k in first}
    capture = {k: (CAPTURE_MS[k][1] if args.graph == "cuda" else 0.0) for k in first}
    if args.second_ms is not None:
        second["target"] = args.second_ms
    if args.capture_ms is not None:
        capture["target"] = args.capture_ms

    root = tempfile.mkdtemp(prefix="tandem-emulation-")
    target, draft = (tandem.load(write_tiny_gguf(os.path.join(root, f"{name}.gguf"), seed=seed, context_length=2048),
                                 backend="llama.cpp", n_ctx=1024) for name, seed in (("t", 1), ("d", 2)))
    draft.steady_shapes = args.graph != "none"  # as llama.cpp's GPU builds have it
    clock = VirtualClock()
    real_clock, time.perf_counter = time.perf_counter, clock  # the engine's clock; nothing else times here
    print(f"EMULATED: costs of {args.regime} ({regime['costs'].get('device_name', '?')}), graph model {args.graph}: "
          f"target +{first['target']} / +{second['target']} ms, draft +{first['draft']} / +{second['draft']} ms the "
          f"first / second forward after a change of shape (a new graph: +{capture['target']} / "
          f"+{capture['draft']}); host {HOST_MS[0]} + {HOST_MS[1]} ms a sequence a step; "
          f"in-loop verifies +{args.verify_excess_ms} ms; a draft's logits row read back +{args.readout_ms} ms")
    print(f"{'a':>4} {'n':>3} {'plain t/s':>10} {'adaptive':>9} {'speedup':>8}  drafted  learned")
    try:
        for a in (float(x) for x in args.acceptance.split(",")):
            for n in (int(x) for x in args.concurrency.split(",")):
                rates = {}
                for name, model in (("plain", None), ("adaptive", draft)):
                    engine = Engine(target, model, slots=n, n_ctx=1024, draft_max=args.draft_max,
                                    synthetic_acceptance=a if model else None, prompt_lookup=False,
                                    measure_costs=False)
                    engine.target_kv = Emulated(engine.target_kv, clock, target_cost, first["target"],
                                                second["target"], args.verify_excess_ms, capture["target"])
                    if engine.drafter is not None:
                        engine.drafter.kv = Emulated(engine.drafter.kv, clock, draft_cost, first["draft"],
                                                     second["draft"], capture_ms=capture["draft"],
                                                     readout_ms=args.readout_ms)
                        engine.target_kv.calibrating = True
                        engine.calibrate()
                        engine.target_kv.calibrating = False
                    run(engine, clock, n, args.max_tokens, target.vocab_size, 0)  # a warm-up round, as the regime's
                    DRAFT_LENS.clear()
                    rounds = [run(engine, clock, n, args.max_tokens, target.vocab_size, r)
                              for r in range(1, args.rounds + 1)]
                    rates[name] = [rate for rate, _ in rounds]
                    if engine.drafter is not None:
                        c = engine.costs
                        learned = f"overrun {c.drafting_overrun(n):.2f}, yield {c.yield_factor(n):.2f}, shape run " \
                                  f"{c.shape_run:.1f}, switch {c.switch_ms:.1f} ms"
                        drafted = sum(d for _, d in rounds)
                        learned += f"; k: {dict(sorted(DRAFT_LENS.items()))}"
                ratio = statistics.median(x / y for x, y in zip(rates["adaptive"], rates["plain"], strict=True))
                print(f"{a:4.2f} {n:3d} {statistics.median(rates['plain']):10.1f} "
                      f"{statistics.median(rates['adaptive']):9.1f} {ratio:7.3f}x  {drafted:7d}  {learned}",
                      flush=True)
    finally:
        time.perf_counter = real_clock
    return 0


if __name__ == "__main__":
    sys.exit(main())
