"""Where an engine step's time goes in the loop: each decoding step timed whole and in its parts (the plan, with
any evidence read; the draft, its catch-up and steps; the target's forward; the host's reading of its rows,
verification.read_outcomes; the rest, bookkeeping), keyed by the target's rows in the forward before and in this
one ("N (prompts)": a step that took in prompt rows), with the steps' total. What a step costs beyond the forwards
the calibration timed alone, whether a change of shape is where it goes, and what a round's prompt steps cost an
engine that drafts against one that does not. Used by bench/regime_trace.py and bench/gpu_report_regime.py
--step-parts.
"""

from __future__ import annotations

import functools
import statistics
import time

from tandem.engine import Engine

PARTS = ("step", "plan", "draft", "forward", "outcomes")


class StepParts:
    """Per (engine kind, sequences, rows before, rows): each step's ms of every part."""

    def __init__(self) -> None:
        self.steps: dict[tuple, list[tuple[float, ...]]] = {}

    def instrument(self, engine: Engine) -> None:
        kind = "adaptive" if engine.drafter is not None else "plain"
        step, plan, propose = engine.step, engine._plan, engine._propose
        forward, picking, outcomes = engine.target_kv.forward, engine.target_kv.forward_picking, engine._outcomes
        now: dict[str, float] = {}
        shape = {"before": None}

        def timed(name, fn):
            def run(*a, **k):
                started = time.perf_counter()
                out = fn(*a, **k)
                now[name] = now.get(name, 0.0) + 1000.0 * (time.perf_counter() - started)
                return out
            return run

        def timed_forward(batch, last_only, *picks, forward=forward):
            now["rows"], now["sequences"], now["prompts"] = sum(len(r) for _, r in batch), len(batch), any(last_only)
            return timed("forward", forward)(batch, last_only, *picks)

        def timed_step():
            now.clear()
            out = timed("step", step)()
            if "rows" in now:  # a step through the target's forward (not a lone sequence's queued plain steps)
                rows = f"{now['rows']} (prompts)" if now["prompts"] else now["rows"]
                self.steps.setdefault((kind, now["sequences"], shape["before"], rows), []).append(
                    tuple(now.get(p, 0.0) for p in PARTS))
                shape["before"] = now["rows"]
            return out

        engine.step, engine._plan, engine._propose = timed_step, timed("plan", plan), timed("draft", propose)
        engine.target_kv.forward, engine._outcomes = timed_forward, timed("outcomes", outcomes)
        engine.target_kv.forward_picking = functools.partial(timed_forward, forward=picking)

    def clear(self) -> None:
        self.steps.clear()

    def table(self) -> list[dict]:
        """One entry per key: the steps seen and the median ms of each part, and of the rest (step - parts)."""
        rows = []
        for (kind, sequences, before, rows_now), times in sorted(self.steps.items(), key=lambda kv: str(kv[0])):
            entry = {"engine": kind, "sequences": sequences, "rows_before": before, "rows": rows_now,
                     "n": len(times)}
            for i, part in enumerate(PARTS):
                entry[part] = round(statistics.median(t[i] for t in times), 3)
            entry["rest"] = round(statistics.median(t[0] - sum(t[1:]) for t in times), 3)
            entry["total"] = round(sum(t[0] for t in times), 1)
            rows.append(entry)
        return rows

    def lines(self) -> list[str]:
        head = "(engine, sequences, rows before, rows): n, medians of ms: " + ", ".join(PARTS) + ", rest; total ms"
        return [head] + [f"({e['engine']}, {e['sequences']}, {e['rows_before']}, {e['rows']}) {e['n']} " +
                         " ".join(f"{e[p]:.2f}" for p in (*PARTS, "rest")) + f"; {e['total']:.1f}"
                         for e in self.table()]
