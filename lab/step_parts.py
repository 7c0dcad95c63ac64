"""Where an engine step's time goes in the loop: each decoding step timed whole and in its parts (the plan, with any
evidence read; the draft, its catch-up and steps; the target's forward; the host's reading of its rows,
outcomes.read_outcomes; the rest, bookkeeping), keyed by the target's rows in the forward before and in this one ("N
(prompts)": a step that took in prompt rows), with the steps' total (the engine's step hook, StepTimes). What a step
costs beyond the forwards the calibration timed alone, whether a change of shape is where it goes, and what a round's
prompt steps cost an engine that drafts against one that does not. Used by lab/regime_trace.py and
lab/gpu_report_regime.py --step-parts.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.engine import Engine
from tandem.engine.engine import StepTimes
from tandem.engine.generation import DRAFT_MODEL
from tandem.speculative.stats import GenerationStats

PARTS = ("step", "plan", "draft", "forward", "outcomes")


class StepParts:
    """Per (engine kind, sequences, rows before, rows): each step's ms of every part."""

    def __init__(self) -> None:
        self.steps: dict[tuple, list[tuple[float, ...]]] = {}

    def instrument(self, engine: Engine) -> None:
        """Record every step of `engine` through the target's forward (its step hook; a lone sequence's queued
        plain steps are not among them)."""
        kind = "adaptive" if engine.drafter is not None else "plain"
        before = {"rows": None}

        def record(times: StepTimes) -> None:
            rows = f"{times.rows} (prompts)" if times.prompts else times.rows
            ms = [times.ended - times.started, times.planned - times.started, times.drafted - times.planned,
                  times.forwarded - times.drafted, times.finished - times.forwarded]
            self.steps.setdefault((kind, times.sequences, before["rows"], rows), []).append(
                tuple(1000.0 * s for s in ms))
            before["rows"] = times.rows

        engine.step_hook = record

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


@contextmanager
def iterations_traced() -> Iterator[None]:
    """While open, every request's stats keep its iterations in order (`iterations(stats)`): what the adaptive
    policy did step by step, where the counts in GenerationStats say only how often."""
    record = GenerationStats.record_iteration

    def recording(stats: GenerationStats, k: int, n_accepted: int, source: str | None = None) -> None:
        stats.__dict__.setdefault("steps", []).append(f"{k}:{n_accepted}" if k else ".")
        record(stats, k, n_accepted, source)

    GenerationStats.record_iteration = recording
    try:
        yield
    finally:
        GenerationStats.record_iteration = record


def iterations(stats: GenerationStats) -> str:
    """A traced request's iterations: "k:accepted" a drafting step, "." a plain one."""
    return " ".join(stats.__dict__.get("steps", []))


def loop_learned(engine: Engine, batch: int) -> dict:
    """What an engine's loop has learned beyond its calibration, at `batch` sequences, and its shared prior."""
    costs, prior = engine.costs, engine.prior
    return {"draft_step_ms": {b: round(ms, 3) for b, ms in costs.draft_step.items()},
            "overrun_ms": round(costs.drafting_overrun(batch), 3), "yield": round(costs.yield_factor(batch), 3),
            "shape_run": round(costs.shape_run, 1), "drafting_run": round(costs.drafting_run, 1),
            "switch_ms": round(costs.switch_ms, 3),
            "catch_up": (round(costs.catch_up_base_ms, 3), round(costs.catch_up_ms_per_token, 3)),
            "prior": tuple(round(x, 2) for x in prior.counts(DRAFT_MODEL)), "reply_tokens": round(prior.reply_tokens)}
