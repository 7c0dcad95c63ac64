"""The arithmetic of drafting, and what the engine's adaptive policy learns across requests.

Leviathan et al. 2023, sec. 3.4: with per-token acceptance a, drafting k tokens yields E(k) = (1 - a^(k+1)) / (1 - a)
tokens per iteration, at a cost of k * c_d (draft steps) + V(k+1) (one target forward over k+1 tokens). Plain
decoding is k = 0: one token per V(1) (the measured costs: tandem.engine.costs). What completed requests accepted
lives in an `AcceptancePrior` that every sequence of a target shares (`shared_prior`): it is where a new request's
estimate starts. The constants below are the
policy's, with the reason for each value.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from tandem.config import POLICY
from tandem.speculative.proposer import NgramProposer

DRAFT_MODEL_SOURCE = "draft-model"  # the source name of a draft model (the others are prompt lookup's)


def lookup_share(copied: int, generated: int) -> float:
    """The share of a reply prompt lookup's accepted drafts made: `copied` of `generated` tokens, counted over
    POLICY.lookup_share_prior_tokens more (none copied)."""
    return copied / (generated + POLICY.lookup_share_prior_tokens)


def copied_risk(p_no_gain: float, shared: AcceptancePrior | None) -> float:
    """The chance a draft's first catch-up buys nothing beside prompt lookup: its acceptance turns out too low, or
    the reply copies its prompt (as much as completed replies did), leaving the draft little to propose."""
    copied = shared.copied_share if shared is not None else POLICY.default_copied_share
    return 1.0 - (1.0 - p_no_gain) * (1.0 - copied)


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): tokens an iteration yields, accepted drafts plus the target's own token."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def beta_grid(accepted: float, drafted: float, points: int = POLICY.beta_grid) -> list[tuple[float, float]]:
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
        self._copied_share = POLICY.default_copied_share  # EWMA of the share of a reply prompt lookup made
        self._unread_ms: dict[str, float] = {}  # source -> plain ms of requests that never read it, since it learned

    def counts(self, source: str, default: tuple[float, float] = POLICY.acceptance_prior) -> tuple[float, float]:
        """Pseudo-counts (accepted, drafted) a request's estimate for `source` starts from; `default` (or this
        prior's own default for the source) until a request has shown otherwise."""
        accepted, drafted = self.defaults.get(source, default)
        with self._lock:
            learned, seen = self._acceptance.get(source), self._requests.get(source, 0)
        if learned is None:
            return accepted, drafted
        strength = min(POLICY.prior_max_strength, drafted + seen)
        return learned * strength, strength

    def acceptance(self, source: str) -> float:
        accepted, drafted = self.counts(source)
        return accepted / drafted

    def record(self, source: str, accepted: float, attempted: float) -> None:
        """One completed request's accepted and attempted draft positions from `source` (teacher-forced included)."""
        if attempted < POLICY.prior_min_positions:
            return
        rate = accepted / attempted
        with self._lock:
            old = self._acceptance.get(source)
            self._acceptance[source] = rate if old is None else old + POLICY.prior_request_weight * (rate - old)
            if old is not None:
                spread = self._spread.get(source, (rate - old) ** 2)
                self._spread[source] = spread + POLICY.prior_request_weight * ((rate - old) ** 2 - spread)
            self._requests[source] = self._requests.get(source, 0) + 1
            self._unread_ms[source] = 0.0

    def spread_strength(self, source: str) -> float:
        """The positions a Beta of this prior's acceptance holds so as to spread as much as completed requests'
        acceptances have (a method-of-moments fit, between POLICY.value_min_strength and POLICY.value_max_strength): how
        much a new request may differ from them. Each request's own sampling noise counts in, so it errs wide."""
        with self._lock:
            mean, spread = self._acceptance.get(source), self._spread.get(source)
            seen = self._requests.get(source, 0)
        if mean is None or spread is None or seen < POLICY.prior_spread_requests:
            return POLICY.value_min_strength
        fitted = mean * (1.0 - mean) / max(spread, 1e-9) - 1.0
        return float(np.clip(fitted, POLICY.value_min_strength, POLICY.value_max_strength))

    def note_unread(self, source: str, plain_ms: float) -> None:
        """A completed request that never read nor drafted by `source` decoded plain for `plain_ms` (its share)."""
        with self._lock:
            self._unread_ms[source] = self._unread_ms.get(source, 0.0) + plain_ms

    def may_explore(self, source: str, catch_up_ms: float) -> bool:
        """Whether a read of `source` costing `catch_up_ms` is within POLICY.explore_budget of the plain time of the
        requests that did not read it since it last learned."""
        with self._lock:
            return POLICY.explore_budget * self._unread_ms.get(source, 0.0) >= catch_up_ms > 0.0

    def explored(self, source: str) -> None:
        """A request reads `source` on the exploration budget: it is spent."""
        with self._lock:
            self._unread_ms[source] = 0.0

    def record_reply(self, tokens: int) -> None:
        with self._lock:
            old = self._reply_tokens
            self._reply_tokens = tokens if old is None else old + POLICY.prior_request_weight * (tokens - old)

    def record_copied(self, share: float) -> None:
        """The share of a completed reply that prompt lookup's accepted drafts made (with a draft model beside)."""
        with self._lock:
            self._copied_share += POLICY.prior_request_weight * (share - self._copied_share)

    @property
    def copied_share(self) -> float:
        with self._lock:
            return self._copied_share

    @property
    def reply_tokens(self) -> float:
        with self._lock:
            return POLICY.default_reply_tokens if self._reply_tokens is None else max(self._reply_tokens, 1.0)


_priors_lock = threading.Lock()


def shared_prior(target, drafter: str = "shared") -> AcceptancePrior:
    """The process-wide acceptance prior of a target's requests (kept on the target, like its costs): per source,
    so prompt lookup alone and mixed with a draft share what lookup accepted. drafter: "head" keeps a head draft's
    own (it drafts in the draft model's place, and accepts what a draft model would not)."""
    priors = target.__dict__.setdefault("_tandem_priors", {})
    with _priors_lock:
        if drafter not in priors:
            lookup = NgramProposer()
            defaults = {s: POLICY.ngram_prior for s in lookup.sources}
            defaults[lookup.sources[0]] = POLICY.long_match_prior
            priors[drafter] = AcceptancePrior(defaults)
        return priors[drafter]
