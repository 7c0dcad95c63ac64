"""Measured costs in ms, one model of them for a lone sequence and a batch, and what the loop learns of them.

`CostModel`: one sequence's costs, the draft's step c_d and the target's forward over n tokens V(n) (the doctor, the
bench's predictions). `BatchCosts`: a batch's, V(B, R) over R rows per batch size B, the draft's step per batch, its
catch-up, a change of the target's shape, the draft fed beside a verify; the engine's planner decides from them.
Both read V between measured points by one rule (`interpolate`). `calibration` measures them, `cost_store` keeps
them on disk; the batched loop refines some as it runs (`BatchCosts.observe_*`).
"""

from __future__ import annotations

import bisect
import functools
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tandem.config import POLICY
from tandem.speculative.policy import DRAFT_MODEL_SOURCE, expected_tokens

NGRAM_STEP_MS = 0.01  # prompt lookup: a dictionary lookup
LOOKUP = "lookup"  # a drafting step's source where prompt lookup alone drafted (observe_iteration)


def catch_up_cost(base_ms: float, per_token_ms: float, tokens):
    """One draft forward taking in `tokens` unseen tokens (an int, or an array of counts): a base plus a price a
    token; nothing to take in costs nothing."""
    if isinstance(tokens, np.ndarray):
        return np.where(tokens > 0, base_ms + tokens * per_token_ms, 0.0)
    return base_ms + tokens * per_token_ms if tokens > 0 else 0.0


