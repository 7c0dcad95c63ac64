"""What each running sequence does next: how many tokens it drafts (0 = a plain step in the same forward).

One iteration of a batch of B decoding sequences, of which the set S drafts K tokens each, costs
    K * c_d(|S|)  +  V(B, R),   R = B + K|S| (+ prompt rows prefilled in the same forward)
(c_d(n): one batched draft step over n sequences; V(B, R): the target's forward over R rows of B sequences) and
yields sum_{i in S} E(a_i, K) + (B - |S|) tokens, E(a, k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023). For
each K the best S of a given size is the sequences of highest acceptance, so the planner tries every K and every
such prefix and keeps the most tokens per ms; K = 0 (everyone plain) is always a candidate, so by the measured costs
the batch is never slower than plain decoding. As the batch grows V(B, R) turns compute-bound, extra rows stop being
free, and drafting turns itself off; it turns back on as the batch drains. Costs are measured per batch size at
start-up (`calibration.measure`, into `costs.BatchCosts`); the loop refines the draft's step, adds to every plan
what each step takes beyond its forwards (BatchCosts.step_overhead_ms), prices drafting up by what its steps take
beyond that (BatchCosts.drafting_overrun), and counts the draft's gain as far as its
drafts lately yielded what their plans expected (BatchCosts.yield_factor).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from tandem.config import POLICY
from tandem.engine.costs import BatchCosts
from tandem.speculative.policy import beta_grid, expected_tokens

ALL_ACCEPTED_MAX = 1.0 - 1e-9  # a^k capped below 1, for log(1 - a^k)


@dataclass
class Candidate:
    """A decoding sequence as the planner sees it."""

    acceptance: float  # its running estimate
    k_max: int  # most it may draft now (draft_max, max_tokens and context room applied)
    lag: int = 0  # tokens its draft must take in before drafting (0 for prompt lookup)
    fixed: bool = False  # drafts k_max whatever the costs say (draft_policy "fixed")
    lookup: bool = False  # drafts by prompt lookup: no draft-model step (a dictionary lookup on the host)


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
    overhead = costs.step_overhead_ms(batch)  # every plan's, plain too

    def ms(steps: int, drafters: int, lag: int, rows: int, switch: bool = True) -> float:
        if rows not in target_ms:
            target_ms[rows] = costs.target_ms(batch, rows)
        catch_up = costs.catch_up_ms(lag) / costs.drafting_run
        switched = costs.switch_share_ms() if switch and previous_rows is not None and rows != previous_rows else 0.0
        return steps * costs.draft_ms(drafters) + catch_up + target_ms[rows] + switched + overhead

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
    # drafting min(K, their k_max), n and m on a grid (all up to 8, then about 12% apart), as [K, m, n] arrays:
    # trying every (K, n) in Python would cost a large batch's step more than half its time.
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
        + costs.target_ms_array(batch, rows) + overhead
    drafts = (m[:, None] > 0) | (n[None, :] > 0)  # [m, n]: every plan but all-plain drafts
    if previous_rows is not None and costs.switch_ms:
        # starting to draft pays this change and the one back once a run; any other change, once a shape
        price = np.where(drafts & (not drafting), 2 * costs.switch_ms / costs.drafting_run, costs.switch_share_ms())
        time_ms = time_ms + np.where(rows != previous_rows, price, 0.0)
    # each source's own overrun; a step where the model drafts at all is the model's (it observes as one)
    overrun = np.where(n[None, :] > 0, costs.drafting_overrun(batch), costs.drafting_overrun(batch, lookup=True))
    time_ms = time_ms + np.where(drafts, overrun, 0.0)
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
    slow in the loop, where the forwards between steps evict the host's caches (docs/decisions/0006)."""
    c, batch = candidates[i], len(candidates)
    ks = [0] * batch
    plain_rows = batch + extra_rows
    switched = previous_rows is not None and bool(costs.switch_ms)
    overhead = costs.step_overhead_ms(batch)
    plain_ms = costs.target_ms(batch, plain_rows) + overhead + (costs.switch_share_ms() if switched and
                                                                 plain_rows != previous_rows else 0.0)
    plain_rate = batch / plain_ms
    a = c.acceptance
    most = c.k_max if a >= 1.0 else min(c.k_max, a / (1.0 - a))  # plan()'s quick bound
    cheapest = overhead + (costs.target_ms(batch, plain_rows + 1) if c.lookup else
                           costs.target_ms(batch, plain_rows) + costs.draft_ms(1))
    best, best_k = plain_rate, 0
    if (batch + most) / cheapest > plain_rate:
        steady = costs.steady_draft and not c.lookup
        draft_ms = 0.0 if c.lookup else costs.draft_ms(1)
        ahead = costs.ahead_steps(1) if steady else 0.0
        gain_factor = 1.0 if c.lookup else costs.yield_factor(batch)
        fixed_ms = (0.0 if c.lookup else costs.catch_up_ms(c.lag) / costs.drafting_run) + \
            costs.drafting_overrun(batch, c.lookup) + overhead
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


def paying_bracket(costs: BatchCosts, k_max: int, batch: int = 1, lookup: bool = False, precision: float = 1 / 32,
                   top: float = 0.99) -> tuple[float, float]:
    """(low, high) around the least acceptance at which some of `batch` sequences drafting alike (nothing to catch
    up, up to k_max tokens, by prompt lookup or by the draft model) beat plain steps by the costs, bisected to
    `precision`; (1.0, 1.0) where none up to `top` does."""
    def pays(acceptance: float) -> bool:
        return plan([Candidate(acceptance, k_max, lookup=lookup)] * batch, costs)[0] > 0

    low, high = 0.0, top
    if not pays(high):
        return 1.0, 1.0
    while high - low > precision:
        middle = (low + high) / 2
        low, high = (low, middle) if pays(middle) else (middle, high)
    return low, high


def savings(costs: BatchCosts, k_max: int, batch: int) -> list[float]:
    """Per point of value_of_drafting's acceptance grid: the ms a token of one sequence saves where `batch` such
    sequences at that acceptance draft as planned (0 or less: they step plain). The grid is fixed, so these are
    kept per batch size and only a Beta's weights change from one estimate to the next."""
    saved = []
    for a, _ in beta_grid(1.0, 2.0, POLICY.value_grid):
        rates: dict[str, float] = {}
        plan([Candidate(a, k_max)] * batch, costs, rates=rates)
        saved.append(1.0 / rates["plain"] - 1.0 / rates["planned"])
    return saved


def value_of_drafting(accepted: float, drafted: float, k_max: int, batch: int, costs: BatchCosts,
                      least_strength: float = POLICY.value_min_strength, saved: list[float] | None = None
                      ) -> tuple[float, float]:
    """(expected ms a token of one sequence that drafting saves, the probability it saves nothing) in a batch of
    `batch` such sequences, none with anything to catch up, over the uncertainty in their acceptance: a Beta of the
    pseudo-counts, held as at least `least_strength` positions (AcceptancePrior.spread_strength). Where acceptance
    turns out too low to pay, the plan stays plain and saves 0. A sequence's share of its batch's time is a token's
    worth of the batch's ms a token, so the figure falls as the batch grows and extra rows stop being free.
    saved: `savings(costs, k_max, batch)`, where kept."""
    strength = max(drafted, least_strength)
    saved = savings(costs, k_max, batch) if saved is None else saved
    value = p_no_gain = 0.0
    for (_, weight), gain in zip(beta_grid(accepted / drafted * strength, strength, POLICY.value_grid), saved,
                                 strict=True):
        value += weight * gain
        p_no_gain += weight if gain <= 0 else 0.0
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
