"""Draft-length policies: which proposer drafts, and how many tokens, before each verify (0 = plain decoding).

The arithmetic (Leviathan et al. 2023, sec. 3.4): with per-token acceptance a, drafting k tokens yields
E(k) = (1 - a^(k+1)) / (1 - a) tokens per iteration, at a cost of k * c_d (draft steps) + V(k+1) (one target
forward over k+1 tokens). Plain decoding is k = 0: one token per V(1). The adaptive policy measures c_d and V(n)
on the device it runs on, tracks a per request and per proposer *source* (the draft model, prompt lookup), and each
iteration takes the source and k with the most tokens per ms among the sources that can propose now.

A policy is one request's state: its inputs are the measured costs and the iterations it observes. What completed
requests accepted lives apart, in an `AcceptancePrior` that every request of a process (or every sequence of a
batch) shares: it is where a new request's estimate starts.
"""

from __future__ import annotations

import bisect
import math
import statistics
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

EWMA_WEIGHT = 0.2  # weight of a new figure in the running estimates of runs and catch-ups
# A cost the loop observes is the median of its latest OBSERVED_WINDOW timings, the figure before them counted
# thrice at first: a one-off (a shape's first use: graph capture, a Vulkan pipeline, an allocation; 10x a step) moves
# no estimate. An average moved by it kept drafting off for good on an H100 (CUDA, Vulkan: a plan of plain steps
# never times a verify again to correct it).
OBSERVED_WINDOW = 5
ACCEPTANCE_DECAY = 0.9  # per drafting iteration: evidence halves in ~7 iterations, so the policy follows a prompt
IDLE_DECAY = 0.97  # per plain iteration: evidence fades to the prior, halfway in ~23 tokens
# Pseudo-counts (accepted, drafted) a fresh process starts from and every estimate drifts back to while drafting is
# off: a = 0.7, what same-family pairs reach on code and JSON (CONTEXT.md: 0.63-0.82), held weakly (2 positions),
# so that a request's own evidence soon outweighs it.
ACCEPTANCE_PRIOR = (1.4, 2.0)
# What acceptance a request may turn out to have is a Beta of the estimate's pseudo-counts, held as at least this
# many positions: a Beta(2.8, 1.2) spreads about as much (sd 0.2) as one pair's acceptance does across prompts
# (0.29-0.92); a weaker one puts much weight near 1, where drafting would win big, and bets on it too often.
VALUE_MIN_STRENGTH = 4.0
# ... until completed requests show how much they differ (AcceptancePrior.spread_strength): the Beta whose spread is
# their acceptances' spread, at most VALUE_MAX_STRENGTH positions, once PRIOR_SPREAD_REQUESTS requests are recorded.
# Where requests all accept alike (one workload, or a benchmark's synthetic acceptance) a request's evidence cannot
# show much the prior did not, and a Beta of 4 positions valued reads and prompts the draft took in for drafting
# that never came: at 2 and 4 requests on an H100's costs (emulated) those cost 2-3% of plain decoding.
VALUE_MAX_STRENGTH = 64.0
PRIOR_SPREAD_REQUESTS = 3
# Turning drafting back on may cost at most this fraction of the plain time since it went off (a re-probe after a
# plain stretch first catches the draft up on every token it missed). At 0.1, failed probes cost 4-5% (H200).
PROBE_BUDGET = 0.03
# A draft that has not run yet in a request first takes in the prompt. It does so only when the drafting that this
# buys is worth PROBE_VALUE_MARGIN times that catch-up: the expected time saved over the rest of the reply, with the
# expectation over what the acceptance may be (a Beta of the prior's pseudo-counts), since the catch-up itself shows
# the acceptance (see EVIDENCE_TOKENS) and drafting stays off where it turns out not to pay.
PROBE_VALUE_MARGIN = 2.0
# Generated tokens to wait for before that first catch-up: the draft then reads them, teacher-forced, and how many
# it would have predicted is this request's acceptance, measured before a single draft is verified.
EVIDENCE_TOKENS = 6
LEARNING_ITERATIONS = 4  # drafting iterations a policy without that evidence spends learning that a draft is poor
# A draft that must catch up on more than STEADY_CATCH_UP tokens after another source drafted charges the catch-up
# to the tokens it expects to yield before another source takes over again: this many at first, then the mean of
# its runs so far in the request (short where prompt lookup keeps taking over, as on a summary).
PAYBACK_TOKENS = 32
STEADY_CATCH_UP = 2  # a draft that catches up on at most this many tokens is drafting steadily (see observe)
DEFAULT_REPLY_TOKENS = 128  # the reply length a fresh process expects (the value of drafting is per token left)
PRIOR_REQUEST_WEIGHT = 0.3  # weight of a completed request in the shared prior's acceptance
PRIOR_MIN_POSITIONS = 6  # a request that tried fewer draft positions says too little to move the prior
PRIOR_MAX_STRENGTH = 6.0  # pseudo-positions the learned prior is held with: requests differ (0.44-0.92 on one pair)
# A reply's share made by prompt lookup is counted over this many more tokens than it has (none of them copied), so
# that a lookup hit among a reply's first few tokens does not switch a good draft off.
LOOKUP_SHARE_PRIOR_TOKENS = 16
# What share of a reply a fresh process expects prompt lookup to make: replies that copy their prompt (summaries,
# edits of given code) are common in assistants' traffic; learnt from completed replies (AcceptancePrior).
DEFAULT_COPIED_SHARE = 0.2
DRAFT_MODEL_SOURCE = "draft-model"  # the source name of a draft model (the others are prompt lookup's)
BETA_GRID = 32  # points of the acceptance grid the expected value of drafting is integrated over


