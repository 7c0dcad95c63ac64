"""What each running sequence does next: how many tokens it drafts (0 = a plain step in the same forward).

One iteration of a batch of B decoding sequences, of which the set S drafts K tokens each, costs
    K * c_d(|S|)  +  V(B, R),   R = B + K|S| (+ prompt rows prefilled in the same forward)
(c_d(n): one batched draft step over n sequences; V(B, R): the target's forward over R rows of B sequences) and
yields sum_{i in S} E(a_i, K) + (B - |S|) tokens, E(a, k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023). For
each K the best S of a given size is the sequences of highest acceptance, so the planner tries every K and every
such prefix and keeps the most tokens per ms; K = 0 (everyone plain) is always a candidate, so by the measured costs
the batch is never slower than plain decoding. As the batch grows V(B, R) turns compute-bound, extra rows stop being
free, and drafting turns itself off; it turns back on as the batch drains. Costs are measured per batch size at
start-up (`calibration.measure`); the loop refines the draft's step, prices drafting up by what its steps take
beyond their costs (BatchCosts.drafting_overrun), and counts the draft's gain as far as its drafts lately yielded
what their plans expected (BatchCosts.yield_factor).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tandem.speculative.policy import (
    EVIDENCE_ROWS,
    EWMA_WEIGHT,
    VALUE_MIN_STRENGTH,
    CostModel,
    beta_grid,
    catch_up_cost,
    expected_tokens,
    observed_median,
)

NGRAM_STEP_MS = 0.01  # prompt lookup: a dictionary lookup
ALL_ACCEPTED_MAX = 1.0 - 1e-9  # a^k capped below 1, for log(1 - a^k)
# Feeding the last drafts beside the verify replaces the catch-up forward of a sequence whose drafts all pass, about
# half the steps (acceptance 0.8, k = 3: 0.51): it pays where it adds less than half a draft step (BatchCosts.ahead_ms)
AHEAD_PAYS = 0.5
# Costs paid once for a run of iterations are spread over the iterations such runs have lasted in this engine
# (EWMAs within RUN_LIMITS), charged whole to one iteration they would keep every start and change from happening:
# - starting to draft: the draft's catch-up on what it missed (it was off, or the request just started), and the
#   change of the target's shape there and back, over BatchCosts.drafting_run (CATCH_UP_ITERATIONS before any run
#   is seen). A fixed 16 assumed every run lasts; near break-even, noise in the estimates starts runs of a step or
#   two (emulated on an H100's costs, bench/regime_emulation.py), each paying its catch-up and two changes whole.
# - another shape while drafting or plain: its change, over BatchCosts.shape_run (SWITCH_ITERATIONS at first).
#   Charged whole it held k=1 where k=2 paid 12% more (an H100's CUDA graphs: 2.9 ms a change, a 1.5B draft's
#   step 2.2); spread over a fixed 8 it let estimates that jitter change K every few steps, each paying it whole.
CATCH_UP_ITERATIONS = 16
SWITCH_ITERATIONS = 8
RUN_LIMITS = (1.0, 16.0)
# What drafting yields against what its plans expected (BatchCosts.yield_factor): the extra tokens of recent drafting
# steps, each step's weighing YIELD_DECAY times the one after, and YIELD_PRIOR expected and yielded alike at first.
YIELD_DECAY = 0.99
YIELD_PRIOR = 32.0
VALUE_GRID = 16  # acceptance points value_of_drafting integrates over (a plan each, ~0.1 ms)


@dataclass
class Candidate:
    """A decoding sequence as the planner sees it."""

    acceptance: float  # its running estimate
    k_max: int  # most it may draft now (draft_max, max_tokens and context room applied)
    lag: int = 0  # tokens its draft must take in before drafting (0 for prompt lookup)
    fixed: bool = False  # drafts k_max whatever the costs say (draft_policy "fixed")
    lookup: bool = False  # drafts by prompt lookup: no draft-model step (a dictionary lookup on the host)


@dataclass
class BatchCosts:
    """Measured costs in ms. verify[B] holds V(B, R) over total rows R for a batch of B sequences; draft_step[n]
    one draft step over n sequences; the figures between measured points are interpolated (CostModel.verify)."""

    verify: dict[int, CostModel] = field(default_factory=dict)
    draft_step: dict[int, float] = field(default_factory=dict)
    catch_up_ms_per_token: float = 0.0  # a draft's catch-up forward: base + tokens * per token (see measure)
    catch_up_base_ms: float = 0.0
    evidence_row_ms: float = 0.0  # an evidence read's logits row read back, past a catch-up's one (read_ms)
    # A target forward whose rows differ from the forward before: llama.cpp rebuilds its graph (and, on CUDA,
    # re-captures it) where it reused it for an unchanged shape; what a start or stop of drafting costs
    switch_ms: float = 0.0
    shape_run: float = SWITCH_ITERATIONS  # the iterations a target shape has lasted (EWMA), see observe_shape_run
    drafting_run: float = CATCH_UP_ITERATIONS  # the iterations a run of drafting has lasted (EWMA)
    # The draft steps one row a forward (Model.steady_shapes): a sequence whose drafts were all accepted has two
    # tokens to take in, one more forward before its next draft (the planner expects it: 1 - prod(1 - a^k))
    steady_draft: bool = False
    # Where the target's cache runs a feed of the draft's beside its forward (BatchedCache.overlaps: llama.cpp on a
    # GPU), per batch of drafting sequences: what feeding each one's last draft beside the verify adds to the step.
    # Where that is less than AHEAD_PAYS draft steps (decide_feeding_ahead), the engine feeds it, and a sequence
    # whose drafts all pass needs no catch-up forward.
    ahead_ms: dict[int, float] = field(default_factory=dict)
    ahead_pays: set[int] = field(default_factory=set)  # the batch sizes of ahead_ms that feed ahead
    # The rows a forward of R rows computes (BatchedCache.padded_rows): V is priced at those. A packed torch step
    # pads to 16, 32, 64, ... rows, so one draft beside 64 plain rows costs a 128-row forward, not a 65th row.
    padded: Callable[[int], int] | None = field(default=None, repr=False)
    _recent: dict = field(default_factory=dict, repr=False)  # observed_median's windows
    _overrun: dict = field(default_factory=dict, repr=False)  # (batch, drafting) -> an iteration's ms - predicted
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
        return self.target_ms(batch, batch) / batch

    def target_ms_array(self, batch: int, rows: np.ndarray) -> np.ndarray:
        """target_ms over an array of row counts at once (CostModel.verify's rule: linear between and beyond the
        measured points, never above a measured V(m) for m > n), for the planner's [K, n] grid."""
        ns, vs, later_min = _points(tuple(sorted(self.verify[self._bucket(self.verify, batch)].verify_ms.items())))
        if self.padded is not None:
            values, at = np.unique(rows, return_inverse=True)
            rows = np.array([self.padded(int(r)) for r in values], dtype=float)[at].reshape(rows.shape)
        if len(ns) == 1:
            return np.full(rows.shape, vs[0])
        after = np.searchsorted(ns, rows, side="right")  # points with m > n start here
        i = np.minimum(np.maximum(after, 1), len(ns) - 1)  # (np.clip: 4x the time of a small plan's arrays)
        value = np.maximum(vs[i - 1] + (vs[i] - vs[i - 1]) * (rows - ns[i - 1]) / (ns[i] - ns[i - 1]), 1e-6)
        return np.minimum(value, later_min[after])

    def catch_up_ms(self, tokens: int | np.ndarray) -> float | np.ndarray:
        """One draft forward taking in `tokens` unseen tokens (of one or several sequences; 0 costs nothing)."""
        return catch_up_cost(self.catch_up_base_ms, self.catch_up_ms_per_token, tokens)

    def read_ms(self, tokens: int) -> float:
        """A draft's evidence read of `tokens` unseen tokens (Drafter.read_evidence): its catch-up, the logits of its
        last EVIDENCE_ROWS rows read back, and past those a second forward (the head is read as a catch-up)."""
        if tokens <= 0:
            return 0.0
        second = self.catch_up_base_ms if tokens > EVIDENCE_ROWS else 0.0
        return float(self.catch_up_ms(tokens)) + self.evidence_row_ms * (min(tokens, EVIDENCE_ROWS) - 1) + second

    def draft_ms(self, sequences: int) -> float:
        if not self.draft_step or sequences == 0:
            return NGRAM_STEP_MS if sequences else 0.0
        return self.draft_step[self._bucket(self.draft_step, sequences)]

    def decide_feeding_ahead(self) -> BatchCosts:
        """Feed ahead at the batch sizes where the feed adds less than AHEAD_PAYS of the draft step timed with it:
        decided once, on the calibration's figures. The loop's draft step may read dearer (H100, Vulkan: 4.5 ms where
        2.0 timed alone); priced against that, a feed that added 1.96 ms looked cheap, and fed ahead the engine ran
        0.80x of itself without (`bench/results/h100-2026-12-06f-feed-ahead`)."""
        self.ahead_pays = {b for b, ms in self.ahead_ms.items()
                           if b in self.draft_step and ms < AHEAD_PAYS * self.draft_step[b]}
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

    def observe_iteration(self, batch: int, drafting: bool, predicted_ms: float, ms: float) -> None:
        """A whole step of `batch` decoding sequences took `ms` where its forwards' costs say `predicted_ms`."""
        key = ("iteration", batch, drafting)
        self._overrun[batch, drafting] = observed_median(self._recent, key, 0.0, ms - predicted_ms)

    def drafting_overrun(self, batch: int) -> float:
        """How many ms longer a drafting step of `batch` sequences takes than its costs say, beyond what a plain one
        does (>= 0): what the calibration's forwards, each timed alone and repeated, do not show (the step's host
        work, the draft's bookkeeping, a worker process's round trips, a forward dearer in the loop). On an H100
        (CUDA, 32B / 1.5B, 2 requests) drafting predicted at 1.23x ran at 0.90x plain, its 4- and 6-row verifies
        23.0 and 25.9 ms in the loop against 15.2 and 19.5 timed alone, plain steps as timed. Refining each row
        count's cost from the loop learned that one row count at a time, three steps each, while the counts not yet
        seen still looked cheap; this one figure, for every draft length, is learned in three steps. Added, not
        multiplied: the excess seen there was alike at 4 and 6 rows (+7.9 and +6.5 ms), a cost a step more than
        a slower kernel. Most of it was a change of shape priced too low (see calibration.SWITCH_DRAFTS)."""
        drafting = self._overrun.get((batch, True))
        return 0.0 if drafting is None else max(0.0, drafting - self._overrun.get((batch, False), 0.0))

    def observe_yield(self, batch: int, expected: float, yielded: float) -> None:
        """A drafting step of `batch` sequences: the extra tokens (accepted drafts) its plan expected of the adaptive
        draft-model drafters (sum of E(a, k) - 1 at their estimates) and what they yielded."""
        done, hoped = self._yield.get(batch, (0.0, 0.0))
        self._yield[batch] = (YIELD_DECAY * done + yielded, YIELD_DECAY * hoped + expected)

    def yield_factor(self, batch: int) -> float:
        """The share of the extra tokens its plans expect that the draft model's drafting in a batch of `batch` has
        yielded lately. A plan drafts where the estimates are high, and noise makes some of them high: in a batch the
        highest of several noisy estimates set the draft length, and the drafting steps they started yielded 3-10%
        fewer tokens than planned at 2 and 4 requests (acceptance 0.8, H100 costs, emulated; 5-7% on real text at 3,
        H200 costs), enough to turn a predicted 1.07x into a loss. One sequence's estimate showed no such bias
        (1.00-1.03). Prompt lookup's plans are not scaled: scaled, 5 requests of real text lost 1% more."""
        if batch < 2:
            return 1.0
        done, hoped = self._yield.get(batch, (0.0, 0.0))
        return (done + YIELD_PRIOR) / (hoped + YIELD_PRIOR)

    def observe_draft(self, sequences: int, forwards: int, ms: float) -> None:
        """`forwards` draft forwards of one row for each of `sequences` sequences took `ms` in all."""
        if sequences in self.draft_step and forwards > 0:
            self.draft_step[sequences] = observed_median(self._recent, ("draft", sequences),
                                                         self.draft_step[sequences], ms / forwards)


