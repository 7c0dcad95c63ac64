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

from tandem.speculative.proposer import NgramProposer

# The measurements behind these constants: docs/decisions/0004-acceptance-policy.md.
# Pseudo-counts (accepted, drafted) a fresh process starts from and every estimate drifts back to while drafting is
# off: a = 0.7, what same-family pairs reach on code and JSON, held weakly so that a request's evidence outweighs it.
ACCEPTANCE_PRIOR = (1.4, 2.0)
NGRAM_PRIOR = (0.5, 2.0)  # prompt lookup proposes often-wrong continuations until the request shows otherwise ...
LONG_MATCH_PRIOR = (1.0, 2.0)  # ... less so after a match of its longest n-gram
# What acceptance a request may turn out to have is a Beta of the estimate's pseudo-counts, held as at least this
# many positions (about as much spread as one pair's acceptance across prompts); a weaker one puts much weight near
# 1, where drafting would win big, and bets on it too often.
VALUE_MIN_STRENGTH = 4.0
# ... until completed requests show how much they differ (AcceptancePrior.spread_strength): the Beta whose spread is
# their acceptances' spread, at most VALUE_MAX_STRENGTH positions, once PRIOR_SPREAD_REQUESTS requests are recorded.
# Where requests all accept alike a Beta of 4 positions values reads and prompts for drafting that never comes.
VALUE_MAX_STRENGTH = 64.0
PRIOR_SPREAD_REQUESTS = 3
# Turning drafting back on may cost at most this fraction of the plain time since it went off (a re-probe after a
# plain stretch first catches the draft up on every token it missed).
PROBE_BUDGET = 0.03
# A request reads a draft its prior says will not pay once the requests that did not read it since the prior last
# learned decoded plain for this fraction's worth of the read (AcceptancePrior.may_explore): a prior learned low
# would otherwise hold for good, since a request that does not read records nothing.
EXPLORE_BUDGET = 0.005
# A draft that has not run yet in a request first takes in the prompt. It does so only when the drafting that this
# buys is worth PROBE_VALUE_MARGIN times that catch-up: the expected time saved over the rest of the reply, with the
# expectation over what the acceptance may be (a Beta of the prior's pseudo-counts), since the catch-up itself shows
# the acceptance (see EVIDENCE_TOKENS) and drafting stays off where it turns out not to pay.
PROBE_VALUE_MARGIN = 2.0
# Generated tokens to wait for before that first catch-up: the draft then reads them, teacher-forced, and how many
# it would have predicted is this request's acceptance, measured before a single draft is verified.
EVIDENCE_TOKENS = 6
EVIDENCE_ROWS = 16  # an evidence read reads the draft's predictions of at most this many latest tokens
LEARNING_ITERATIONS = 4  # drafting iterations a policy without that evidence spends learning that a draft is poor
STEADY_CATCH_UP = 2  # a draft that catches up on at most this many tokens is drafting steadily (see observe)
DEFAULT_REPLY_TOKENS = 128  # the reply length a fresh process expects (the value of drafting is per token left)
PRIOR_REQUEST_WEIGHT = 0.3  # weight of a completed request in the shared prior's acceptance
PRIOR_MIN_POSITIONS = 6  # a request that tried fewer draft positions says too little to move the prior
PRIOR_MAX_STRENGTH = 6.0  # pseudo-positions the learned prior is held with: requests differ
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


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): tokens an iteration yields, accepted drafts plus the target's own token."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


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
        self._unread_ms: dict[str, float] = {}  # source -> plain ms of requests that never read it, since it learned

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
            self._unread_ms[source] = 0.0

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

    def note_unread(self, source: str, plain_ms: float) -> None:
        """A completed request that never read nor drafted by `source` decoded plain for `plain_ms` (its share)."""
        with self._lock:
            self._unread_ms[source] = self._unread_ms.get(source, 0.0) + plain_ms

    def may_explore(self, source: str, catch_up_ms: float) -> bool:
        """Whether a read of `source` costing `catch_up_ms` is within EXPLORE_BUDGET of the plain time of the
        requests that did not read it since it last learned."""
        with self._lock:
            return EXPLORE_BUDGET * self._unread_ms.get(source, 0.0) >= catch_up_ms > 0.0

    def explored(self, source: str) -> None:
        """A request reads `source` on the exploration budget: it is spent."""
        with self._lock:
            self._unread_ms[source] = 0.0

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


_priors_lock = threading.Lock()


def shared_prior(target, drafter: str = "shared") -> AcceptancePrior:
    """The process-wide acceptance prior of a target's requests (kept on the target, like its costs): per source,
    so prompt lookup alone and mixed with a draft share what lookup accepted. drafter: "head" keeps a head draft's
    own (it drafts in the draft model's place, and accepts what a draft model would not)."""
    priors = target.__dict__.setdefault("_tandem_priors", {})
    with _priors_lock:
        if drafter not in priors:
            lookup = NgramProposer()
            defaults = {s: NGRAM_PRIOR for s in lookup.sources}
            defaults[lookup.sources[0]] = LONG_MATCH_PRIOR
            priors[drafter] = AcceptancePrior(defaults)
        return priors[drafter]