def lookup_share(copied: int, generated: int) -> float:
    """The share of a reply prompt lookup's accepted drafts made: `copied` of `generated` tokens, counted over
    LOOKUP_SHARE_PRIOR_TOKENS more (none copied)."""
    return copied / (generated + LOOKUP_SHARE_PRIOR_TOKENS)


def copied_risk(p_no_gain: float, shared: AcceptancePrior | None) -> float:
    """The chance a draft's first catch-up buys nothing beside prompt lookup: its acceptance turns out too low, or
    the reply copies its prompt (as much as completed replies did), leaving the draft little to propose."""
    copied = shared.copied_share if shared is not None else DEFAULT_COPIED_SHARE
    return 1.0 - (1.0 - p_no_gain) * (1.0 - copied)


def catch_up_cost(base_ms: float, per_token_ms: float, tokens):
    """One draft forward taking in `tokens` unseen tokens (an int, or an array of counts): a base plus a price a
    token; nothing to take in costs nothing."""
    if isinstance(tokens, np.ndarray):
        return np.where(tokens > 0, base_ms + tokens * per_token_ms, 0.0)
    return base_ms + tokens * per_token_ms if tokens > 0 else 0.0


def observed_median(recent: dict, key: object, before: float, ms: float) -> float:
    """A cost's new estimate after a timing of `ms`: the median of its latest timings (`recent` keeps them per key),
    seeded with its estimate `before` (see OBSERVED_WINDOW)."""
    window = recent.setdefault(key, deque([before] * (OBSERVED_WINDOW // 2 + 1), maxlen=OBSERVED_WINDOW))
    window.append(ms)
    return statistics.median(window)


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): tokens an iteration yields, accepted drafts plus the target's own token."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


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
        """V(n), linear between (and beyond) the measured points: a forward's cost is affine in its tokens. Never
        above a measured V(m) for m > n, since a forward over more tokens costs no less: V(1) is measured only by
        plain steps, so a V(1) that calibration overstated (a cold Vulkan pipeline) would otherwise keep a losing
        draft length on for good, the steps that would correct it never taken."""
        if n in self.verify_ms:
            value = self.verify_ms[n]
        else:
            ns = sorted(self.verify_ms)
            if len(ns) == 1:
                return self.verify_ms[ns[0]]
            i = min(max(bisect.bisect(ns, n), 1), len(ns) - 1)
            (n0, v0), (n1, v1) = (ns[i - 1], self.verify_ms[ns[i - 1]]), (ns[i], self.verify_ms[ns[i]])
            value = max(v0 + (v1 - v0) * (n - n0) / (n1 - n0), 1e-6)
        return min([value] + [v for m, v in self.verify_ms.items() if m > n])

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

    def observe(self, k: int, draft_ms: float, verify_ms: float, forwards: int | None = None) -> None:
        """An iteration of k drafts in `forwards` draft forwards (k where not said; 0: its first draft came with a
        catch-up charged apart, nothing to learn a forward's cost from) and its verify."""
        forwards = k if forwards is None else forwards
        if k > 0 and forwards > 0:
            self.draft_step_ms = observed_median(self._recent, "draft", self.draft_step_ms, draft_ms / forwards)
        self.verify_ms[k + 1] = observed_median(self._recent, k + 1, self.verify(k + 1), verify_ms)

    def observe_catch_up(self, tokens: int, ms: float) -> None:
        if tokens > 0:
            old, per_token = self.catch_up_ms_per_token, max(0.0, ms - self.catch_up_base_ms) / tokens
            self.catch_up_ms_per_token = per_token if old is None else old + EWMA_WEIGHT * (per_token - old)


def beta_grid(accepted: float, drafted: float, points: int = BETA_GRID) -> list[tuple[float, float]]:
    """(a, weight) pairs integrating a Beta(accepted, drafted - accepted) density on a midpoint grid of (0, 1)."""
    alpha, beta = max(accepted, 1e-3), max(drafted - accepted, 1e-3)
    grid = [(i + 0.5) / points for i in range(points)]
    logs = [(alpha - 1) * math.log(a) + (beta - 1) * math.log(1 - a) for a in grid]
    top = max(logs)
    weights = [math.exp(v - top) for v in logs]
    total = sum(weights)
    return [(a, w / total) for a, w in zip(grid, weights, strict=True)]


class AcceptancePrior:
    """What completed requests accepted, per proposer source, and how long their replies ran: the start of every new
    request's estimate. One per process and pair (a batched engine shares it among its sequences); thread-safe."""

    def __init__(self, defaults: dict[str, tuple[float, float]] | None = None) -> None:
        self.defaults = dict(defaults or {})
        self._lock = threading.Lock()
        self._acceptance: dict[str, float] = {}  # source -> EWMA over requests of their acceptance
        self._spread: dict[str, float] = {}  # source -> EWMA over requests of (acceptance - that EWMA)^2
        self._requests: dict[str, int] = {}  # source -> requests recorded
        self._reply_tokens: float | None = None  # EWMA of generated tokens per request
        self._copied_share = DEFAULT_COPIED_SHARE  # EWMA of the share of a reply prompt lookup made

    def counts(self, source: str, default: tuple[float, float] = ACCEPTANCE_PRIOR) -> tuple[float, float]:
        """Pseudo-counts (accepted, drafted) a request's estimate for `source` starts from; `default` (or this
        prior's own default for the source) until a request has shown otherwise."""
        accepted, drafted = self.defaults.get(source, default)
        with self._lock:
            learned, seen = self._acceptance.get(source), self._requests.get(source, 0)
        if learned is None:
            return accepted, drafted
        strength = min(PRIOR_MAX_STRENGTH, drafted + seen)
        return learned * strength, strength

    def acceptance(self, source: str) -> float:
        accepted, drafted = self.counts(source)
        return accepted / drafted

    def record(self, source: str, accepted: float, attempted: float) -> None:
        """One completed request's accepted and attempted draft positions from `source` (teacher-forced included)."""
        if attempted < PRIOR_MIN_POSITIONS:
            return
        rate = accepted / attempted
        with self._lock:
            old = self._acceptance.get(source)
            self._acceptance[source] = rate if old is None else old + PRIOR_REQUEST_WEIGHT * (rate - old)
            if old is not None:
                spread = self._spread.get(source, (rate - old) ** 2)
                self._spread[source] = spread + PRIOR_REQUEST_WEIGHT * ((rate - old) ** 2 - spread)
            self._requests[source] = self._requests.get(source, 0) + 1

    def spread_strength(self, source: str) -> float:
        """The positions a Beta of this prior's acceptance holds so as to spread as much as completed requests'
        acceptances have (a method-of-moments fit, between VALUE_MIN_STRENGTH and VALUE_MAX_STRENGTH): how much a
        new request may differ from them. Each request's own sampling noise counts in, so it errs wide."""
        with self._lock:
            mean, spread = self._acceptance.get(source), self._spread.get(source)
            seen = self._requests.get(source, 0)
        if mean is None or spread is None or seen < PRIOR_SPREAD_REQUESTS:
            return VALUE_MIN_STRENGTH
        fitted = mean * (1.0 - mean) / max(spread, 1e-9) - 1.0
        return float(np.clip(fitted, VALUE_MIN_STRENGTH, VALUE_MAX_STRENGTH))

    def record_reply(self, tokens: int) -> None:
        with self._lock:
            old = self._reply_tokens
            self._reply_tokens = tokens if old is None else old + PRIOR_REQUEST_WEIGHT * (tokens - old)

    def record_copied(self, share: float) -> None:
        """The share of a completed reply that prompt lookup's accepted drafts made (with a draft model beside)."""
        with self._lock:
            self._copied_share += PRIOR_REQUEST_WEIGHT * (share - self._copied_share)

    @property
    def copied_share(self) -> float:
        with self._lock:
            return self._copied_share

    @property
    def reply_tokens(self) -> float:
        with self._lock:
            return DEFAULT_REPLY_TOKENS if self._reply_tokens is None else max(self._reply_tokens, 1.0)


@dataclass
class Plan:
    """What the next iteration does: draft k tokens from `source`, or a plain step (k = 0, source None)."""

    source: str | None
    k: int
    miss: bool = False  # the policy would draft from a source that has nothing to propose now (a lookup miss)
    predicted_speedup: float = 1.0  # tokens per ms of this plan over a plain step's, by the policy's estimates


class DraftPolicy(ABC):
    name: str
    wants_evidence = False  # the loop catches a lagging source up before the plan is final (observe_catch_up)

    @abstractmethod
    def choose(self, lag: int | None = None) -> int:
        """Draft length for the next iteration of a single-source proposer, 0..k_max; lag = tokens the proposer
        must take in before it can draft (a draft model's unseen prompt and plain-decoded tokens), None if unknown."""

    def plan(self, lags: dict[str, int | None], remaining: int | None = None, generated: int = 0) -> Plan:
        """Source and draft length for the next iteration. lags: per source of the proposer, the tokens it must take
        in before drafting, None where it has nothing to propose now; remaining: tokens the request may still
        generate; generated: tokens generated so far. By default: the first source that can propose, at choose()."""
        lag = next(iter(lags.values()), 0) if len(lags) == 1 else None
        k = self.choose(lag)
        available = [s for s, lag in lags.items() if lag is not None]
        if k == 0:
            return Plan(None, 0)
        if not available:
            return Plan(None, 0, miss=True)
        return Plan(available[0], k)

    def observe(self, k: int, n_accepted: int, draft_ms: float, verify_ms: float, catch_up: int = 0,
                chosen: bool = True, source: str | None = None, forwards: int | None = None) -> None:
        """What the last iteration cost and earned; catch_up = tokens the proposer evaluated before drafting;
        chosen = False: the policy asked for a draft and the proposer had none (prompt lookup found no match), so
        the plain step says what a step costs but nothing about whether drafting pays; source = who drafted;
        forwards = the draft forwards it took (a steady draft's catch-up of two tokens takes one more than k)."""

    def observe_catch_up(self, source: str, tokens: int, ms: float, matched: Sequence[bool]) -> None:
        """A source took in `tokens` unseen tokens in `ms`, and would have predicted matched[i] of the generated
        ones among them (teacher-forced, in order): evidence of its acceptance on this text before any draft."""

    def observe_evidence(self, source: str, matched: Sequence[bool]) -> None:
        """A source would have predicted matched[i] of the latest tokens, had it drafted (prompt lookup in
        hindsight)."""

    def belief(self) -> dict:
        """What the policy believes now (acceptance per source), for stats and `timings`."""
        return {}

    def finish(self, generated_tokens: int = 0, stopped: bool = False) -> None:
        """The request is over: hand what it showed to whatever outlives it (the shared prior). stopped: it ended
        by itself (a stop token), so generated_tokens is a reply's natural length, not a cut one."""


class FixedPolicy(DraftPolicy):
    name = "fixed"

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"draft length must be >= 0, got {k}")
        self.k = k

    def choose(self, lag: int | None = None) -> int:
        return self.k


@dataclass
class SourceState:
    """The adaptive policy's view of one proposer source within a request."""

    name: str
    costs: CostModel  # its draft step and catch-up; verify_ms is the policy's shared dict (the target's costs)
    prior: tuple[float, float]  # pseudo-counts it starts from and drifts back to while off
    accepted: float = 0.0  # decayed counts of accepted and attempted draft positions
    drafted: float = 0.0
    idle: int = 0  # plain iterations since it last ran, the policy having turned it off
    started: bool = False  # it has taken in this request's prompt (or decided against it)
    request_accepted: float = 0.0  # this request's totals, for the shared prior
    request_attempted: float = 0.0
    run_tokens: int = 0  # tokens its current run of drafting iterations has yielded
    mean_run_tokens: float = PAYBACK_TOKENS  # EWMA over its finished runs: what a catch-up is repaid over

    def __post_init__(self) -> None:
        self.accepted, self.drafted = self.prior

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted > 0 else 0.0


class AdaptivePolicy(DraftPolicy):
    """argmax over sources and k of E(k) / (k c_d + V(k+1)) from measured costs and this request's acceptance."""

    name = "adaptive"

    def __init__(self, costs: CostModel | dict[str, CostModel], k_max: int,
                 prior: tuple[float, float] = ACCEPTANCE_PRIOR, shared: AcceptancePrior | None = None,
                 evidence: bool = False) -> None:
        """costs: one CostModel (a single source, "draft-model") or source -> CostModel, the first the primary;
        their verify costs are the same target's, so all sources share the first one's. prior: pseudo-counts where
        `shared` has none. evidence: the proposer reports teacher-forced acceptance when it catches up (see
        EVIDENCE_TOKENS); without it a first switch-on is a plain probe."""
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        by_source = costs if isinstance(costs, dict) else {DRAFT_MODEL_SOURCE: costs}
        if not by_source:
            raise ValueError("the adaptive policy needs the costs of at least one source")
        self.k_max = k_max
        self.shared = shared
        self.evidence = self.wants_evidence = evidence
        verify_ms = next(iter(by_source.values())).verify_ms
        self.sources: dict[str, SourceState] = {}
        for name, source_costs in by_source.items():
            source_costs.verify_ms = verify_ms  # a copy per request: refinements must not leak between requests
            start = shared.counts(name, prior) if shared is not None else prior
            self.sources[name] = SourceState(name, source_costs, start)
        self.primary = next(iter(self.sources.values()))
        self._predicted: list[float] = []  # predicted speed-up of each planned iteration
        self.copied = 0  # tokens of this reply made by prompt lookup's accepted drafts (see _candidate)

    # The single-source view the tests and the doctor use.
    @property
    def costs(self) -> CostModel:
        return self.primary.costs

    @property
    def acceptance(self) -> float:
        return self.primary.acceptance

    @property
    def idle(self) -> int:
        return self.primary.idle

    def catch_up_ms(self, tokens: int) -> float:
        return self.primary.costs.catch_up_ms(tokens)

    def switch_on_cost_ms(self, lag: int | None = None, source: SourceState | None = None) -> float:
        """What drafting again costs over a plain step: the draft catches up on the `lag` tokens it has not seen
        (default: the `idle` ones decoded since it last ran), drafts one, and the target verifies two tokens
        instead of one."""
        src = source or self.primary
        costs = src.costs
        return (costs.catch_up_ms(src.idle if lag is None else lag) + costs.draft_step_ms
                + max(0.0, costs.verify(2) - costs.verify(1)))

    def value_of_drafting_ms(self, src: SourceState) -> tuple[float, float]:
        """(expected ms a token that drafting from src saves, the probability it saves nothing), over the
        uncertainty in its acceptance (a Beta of its pseudo-counts): where acceptance turns out too low to pay,
        drafting stays off and saves 0."""
        costs, plain_ms = src.costs, src.costs.verify(1)
        value = p_no_gain = 0.0
        least = self.shared.spread_strength(src.name) if self.shared is not None else VALUE_MIN_STRENGTH
        strength = max(src.drafted, least)
        for a, weight in beta_grid(src.acceptance * strength, strength):
            gain = plain_ms - 1.0 / costs.tokens_per_ms(a, costs.best_draft_len(a, self.k_max))
            value += weight * max(0.0, gain)
            p_no_gain += weight if gain <= 0 else 0.0
        return value, p_no_gain

    def _candidate(self, src: SourceState, lag: int | None, remaining: int | None, generated: int) -> tuple[int, float]:
        """(k, predicted tokens per ms) for drafting from src next, k = 0 where it should not."""
        costs = src.costs
        plain_rate = 1.0 / costs.verify(1)
        lag = src.idle if lag is None else lag
        catch_up_ms = costs.catch_up_ms(lag) if lag > STEADY_CATCH_UP else 0.0
        # Beside prompt lookup, a draft model's token is worth only what lookup would not have copied for free in
        # the iterations after: the share of the reply lookup did not make so far.
        left = 1.0 - lookup_share(self.copied, generated) \
            if src.name == DRAFT_MODEL_SOURCE and len(self.sources) > 1 else 1.0
        if catch_up_ms > 0 and not src.started:
            # First switch-on: take in the prompt only where the drafting it may buy is worth it.
            tokens = self.shared.reply_tokens if self.shared is not None else DEFAULT_REPLY_TOKENS
            tokens = (min(tokens, remaining) if remaining is not None else tokens) * left
            gain_ms, p_no_gain = self.value_of_drafting_ms(src)
            if gain_ms * tokens < PROBE_VALUE_MARGIN * catch_up_ms:
                src.started, src.idle = True, max(src.idle, 1)  # declined: from here on only a re-probe turns it on
                return 0, plain_rate
            # Wait for generated tokens to test the draft on unless waiting clearly costs more (by the same margin)
            # than it risks: the drafting gain of the tokens waited for, against the catch-up and the drafts wasted
            # where acceptance turns out too low.
            wait = EVIDENCE_TOKENS - generated
            learning_ms = LEARNING_ITERATIONS * (costs.draft_step_ms + max(0.0, costs.verify(2) - costs.verify(1)))
            if len(self.sources) > 1:  # or the reply copies its prompt, which lookup's hindsight would show
                p_no_gain = copied_risk(p_no_gain, self.shared)
            risk_ms = PROBE_VALUE_MARGIN * p_no_gain * (catch_up_ms + learning_ms)
            if self.evidence and wait > 0 and wait * gain_ms < risk_ms:
                return 0, plain_rate
            k = max(1, costs.best_draft_len(src.acceptance, self.k_max))
            return k, max(costs.tokens_per_ms(src.acceptance, k), plain_rate * (1.0 + 1e-9))
        # While off, stale evidence fades back to the prior until drafting looks worth a try. The try first pays
        # the catch-up on every token since, so it waits until that is a small part of the plain time since: where
        # catch-up costs more than PROBE_BUDGET of a target step a token, drafting stays off for good. Asked before
        # the argmax over k, so that a policy staying off costs a few us an iteration, not ~45 (Python, 2-core CPU).
        if src.idle > 0 and self.switch_on_cost_ms(lag, src) > PROBE_BUDGET * src.idle * costs.verify(1):
            return 0, plain_rate
        a = src.acceptance * left
        # A catch-up after another source drafted is charged to the tokens its run is expected to yield.
        best_k, best_rate = 0, plain_rate
        for k in range(1, self.k_max + 1):
            rate = costs.tokens_per_ms(a, k, catch_up_ms * expected_tokens(a, k) / max(src.mean_run_tokens, 1.0))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def plan(self, lags: dict[str, int | None], remaining: int | None = None, generated: int = 0) -> Plan:
        best = Plan(None, 0)
        best_rate = plain_rate = 1.0 / self.primary.costs.verify(1)
        missed_rate = 0.0
        for name, lag in lags.items():
            src = self.sources.get(name)
            if src is None:
                raise ValueError(f"the policy knows sources {', '.join(self.sources)}, not {name!r}")
            k, rate = self._candidate(src, 0 if lag is None else lag, remaining, generated)
            if k == 0:
                continue
            if lag is None:
                missed_rate = max(missed_rate, rate)
            elif rate > best_rate:
                best, best_rate = Plan(name, k), rate
        if best.k == 0 and missed_rate > plain_rate:
            best = Plan(None, 0, miss=True)
        best.predicted_speedup = best_rate / plain_rate
        self._predicted.append(best.predicted_speedup)
        return best

    def choose(self, lag: int | None = None) -> int:
        k, _ = self._candidate(self.primary, lag, None, EVIDENCE_TOKENS)
        return k

    def observe(self, k: int, n_accepted: int, draft_ms: float, verify_ms: float, catch_up: int = 0,
                chosen: bool = True, source: str | None = None, forwards: int | None = None) -> None:
        src = self.sources[source] if source is not None else self.primary
        if not chosen:
            # Not an idle step: counting it so made prompt lookup pay the switch-on wait of a policy that had
            # turned drafting off (~8 plain steps after each miss), 1.2x where drafting after it gave 1.7x (H200).
            src.costs.observe(0, 0.0, verify_ms)
            return
        if k == 0:
            src.costs.observe(0, 0.0, verify_ms)
            for s in self.sources.values():
                s.idle += 1
                s.accepted = s.prior[0] + IDLE_DECAY * (s.accepted - s.prior[0])
                s.drafted = s.prior[1] + IDLE_DECAY * (s.drafted - s.prior[1])
            return
        # The first draft after plain steps also catches up on every token decoded meanwhile (seen on an H200:
        # 46-158 ms for one draft token). Charging that to c_d made drafting look 4x dearer and kept it off for
        # the rest of the request; a steady draft catches up on 1-2 tokens, which its step cost does include.
        steady = catch_up <= STEADY_CATCH_UP
        src.costs.observe(k, draft_ms if steady else k * src.costs.draft_step_ms, verify_ms,
                          forwards if steady else None)
        if not steady:
            src.costs.observe_catch_up(catch_up, max(0.0, draft_ms - (k - 1) * src.costs.draft_step_ms))
        src.idle, src.started = 0, True
        for other in self.sources.values():  # another source's run of drafting ends here
            if other is not src and other.run_tokens:
                other.mean_run_tokens += EWMA_WEIGHT * 2 * (other.run_tokens - other.mean_run_tokens)
                other.run_tokens = 0
        src.run_tokens += n_accepted + 1
        if src.name != DRAFT_MODEL_SOURCE:
            self.copied += n_accepted
        # Positions reached: every accepted one, plus the rejected one if the run stopped early.
        attempted = n_accepted + (1 if n_accepted < k else 0)
        src.accepted = ACCEPTANCE_DECAY * src.accepted + n_accepted
        src.drafted = ACCEPTANCE_DECAY * src.drafted + attempted
        src.request_accepted += n_accepted
        src.request_attempted += attempted

    def observe_catch_up(self, source: str, tokens: int, ms: float, matched: Sequence[bool]) -> None:
        src = self.sources[source]
        src.costs.observe_catch_up(tokens, ms)
        self.observe_evidence(source, matched)

    def observe_evidence(self, source: str, matched: Sequence[bool]) -> None:
        src = self.sources.get(source)
        if src is None or not matched:
            return
        src.idle, src.started = 0, True
        # In order, each position weighing as a drafting iteration would: the latest text counts most.
        for match in matched:
            src.accepted = ACCEPTANCE_DECAY * src.accepted + match
            src.drafted = ACCEPTANCE_DECAY * src.drafted + 1
        src.request_accepted += sum(matched)
        src.request_attempted += len(matched)

    def belief(self) -> dict:
        return {
            "acceptance": {name: src.acceptance for name, src in self.sources.items()},
            "prior_acceptance": {name: src.prior[0] / src.prior[1] for name, src in self.sources.items()},
            "predicted_speedup": sum(self._predicted) / len(self._predicted) if self._predicted else 1.0,
        }

    def finish(self, generated_tokens: int = 0, stopped: bool = False) -> None:
        if self.shared is None:
            return
        for name, src in self.sources.items():
            self.shared.record(name, src.request_accepted, src.request_attempted)
        if len(self.sources) > 1 and DRAFT_MODEL_SOURCE in self.sources and generated_tokens > 0:
            self.shared.record_copied(self.copied / generated_tokens)
        if stopped:
            self.shared.record_reply(generated_tokens)
