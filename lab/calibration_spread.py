"""How far the engine's calibration (tandem.engine.calibration.measure) moves between runs on one box, and why: it is
run ROUNDS times on one engine's caches, each run's figures printed; then the forwards its feed-ahead decision
rests on are timed one by one (a verify of k + 1 rows alone and with the draft's row fed beside it, taken in turn,
and the draft's one-row step), as percentiles, to tell a noisy host from a cost that moves.

On an H200 one calibration read the feed beside the verify at 4.10 ms and another, minutes before, at 1.05
(h200-2026-12-06-after-reread): fed ahead only below half a draft step, the engine paid a catch-up forward after
every step whose drafts all passed.

    python lab/calibration_spread.py --model T.gguf --draft D.gguf --device cuda --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import tandem
from tandem.config import POLICY
from tandem.engine import Engine, calibration
from tandem.engine.costs import BatchCosts

CONTEXT = calibration.CONTEXT


def _summary(costs: BatchCosts, k_max: int) -> str:
    v = costs.verify[1].verify_ms
    return (f"V(1) {v.get(1, float('nan')):.2f}  V({k_max + 1}) {v.get(k_max + 1, float('nan')):.2f}  "
            f"draft step {costs.draft_step.get(1, float('nan')):.3f}  ahead {costs.ahead_ms.get(1, float('nan')):.3f}"
            f" (feeds: {costs.feeds_ahead(1)})  catch-up {costs.catch_up_base_ms:.2f} + "
            f"{costs.catch_up_ms_per_token:.3f}/token  evidence row {costs.evidence_row_ms:.3f}  switch "
            f"{costs.switch_ms:.2f}")


def _percentiles(times: list[float]) -> str:
    q = statistics.quantiles(times, n=10, method="inclusive")
    return f"min {min(times):.3f}  p10 {q[0]:.3f}  median {statistics.median(times):.3f}  p90 {q[-1]:.3f}  " \
           f"max {max(times):.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=4, help="calibrations, one after another")
    p.add_argument("--forwards", type=int, default=30, help="forwards of each kind timed one by one")
    args = p.parse_args(argv)
    target = tandem.load(args.model, backend="llama.cpp", device=args.device, n_ctx=1024)
    draft = tandem.load(args.draft, backend="llama.cpp", device=args.device, n_ctx=1024)
    engine = Engine(target, draft, slots=1, measure_costs=False)
    tkv, dkv, sync = engine.target_kv, engine.drafter.kv, engine._synchronize
    print(f"{target.device}: {args.model} with {args.draft}; k_max {engine.draft_max}")
    for r in range(args.rounds):
        started = time.perf_counter()
        costs = calibration.measure(tkv, dkv, engine.draft_max, sync)
        print(f"calibration {r + 1} ({time.perf_counter() - started:.1f} s): {_summary(costs, engine.draft_max)}")

    # calibration._timed, as the calibration times them: the feed at the draft's position 0, rewound after; the draft's
    # step after CONTEXT tokens of its own
    rows = min(engine.draft_max, calibration.SWITCH_DRAFTS) + 1
    tkv.forward([(0, [0] * CONTEXT)], [True])
    times: dict[str, list[float]] = {"verify": [], "verify + feed": [], "draft step": []}
    for i in range(args.forwards + 2):  # two of each first, dropped: ggml-cuda captures its graph on the second
        forwards = {"verify": calibration._timed(tkv, [0], rows, sync),
                    "verify + feed": calibration._timed(tkv, [0], rows, sync, dkv)}
        dkv.forward([(0, [0] * CONTEXT)], [True])
        forwards["draft step"] = calibration._timed(dkv, [0], 1, sync, last_only=True)
        dkv.rewind(0, 0)
        for name, ms in forwards.items():
            if i >= 2:
                times[name].append(ms)
    print(f"{args.forwards} forwards each, taken in turn, ms:")
    for name, ts in times.items():
        print(f"  {name:>14}: {_percentiles(ts)}")
    added = [w - a for w, a in zip(times["verify + feed"], times["verify"], strict=True)]
    print(f"  {'feed added':>14}: {_percentiles(added)}  (half the draft step's median: "
          f"{POLICY.ahead_pays * statistics.median(times['draft step']):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