@functools.lru_cache(maxsize=64)
def _points(table: tuple[tuple[int, float], ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A verify table's (rows, ms) as arrays, and the least ms at or after each point (inf past the end): made once
    a table, not once a plan."""
    ns = np.array([n for n, _ in table], dtype=float)
    vs = np.array([ms for _, ms in table], dtype=float)
    return ns, vs, np.append(np.minimum.accumulate(vs[::-1])[::-1], np.inf)


def _run_average(average: float, run: int) -> float:
    return float(np.clip(average + EWMA_WEIGHT * (run - average), *RUN_LIMITS))


def plan(candidates: list[Candidate | None], costs: BatchCosts | None, extra_rows: int = 0,
         previous_rows: int | None = None, drafting: bool = False, rates: dict | None = None) -> list[int]:
    """Draft length per decoding sequence (None: it cannot draft). extra_rows: prompt rows in the same forward;
    previous_rows: the rows of the target's forward before (a plan of other rows pays costs.switch_ms); drafting:
    whether the step before drafted (a plan that starts to draft pays that change and the one back). `rates`, where
    given, gets the batch's tokens per ms by the costs: "plain" (the fixed drafters alone) and "planned"."""
    ks = [0] * len(candidates)
    adaptive = []
    for i, c in enumerate(candidates):
        if c is None or c.k_max <= 0:
            continue
        if c.fixed or costs is None:
            ks[i] = c.k_max
        else:
            adaptive.append(i)
    if not adaptive:
        return ks
    if len(adaptive) == 1 and not any(ks):
        return _plan_one(candidates, adaptive[0], costs, extra_rows, previous_rows, drafting, rates)
    return _plan_arrays(candidates, ks, adaptive, costs, extra_rows, previous_rows, drafting, rates)


def _plan_arrays(candidates: list[Candidate | None], ks: list[int], adaptive: list[int], costs: BatchCosts,
                 extra_rows: int, previous_rows: int | None, drafting: bool, rates: dict | None) -> list[int]:
    """plan() over every draft length K and prefix of the adaptive candidates at once, as [K, m, n] arrays: ks holds
    the fixed drafters' lengths, adaptive the indices the search decides."""
    batch = len(candidates)
    fixed_rows = sum(ks) + batch + extra_rows
    fixed_stepping = [k for i, k in enumerate(ks) if k and not candidates[i].lookup]  # fixed draft-model drafters
    fixed_tokens = sum(expected_tokens(candidates[i].acceptance, k) if k else 1.0 for i, k in enumerate(ks))
    order = sorted(adaptive, key=lambda i: -candidates[i].acceptance)
    steps_fixed = max(fixed_stepping, default=0)

    target_ms: dict[int, float] = {}  # rows -> V(batch, rows), each interpolated once a plan

    def ms(steps: int, drafters: int, lag: int, rows: int, switch: bool = True) -> float:
        if rows not in target_ms:
            target_ms[rows] = costs.target_ms(batch, rows)
        catch_up = costs.catch_up_ms(lag) / costs.drafting_run
        switched = costs.switch_share_ms() if switch and previous_rows is not None and rows != previous_rows else 0.0
        return steps * costs.draft_ms(drafters) + catch_up + target_ms[rows] + switched

    # fixed draft-model drafters: log P(none of them has all its drafts accepted), for the steady draft's extra forward
    fixed_none = sum(np.log1p(-min(candidates[i].acceptance ** k, ALL_ACCEPTED_MAX)) for i, k in enumerate(ks)
                     if k and not candidates[i].lookup) if costs.steady_draft else 0.0
    after_drafts = 0.0  # a steady draft's catch-up forward after all passed, or its feed ahead
    if fixed_stepping:
        after_drafts = costs.ahead_steps(len(fixed_stepping))
        after_drafts = 1.0 - np.exp(fixed_none) if np.isnan(after_drafts) else after_drafts
    best_rate = fixed_tokens / ms(steps_fixed + after_drafts, len(fixed_stepping), 0, fixed_rows)
    if steps_fixed == 0:
        # A quick bound first, the common case under load: drafting adds at most a/(1-a) tokens a sequence (any K)
        # and costs at least one draft step (or, by prompt lookup, one row); when even that cannot beat plain, the
        # search is skipped (a sequence's planning is then a few us, not a numpy grid, at every step of a batch
        # that does not draft).
        most = sum(k if a >= 1.0 else min(k, a / (1.0 - a))
                   for a, k in ((candidates[i].acceptance, candidates[i].k_max) for i in adaptive))
        cheapest = ms(0, 0, 0, fixed_rows + 1, switch=False) if any(candidates[i].lookup for i in adaptive) else \
            ms(0, 0, 0, fixed_rows, switch=False) + costs.draft_ms(1)
        if (fixed_tokens + most) / cheapest <= best_rate:
            if rates is not None:
                rates.update(plain=best_rate, planned=best_rate)
            return ks
    # Every K, and for each the n most accepting draft-model candidates and the m most accepting lookup ones
    # drafting min(K, their k_max), n and m on a grid (all up to 8, then about 12% apart), as [K, m, n] arrays: a
    # step of 64 sequences takes ~4 ms on an H200, and trying every (K, n) in Python cost more than half of that.
    # The two kinds are ranked apart: draft-model steps are paid once per K for all model drafters, while prompt
    # lookup's drafts cost only their rows.
    models = [i for i in order if not candidates[i].lookup]
    lookups = [i for i in order if candidates[i].lookup]
    Ks = np.arange(1, max(candidates[i].k_max for i in adaptive) + 1)[:, None]  # [K, 1]
    lookup_gain, lookup_rows, _, m = _prefixes([candidates[i] for i in lookups], Ks)  # [K, m] each, m: [m]
    model_gain, model_rows, model_none, n = _prefixes([candidates[i] for i in models], Ks)  # [K, n] each, n: [n]
    # the draft model's expected gain as far as its drafts have lately yielded it (lookup's, at its hindsight-scored
    # estimates, as planned)
    gain = lookup_gain[:, :, None] + costs.yield_factor(batch) * model_gain[:, None, :]  # [K, m, n]
    rows = fixed_rows + lookup_rows[:, :, None] + model_rows[:, None, :]
    lags = np.array([0, *itertools.accumulate(candidates[i].lag for i in models)])[n]  # [n]
    stepping = len(fixed_stepping) + n  # draft-model sequences stepping together
    draft_cost = np.array([costs.draft_ms(int(s)) if s else 0.0 for s in stepping])  # [n]
    steps = np.where(n[None, :] > 0, np.maximum(Ks, steps_fixed), steps_fixed)  # [K, n]
    if costs.steady_draft:  # the extra forward of a draft whose every draft was accepted, or the feed ahead
        all_passed = 1.0 - np.exp(model_none + fixed_none)  # [K, n]
        ahead = np.array([costs.ahead_steps(int(s)) if s else 0.0 for s in stepping])  # [n], nan: not fed
        steps = steps + np.where(stepping > 0, np.where(np.isnan(ahead), all_passed, ahead), 0.0)
    time_ms = (steps * draft_cost)[:, None, :] + costs.catch_up_ms(lags) / costs.drafting_run \
        + costs.target_ms_array(batch, rows)
    drafts = (m[:, None] > 0) | (n[None, :] > 0)  # [m, n]: every plan but all-plain drafts
    if previous_rows is not None and costs.switch_ms:
        # starting to draft pays this change and the one back once a run; any other change, once a shape
        price = np.where(drafts & (not drafting), 2 * costs.switch_ms / costs.drafting_run, costs.switch_share_ms())
        time_ms = time_ms + np.where(rows != previous_rows, price, 0.0)
    time_ms = time_ms + np.where(drafts, costs.drafting_overrun(batch), 0.0)
    rate = (fixed_tokens + gain) / time_ms
    K_best, m_best, n_best = np.unravel_index(np.argmax(rate), rate.shape)  # the first best: shortest K, fewest
    best = float(rate[K_best, m_best, n_best])
    if best > best_rate:
        K = int(Ks[K_best, 0])
        for i in lookups[: m[m_best]] + models[: n[n_best]]:
            ks[i] = min(K, candidates[i].k_max)
    if rates is not None:
        rates.update(plain=best_rate, planned=max(best, best_rate))
    return ks


def _plan_one(candidates: list[Candidate | None], i: int, costs: BatchCosts, extra_rows: int,
              previous_rows: int | None, drafting: bool, rates: dict | None) -> list[int]:
    """plan() where one sequence, candidates[i], may draft and every other steps plain (a lone request's every
    step): the same arithmetic over K = 1..k_max in Python floats. plan()'s arrays cost ~40 numpy calls a step, each
    slow in the loop, where the forwards between steps evict the host's caches: an H100's engine planned in 0.32-0.51
    ms a step with them, 0.11-0.15 so (a 32B target's step: 17-18 ms)."""
    c, batch = candidates[i], len(candidates)
    ks = [0] * batch
    plain_rows = batch + extra_rows
    switched = previous_rows is not None and bool(costs.switch_ms)
    plain_ms = costs.target_ms(batch, plain_rows) + (costs.switch_share_ms() if switched and
                                                        plain_rows != previous_rows else 0.0)
    plain_rate = batch / plain_ms
    a = c.acceptance
    most = c.k_max if a >= 1.0 else min(c.k_max, a / (1.0 - a))  # plan()'s quick bound
    cheapest = costs.target_ms(batch, plain_rows + 1) if c.lookup else \
        costs.target_ms(batch, plain_rows) + costs.draft_ms(1)
    best, best_k = plain_rate, 0
    if (batch + most) / cheapest > plain_rate:
        steady = costs.steady_draft and not c.lookup
        draft_ms = 0.0 if c.lookup else costs.draft_ms(1)
        ahead = costs.ahead_steps(1) if steady else 0.0
        gain_factor = 1.0 if c.lookup else costs.yield_factor(batch)
        fixed_ms = (0.0 if c.lookup else costs.catch_up_ms(c.lag) / costs.drafting_run) + \
            costs.drafting_overrun(batch)
        start_ms = costs.switch_share_ms() if drafting else 2 * costs.switch_ms / costs.drafting_run
        verify_ms = costs.target_ms_array(batch, np.arange(plain_rows + 1, plain_rows + c.k_max + 1)).tolist()
        for k, v_ms in enumerate(verify_ms, start=1):
            gain = k if a >= 1.0 else (a - a ** (k + 1)) / max(1.0 - a, 1e-12)  # E(a, k) - 1
            steps = k
            if steady:  # the feed ahead, or the catch-up forward after all k passed
                steps += 1.0 - math.exp(math.log1p(-min(a ** k, ALL_ACCEPTED_MAX))) if math.isnan(ahead) else ahead
            ms = steps * draft_ms + fixed_ms + v_ms + (start_ms if switched and plain_rows + k != previous_rows
                                                        else 0.0)
            rate = (batch + gain_factor * gain) / ms
            if rate > best:
                best, best_k = rate, k
    ks[i] = best_k
    if rates is not None:
        rates.update(plain=plain_rate, planned=best)
    return ks


def value_of_drafting(accepted: float, drafted: float, k_max: int, batch: int, costs: BatchCosts,
                      least_strength: float = VALUE_MIN_STRENGTH) -> tuple[float, float]:
    """(expected ms a token of one sequence that drafting saves, the probability it saves nothing) in a batch of
    `batch` such sequences, none with anything to catch up, over the uncertainty in their acceptance: a Beta of the
    pseudo-counts, held as at least `least_strength` positions (AcceptancePrior.spread_strength). Where acceptance
    turns out too low to pay, the plan stays plain and saves 0. A sequence's share of its batch's time is a token's
    worth of the batch's ms a token, so the figure falls as the batch grows and extra rows stop being free (valued as
    one sequence's alone, at 4 requests on an H100's costs, it valued reads that never paid)."""
    strength = max(drafted, least_strength)
    value = p_no_gain = 0.0
    for a, weight in beta_grid(accepted / drafted * strength, strength, VALUE_GRID):
        rates: dict[str, float] = {}
        plan([Candidate(a, k_max)] * batch, costs, rates=rates)
        saved = 1.0 / rates["plain"] - 1.0 / rates["planned"]
        value += weight * saved
        p_no_gain += weight if saved <= 0 else 0.0
    return float(value), float(p_no_gain)


def _prefixes(ranked: list[Candidate], Ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each K and each prefix size on the grid (0 included) of candidates ranked by acceptance: the tokens the
    prefix adds over plain steps (sum of E(a, k) - 1), its draft rows, and log P(no one in it has all its drafts
    accepted), each drafting k = min(K, its k_max)."""
    sizes = np.concatenate([[0], _grid(len(ranked))]) if ranked else np.zeros(1, dtype=int)
    if not ranked:
        zeros = np.zeros((Ks.shape[0], 1))
        return zeros, zeros, zeros, sizes
    acceptance = np.array([c.acceptance for c in ranked])
    k = np.minimum(Ks, np.array([c.k_max for c in ranked])[None, :])  # [K, len]
    tail = (acceptance - acceptance ** (k + 1)) / np.maximum(1.0 - acceptance, 1e-12)  # E(a, k) - 1

    none_all = np.log1p(-np.minimum(acceptance ** k, ALL_ACCEPTED_MAX))
    per_candidate = np.stack([np.where(acceptance >= 1.0, k, tail), k, none_all])  # [3, K, len]: summed at once
    sums = np.zeros((3, Ks.shape[0], len(ranked) + 1))
    np.cumsum(per_candidate, axis=2, out=sums[:, :, 1:])
    gain, rows, none = sums[:, :, sizes]
    return gain, rows, none, sizes


@functools.cache
def _grid(n: int) -> np.ndarray:
    """The prefix sizes plan() tries out of n candidates: all up to 8, then about 12% apart, and n."""
    sizes = {m for m in range(1, min(8, n) + 1)} | {n}
    sizes |= {int(round(n * f)) for f in np.geomspace(min(1.0, 8 / n), 1.0, 12)}
    return np.array(sorted(m for m in sizes if 1 <= m <= n))