def observed_median(recent: dict, key: object, before: float, ms: float) -> float:
    """A cost's new estimate after a timing of `ms`: the median of its latest timings (`recent` keeps them per key),
    seeded with its estimate `before` (see POLICY.observed_window)."""
    window = recent.setdefault(key, deque([before] * (POLICY.observed_window // 2 + 1), maxlen=POLICY.observed_window))
    window.append(ms)
    return statistics.median(window)




def interpolate(table: dict[int, float], rows):
    """V at `rows` (an int, or an array of row counts) from the measured {rows: ms} points: linear between and beyond
    them, since a forward's cost is affine in its rows, and never above a measured V(m) for m > rows, since a forward
    over more rows costs no less (a V(1) overstated at calibration, a cold pipeline, would otherwise keep a losing
    draft length on for good, the plain steps that would correct it never taken)."""
    ns, vs, later, arrays = _points(tuple(sorted(table.items())))
    if isinstance(rows, np.ndarray):
        ns_a, vs_a, later_a = arrays
        if len(ns) == 1:
            return np.full(rows.shape, vs[0])
        after = np.searchsorted(ns_a, rows, side="right")  # points with m > rows start here
        i = np.minimum(np.maximum(after, 1), len(ns) - 1)  # (np.clip: 4x the time of a small plan's arrays)
        value = np.maximum(vs_a[i - 1] + (vs_a[i] - vs_a[i - 1]) * (rows - ns_a[i - 1]) / (ns_a[i] - ns_a[i - 1]), 1e-6)
        at = np.maximum(after - 1, 0)
        value = np.where(ns_a[at] == rows, vs_a[at], value)  # a measured point is its measurement
        return np.minimum(value, later_a[after])
    if len(ns) == 1:
        return vs[0]
    after = bisect.bisect(ns, rows)
    if after and ns[after - 1] == rows:
        value = vs[after - 1]
    else:
        i = min(max(after, 1), len(ns) - 1)
        value = max(vs[i - 1] + (vs[i] - vs[i - 1]) * (rows - ns[i - 1]) / (ns[i] - ns[i - 1]), 1e-6)
    return min(value, later[after])


@functools.lru_cache(maxsize=64)
def _points(table: tuple[tuple[int, float], ...]) -> tuple[list, list, list, tuple[np.ndarray, ...]]:
    """A table's rows and ms, and the least ms at or after each point (inf past the end), as lists and as arrays:
    made once a table, not once a plan."""
    ns = [n for n, _ in table]
    vs = [ms for _, ms in table]
    later = list(np.append(np.minimum.accumulate(np.array(vs)[::-1])[::-1], np.inf)) if vs else [np.inf]
    return ns, vs, [float(v) for v in later], (np.array(ns, dtype=float), np.array(vs, dtype=float), np.array(later))


@dataclass
class CostModel:
    """Measured costs in ms: one draft step, and the target's forward over n tokens (n = 1 is a plain step)."""

    draft_step_ms: float
    verify_ms: dict[int, float] = field(default_factory=dict)
    catch_up_ms_per_token: float | None = None  # the draft's forward over many unseen tokens, per token (batched)
    catch_up_base_ms: float = 0.0  # and what such a forward costs whatever its tokens (GPUs: most of it)
    # The draft steps one row a forward (Model.steady_shapes): after an iteration whose k drafts were all accepted
    # (probability a^k) it takes in two tokens in two forwards, one more than its k; draft_step_ms is then a forward's
    steady_draft: bool = False
    _recent: dict = field(default_factory=dict, repr=False, compare=False)  # observed_median's windows

    def verify(self, n: int) -> float:
        """V(n) (see interpolate)."""
        return interpolate(self.verify_ms, n)

    def tokens_per_ms(self, acceptance: float, k: int, extra_ms: float = 0.0) -> float:
        forwards = k + (min(acceptance, 1.0) ** k if self.steady_draft and k else 0.0)
        return expected_tokens(acceptance, k) / (forwards * self.draft_step_ms + self.verify(k + 1) + extra_ms)

    def best_draft_len(self, acceptance: float, k_max: int) -> int:
        return max(range(k_max + 1), key=lambda k: (self.tokens_per_ms(acceptance, k), -k))

    def predicted_speedup(self, acceptance: float, k_max: int) -> float:
        k = self.best_draft_len(acceptance, k_max)
        return self.tokens_per_ms(acceptance, k) / self.tokens_per_ms(acceptance, 0)

    def catch_up_ms(self, tokens: int) -> float:
        per_token = self.catch_up_ms_per_token if self.catch_up_ms_per_token is not None else self.draft_step_ms
        return catch_up_cost(self.catch_up_base_ms, per_token, tokens)


@dataclass
class BatchCosts:
    """Measured costs in ms. verify[B] holds V(B, R) over total rows R for a batch of B sequences; draft_step[n]
    one draft step over n sequences; the figures between measured points are interpolated (interpolate)."""

    verify: dict[int, CostModel] = field(default_factory=dict)
    draft_step: dict[int, float] = field(default_factory=dict)
    catch_up_ms_per_token: float = 0.0  # a draft's catch-up forward: base + tokens * per token (see measure)
    catch_up_base_ms: float = 0.0
    evidence_row_ms: float = 0.0  # an evidence read's logits row read back, past a catch-up's one (read_ms)
    # A target forward whose rows differ from the forward before: llama.cpp rebuilds its graph (and, on CUDA,
    # re-captures it) where it reused it for an unchanged shape; what a start or stop of drafting costs
    switch_ms: float = 0.0
    shape_run: float = POLICY.switch_iterations  # the iterations a target shape has lasted (EWMA, observe_shape_run)
    drafting_run: float = POLICY.catch_up_iterations  # the iterations a run of drafting has lasted (EWMA)
    # The draft steps one row a forward (Model.steady_shapes): a sequence whose drafts were all accepted has two
    # tokens to take in, one more forward before its next draft (the planner expects it: 1 - prod(1 - a^k))
    steady_draft: bool = False
    # Where the target's cache runs a feed of the draft's beside its forward (BatchedCache.overlaps: llama.cpp on a
    # GPU), per batch of drafting sequences: what feeding each one's last draft beside the verify adds to the step.
    # Where that is less than POLICY.ahead_pays draft steps (decide_feeding_ahead), the engine feeds it, and a sequence
    # whose drafts all pass needs no catch-up forward.
    ahead_ms: dict[int, float] = field(default_factory=dict)
    ahead_pays: set[int] = field(default_factory=set)  # the batch sizes of ahead_ms that feed ahead
    # The rows a forward of R rows computes (BatchedCache.padded_rows): V is priced at those. A packed torch step
    # pads to 16, 32, 64, ... rows, so one draft beside 64 plain rows costs a 128-row forward, not a 65th row.
    padded: Callable[[int], int] | None = field(default=None, repr=False)
    _recent: dict = field(default_factory=dict, repr=False)  # observed_median's windows
    _overrun: dict = field(default_factory=dict, repr=False)  # (batch, source) -> an iteration's ms - predicted
    _observed: dict = field(default_factory=dict, repr=False)  # batch -> steps observed; (batch, source) -> the last
    _yield: dict = field(default_factory=dict, repr=False)  # batch -> (extra tokens yielded, expected), decayed

    def measured(self) -> dict:
        """The figures `measure` took, as JSON (what is kept on disk; not what the loop has learned since)."""
        return {"verify": {str(b): {str(n): ms for n, ms in c.verify_ms.items()} for b, c in self.verify.items()},
                "draft_step": {str(b): ms for b, ms in self.draft_step.items()},
                "catch_up_ms_per_token": self.catch_up_ms_per_token, "catch_up_base_ms": self.catch_up_base_ms,
                "evidence_row_ms": self.evidence_row_ms, "switch_ms": self.switch_ms,
                "ahead_ms": {str(b): ms for b, ms in self.ahead_ms.items()}}

    @classmethod
    def from_measured(cls, doc: dict) -> BatchCosts:
        verify = {int(b): CostModel(draft_step_ms=0.0, verify_ms={int(n): float(ms) for n, ms in rows.items()})
                  for b, rows in doc["verify"].items()}
        if not verify or any(not c.verify_ms for c in verify.values()):
            raise ValueError("no verify costs")
        return cls(verify=verify, draft_step={int(b): float(ms) for b, ms in doc["draft_step"].items()},
                   catch_up_ms_per_token=float(doc["catch_up_ms_per_token"]),
                   catch_up_base_ms=float(doc["catch_up_base_ms"]),
                   evidence_row_ms=float(doc.get("evidence_row_ms", 0.0)), switch_ms=float(doc["switch_ms"]),
                   ahead_ms={int(b): float(ms) for b, ms in doc.get("ahead_ms", {}).items()}).decide_feeding_ahead()

    @staticmethod
    def _bucket(table: dict, n: int) -> int:
        above = [b for b in table if b >= n]
        return min(above) if above else max(table)

    def pad_rows(self, padded: Callable[[int], int]) -> BatchCosts:
        """Price forwards by the rows the backend computes (`padded`): the measured tables keyed by those too."""
        self.padded = functools.lru_cache(maxsize=4096)(padded)  # asked for every plan's every row count
        for model in self.verify.values():
            table: dict[int, list[float]] = {}
            for rows, ms in model.verify_ms.items():
                table.setdefault(padded(rows), []).append(ms)
            model.verify_ms = {rows: sum(v) / len(v) for rows, v in table.items()}
        return self

    def target_ms(self, batch: int, rows: int) -> float:
        if self.padded is not None:
            rows = self.padded(rows)
        return self.verify[self._bucket(self.verify, batch)].verify(rows)

    def plain_share_ms(self, batch: int) -> float:
        """One sequence's share of a plain step of `batch` sequences: what the probe and exploration budgets count."""
        return (self.target_ms(batch, batch) + self.step_overhead_ms(batch)) / batch

    def step_overhead_ms(self, batch: int) -> float:
        """What every step of `batch` sequences costs beyond its forwards, drafting or not (>= 0): the loop's own
        work, a server's between its steps (the streams, the GIL). Tokens per step amortise it, so the planner adds
        it to every plan: a served step's host time can make drafting pay where the forwards alone say it does not."""
        return max(0.0, self._overrun.get((batch, None), 0.0))

    def target_ms_array(self, batch: int, rows: np.ndarray) -> np.ndarray:
        """target_ms over an array of row counts at once, for the planner's [K, n] grid."""
        if self.padded is not None:
            values, at = np.unique(rows, return_inverse=True)
            rows = np.array([self.padded(int(r)) for r in values], dtype=float)[at].reshape(rows.shape)
        return interpolate(self.verify[self._bucket(self.verify, batch)].verify_ms, rows)

    def catch_up_ms(self, tokens: int | np.ndarray) -> float | np.ndarray:
        """One draft forward taking in `tokens` unseen tokens (of one or several sequences; 0 costs nothing)."""
        return catch_up_cost(self.catch_up_base_ms, self.catch_up_ms_per_token, tokens)

    def read_ms(self, tokens: int) -> float:
        """A draft's evidence read of `tokens` unseen tokens (Drafter.read_evidence): its catch-up, the logits of its
        last POLICY.evidence_rows rows read back, and past those a second forward (the head is read as a catch-up)."""
        if tokens <= 0:
            return 0.0
        second = self.catch_up_base_ms if tokens > POLICY.evidence_rows else 0.0
        return float(self.catch_up_ms(tokens)) + self.evidence_row_ms * (min(tokens, POLICY.evidence_rows) - 1) + second

    def draft_ms(self, sequences: int) -> float:
        if not self.draft_step or sequences == 0:
            return NGRAM_STEP_MS if sequences else 0.0
        return self.draft_step[self._bucket(self.draft_step, sequences)]

    def decide_feeding_ahead(self) -> BatchCosts:
        """Feed ahead at the batch sizes where the feed adds less than POLICY.ahead_pays of the draft step timed with
        it: decided once, on the calibration's figures (the loop's draft step may read dearer, making a feed look cheap
        that is not)."""
        self.ahead_pays = {b for b, ms in self.ahead_ms.items()
                           if b in self.draft_step and ms < POLICY.ahead_pays * self.draft_step[b]}
        return self

    def feeds_ahead(self, sequences: int) -> bool:
        """Whether a step of `sequences` drafting sequences feeds their last drafts beside the verify (ahead_ms)."""
        if not self.ahead_ms or sequences == 0:
            return False
        return self._bucket(self.ahead_ms, sequences) in self.ahead_pays

    def feed_ahead_ms(self, sequences: int) -> float:
        """What feeding ahead adds to a step of `sequences` drafting sequences (0 where it does not feed ahead)."""
        return self.ahead_ms[self._bucket(self.ahead_ms, sequences)] if self.feeds_ahead(sequences) else 0.0

    def ahead_steps(self, sequences: int) -> float:
        """Where a steady draft's step of `sequences` sequences feeds ahead (feeds_ahead), what the feed adds, in
        draft steps; else nan: the step pays the catch-up forward of a sequence whose drafts all passed instead."""
        return self.feed_ahead_ms(sequences) / self.draft_ms(sequences) if self.feeds_ahead(sequences) else np.nan

    def observe_shape_run(self, iterations: int) -> None:
        """A target shape lasted this many forwards before the shape changed."""
        self.shape_run = _run_average(self.shape_run, iterations)

    def observe_drafting_run(self, iterations: int) -> None:
        """The batch drafted this many steps in a row."""
        self.drafting_run = _run_average(self.drafting_run, iterations)

    def switch_share_ms(self) -> float:
        """What a change of shape costs each iteration of the new shape."""
        return self.switch_ms / self.shape_run

    def observe_iteration(self, batch: int, source: str | None, predicted_ms: float, ms: float) -> None:
        """A whole step of `batch` decoding sequences took `ms` where its forwards' costs say `predicted_ms`; source:
        what it drafted by (LOOKUP; DRAFT_MODEL_SOURCE where the draft model drafted at all; None: a plain step)."""
        key = ("iteration", batch, source)
        self._overrun[batch, source] = observed_median(self._recent, key, 0.0, ms - predicted_ms)
        seen = self._observed[batch] = self._observed.get(batch, 0) + 1
        if source is not None:
            self._observed[batch, source] = seen
            return
        for kind in (LOOKUP, DRAFT_MODEL_SOURCE):
            # An overrun that keeps drafting off is never observed again: forgotten after POLICY.overrun_memory
            # steps without it (a few drafting steps then test it), as an idle estimate fades to its prior.
            if (batch, kind) in self._overrun and seen - self._observed[batch, kind] > POLICY.overrun_memory:
                del self._overrun[batch, kind], self._recent["iteration", batch, kind]

    def drafting_overrun(self, batch: int, lookup: bool = False) -> float:
        """How many ms longer a drafting step of `batch` sequences takes than its costs say, beyond what a plain one
        does (step_overhead_ms; >= 0): what the calibration's forwards, each timed alone, do not show (the draft's
        bookkeeping, a worker's round trips, a forward dearer in the loop). One figure for every draft length, added
        to every drafting plan. Prompt lookup's steps and the draft model's each have their own: their host work
        differs (docs/decisions/0001)."""
        drafting = self._overrun.get((batch, LOOKUP if lookup else DRAFT_MODEL_SOURCE))
        return 0.0 if drafting is None else max(0.0, drafting - self._overrun.get((batch, None), 0.0))

    def observe_yield(self, batch: int, expected: float, yielded: float) -> None:
        """A drafting step of `batch` sequences: the extra tokens (accepted drafts) its plan expected of the adaptive
        draft-model drafters (sum of E(a, k) - 1 at their estimates) and what they yielded."""
        done, hoped = self._yield.get(batch, (0.0, 0.0))
        self._yield[batch] = (POLICY.yield_decay * done + yielded, POLICY.yield_decay * hoped + expected)

    def yield_factor(self, batch: int) -> float:
        """The share of the extra tokens its plans expect that the draft model's drafting in a batch of `batch` has
        yielded lately. A plan drafts where the estimates are high, and noise makes some of them high: in a batch
        the highest of several noisy estimates sets the draft length (one sequence's shows no such bias). Prompt
        lookup's plans are not scaled (its estimates are scored in hindsight)."""
        if batch < 2:
            return 1.0
        done, hoped = self._yield.get(batch, (0.0, 0.0))
        return (done + POLICY.yield_prior) / (hoped + POLICY.yield_prior)

    def observe_draft(self, sequences: int, forwards: int, ms: float) -> None:
        """`forwards` draft forwards of one row for each of `sequences` sequences took `ms` in all."""
        if sequences in self.draft_step and forwards > 0:
            self.draft_step[sequences] = observed_median(self._recent, ("draft", sequences),
                                                         self.draft_step[sequences], ms / forwards)


def _run_average(average: float, run: int) -> float:
    return float(np.clip(average + POLICY.ewma_weight * (run - average), *POLICY.run_limits))
