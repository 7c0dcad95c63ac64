"""Why the engine drafted or did not: the regime bench's flow (lab/gpu_report_regime.py: tandem.generate's
runs first, then the engine at each concurrency) with every step's plan printed (draft lengths, and per sequence
its acceptance estimate, the draft's lag, whether the draft took in the prompt, whether its first read was
declined) and the shared acceptance prior between the parts. Synthetic acceptance, random weights welcome.

  python lab/regime_trace.py --model T.gguf --draft D.gguf --device vulkan --acceptance 0.8 --concurrency 1,2

Replay: --replay REGIME.json (a regime run's costs, lab/gpu_report_regime.py --json) plans with that machine's
costs, frozen (the loop's timings do not refine them), on whatever models and machine run this: the GPU's decisions
reproduced on a CPU with tiny models (its speeds are meaningless then; the plans are the point).
"""

from __future__ import annotations

import argparse
import json
import sys

import gpu_report_regime
from gpu_report_regime import load, parse_args, run_engine, run_generate
from step_parts import StepParts

from tandem.engine import Engine, calibration
from tandem.engine.costs import BatchCosts
from tandem.engine.generation import DRAFT_MODEL
from tandem.engine.policy import DraftPolicy
from tandem.speculative.policy import shared_prior

STEPS_SHOWN = 12  # the first plans of each engine run, and every one that drafted
PARTS = StepParts()


def replayed(path: str, switch_ms: float, catch_up: tuple[float, float]) -> BatchCosts:
    """The costs of a regime run's JSON as the engine's BatchCosts (what measure would have found there)."""
    from tandem.engine.costs import BatchCosts, CostModel
    batched = json.load(open(path))["costs"]["batched"]
    return BatchCosts(
        verify={int(b): CostModel(0.0, {int(n): v for n, v in c["verify_ms"].items()}) for b, c in batched.items()},
        draft_step={int(b): c["draft_step_ms"] for b, c in batched.items()},
        catch_up_base_ms=catch_up[0], catch_up_ms_per_token=catch_up[1], switch_ms=switch_ms)


def main(argv: list[str] | None = None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--replay", help="a regime run's JSON: plan with its costs, frozen")
    extra.add_argument("--switch-ms", type=float, default=0.0, help="with --replay: a change of shape's price")
    extra.add_argument("--catch-up", default="2.0,0.05", help="with --replay: a catch-up's base ms, ms a token")
    known, rest = extra.parse_known_args(argv if argv is not None else sys.argv[1:])
    args = parse_args(rest)
    target, draft = load(args.model, args), load(args.draft, args)
    plans: list[tuple] = []
    plan = DraftPolicy.plan
    engines, made = [], []
    init = Engine.__init__

    def recorded(self: Engine, *a, **k) -> None:
        init(self, *a, **k)
        made.append(self)

    Engine.__init__ = recorded

    def traced(self: DraftPolicy, decoding, prefill_rows):
        engine = next(e for e in made if e.policy is self)
        if not engines or engines[-1] is not engine:
            if all(e is not engine for e in engines):
                PARTS.instrument(engine)
            engines.append(engine)
        ks = plan(self, decoding, prefill_rows)
        if self.drafter is not None:
            plans.append((tuple(ks), [(round(g.acceptance(DRAFT_MODEL), 3), self.drafter.lag(g), g.draft_prefill,
                                       g.draft_declined) for g in decoding if DRAFT_MODEL in g.estimates]))
        return ks

    DraftPolicy.plan = traced
    # Every step the loop timed against its costs, by round (0: the warm-up), with the overrun it learned after:
    # which steps taught the overrun that keeps drafting off.
    observed: list[tuple] = []
    round_of: dict[int, int] = {}
    engine_round = gpu_report_regime.engine_round

    def counted_round(engine, *a, **k):
        round_of[id(engine)] = round_of.get(id(engine), -1) + 1
        return engine_round(engine, *a, **k)

    gpu_report_regime.engine_round = counted_round
    observe = BatchCosts.observe_iteration

    def observed_iteration(self, batch, drafting, predicted_ms, ms):
        observe(self, batch, drafting, predicted_ms, ms)
        engine = next((e for e in engines if e.costs is self), None)
        observed.append((round_of.get(id(engine), -1), batch, drafting, engine.policy.previous_rows if engine else None,
                         engine.policy.shape_run if engine else None, predicted_ms, ms, self.drafting_overrun(batch)))

    measure = calibration.measure

    def measured(*a, **k):
        costs = measure(*a, **k) if known.replay is None else \
            replayed(known.replay, known.switch_ms, tuple(float(x) for x in known.catch_up.split(",")))
        verify = {b: {n: round(v, 2) for n, v in m.verify_ms.items()} for b, m in costs.verify.items()}
        draft = {b: round(v, 2) for b, v in costs.draft_step.items()}
        print("  engine costs: V", verify, "draft", draft, "catch-up base", round(costs.catch_up_base_ms, 2),
              "per token", round(costs.catch_up_ms_per_token, 3), "switch", round(costs.switch_ms, 2), flush=True)
        return costs

    calibration.measure = measured
    if known.replay is None:
        BatchCosts.observe_iteration = observed_iteration
    if known.replay is not None:  # frozen: this machine's timings must not refine the replayed costs
        BatchCosts.observe_draft = lambda *a, **k: None
        BatchCosts.observe_iteration = lambda *a, **k: None
    prior = shared_prior(target)
    for a in args.acceptance:
        print("generate", run_generate(target, draft, a, args), flush=True)
        print("prior after generate", prior.counts(DRAFT_MODEL), flush=True)
        for n in args.concurrency:
            plans.clear()
            observed.clear()
            row = run_engine(target, draft, a, n, args)
            print(f"engine x{n}", row, "prior", prior.counts(DRAFT_MODEL), flush=True)
            for e in {id(e): e for e in engines if e.costs is not None}.values():  # what the loop learned
                c = e.costs
                print("  learned: draft", {b: round(v, 2) for b, v in c.draft_step.items()}, "overrun",
                      {b: round(c.drafting_overrun(b), 2) for b in c.verify}, "shape run", round(c.shape_run, 1),
                      "drafting run", round(c.drafting_run, 1))
            for line in PARTS.lines():
                print("   ", line)
            PARTS.clear()
            engines.clear()
            print("  timed steps (round, batch, drafting, rows, shape run, predicted ms, ms, overrun after): every "
                  "drafting one and its plain neighbours")
            for i, o in enumerate(observed):
                if any(observed[j][2] for j in range(max(0, i - 1), min(len(observed), i + 2))):
                    print("   ", o[:5], *(round(x, 2) for x in o[5:]))
            drafting = [p for p in plans if any(p[0])]
            print(f"  plans {len(plans)}, drafting {len(drafting)}")
            for ks, seqs in plans[:STEPS_SHOWN] + drafting[:STEPS_SHOWN]:
                print("   ", ks, seqs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
