"""Draft-length policies: how many tokens to draft before each verify (0 = plain decoding).

The arithmetic (Leviathan et al. 2023, sec. 3.4): with per-token acceptance a, drafting k tokens yields
E(k) = (1 - a^(k+1)) / (1 - a) tokens per iteration, at a cost of k * c_d (draft steps) + V(k+1) (one target
forward over k+1 tokens). Plain decoding is k = 0: one token per V(1). The adaptive policy measures c_d and V(n)
on the device it runs on, tracks a per request, and each iteration takes the k with the most tokens per ms.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

EWMA_WEIGHT = 0.2  # weight of a new timing in the running cost estimates
ACCEPTANCE_DECAY = 0.9  # per drafting iteration: evidence halves in ~7 iterations, so the policy follows a prompt
IDLE_DECAY = 0.97  # per plain iteration: evidence fades to the prior, halfway in ~23 tokens
# Pseudo-counts (accepted, drafted) that every estimate starts from and drifts back to: a = 0.7, what same-family
# pairs reach on code and JSON (CONTEXT.md: 0.63-0.82). Starting on where the costs allow is cheap; turning on
# later means catching the draft up on everything decoded meanwhile.
ACCEPTANCE_PRIOR = (1.4, 2.0)
# Turning drafting back on may cost at most this fraction of the plain time since it went off. A probe first catches
# the draft up on every token it missed, so a probe costs about catch-up/plain-step of the time spent idle (0.15 / 1.85
# ms a token for the real pair on an H200); at 0.1, failed probes cost the code and freeform prompts 4-5% there.
PROBE_BUDGET = 0.03
# A draft that must first take in many tokens (the prompt, at the start of a request) drafts only if its predicted
# gain repays that catch-up within this many tokens: a 60-token prompt costs a launch-bound draft on an H200 four
# plain steps to take in, more than drafting at a 3% gain wins back in a short reply. The gain is predicted at the
# prior acceptance, a guess: at 64 tokens a 46-token prompt's catch-up was bet on a predicted 7%, and the text's
# acceptance (0.61) and the draft's cost in the loop (1.21 ms against 0.95 calibrated) made it 0.95x (H200).
PAYBACK_TOKENS = 32
STEADY_CATCH_UP = 2  # a draft that catches up on at most this many tokens is drafting steadily (see observe)


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

    def verify(self, n: int) -> float:
        """V(n), linear between (and beyond) the measured points: a forward's cost is affine in its tokens. Never
        above a measured V(m) for m > n, since a forward over more tokens costs no less: V(1) is measured only by
        plain steps, so a V(1) that calibration overstated (a cold Vulkan pipeline, seen on an H200) would
        otherwise keep a losing draft length on for good, the steps that would correct it never taken."""
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

    def tokens_per_ms(self, acceptance: float, k: int) -> float:
        return expected_tokens(acceptance, k) / (k * self.draft_step_ms + self.verify(k + 1))

    def best_draft_len(self, acceptance: float, k_max: int) -> int:
        return max(range(k_max + 1), key=lambda k: (self.tokens_per_ms(acceptance, k), -k))

    def predicted_speedup(self, acceptance: float, k_max: int) -> float:
        k = self.best_draft_len(acceptance, k_max)
        return self.tokens_per_ms(acceptance, k) / self.tokens_per_ms(acceptance, 0)

    def observe(self, k: int, draft_ms: float, verify_ms: float) -> None:
        if k > 0:
            self.draft_step_ms += EWMA_WEIGHT * (draft_ms / k - self.draft_step_ms)
        n = k + 1
        old = self.verify_ms.get(n)
        self.verify_ms[n] = verify_ms if old is None else old + EWMA_WEIGHT * (verify_ms - old)


class DraftPolicy(ABC):
    name: str

    @abstractmethod
    def choose(self, lag: int | None = None) -> int:
        """Draft length for the next iteration, 0..k_max; lag = tokens the proposer must take in before it can
        draft (a draft model's unseen prompt and plain-decoded tokens), None if unknown."""

    def observe(self, k: int, n_accepted: int, draft_ms: float, verify_ms: float, catch_up: int = 0,
                chosen: bool = True) -> None:
        """What the last iteration cost and earned; catch_up = tokens the proposer evaluated before drafting;
        chosen = False: the policy asked for a draft and the proposer had none (prompt lookup found no match), so
        the plain step says what a step costs but nothing about whether drafting pays."""


class FixedPolicy(DraftPolicy):
    name = "fixed"

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"draft length must be >= 0, got {k}")
        self.k = k

    def choose(self, lag: int | None = None) -> int:
        return self.k


class AdaptivePolicy(DraftPolicy):
    """argmax_k E(k) / (k c_d + V(k+1)) from measured costs and this request's acceptance, probing when off."""

    name = "adaptive"

    def __init__(self, costs: CostModel, k_max: int, prior: tuple[float, float] = ACCEPTANCE_PRIOR) -> None:
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.costs = costs  # a copy per request: online refinements must not leak between requests' devices
        self.k_max = k_max
        self.prior = prior
        self.accepted, self.drafted = prior  # decayed counts of accepted and attempted draft positions
        self.idle = 0  # plain iterations since the draft last ran

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted > 0 else 0.0

    def catch_up_ms(self, tokens: int) -> float:
        costs = self.costs
        per_token = costs.catch_up_ms_per_token if costs.catch_up_ms_per_token is not None else costs.draft_step_ms
        return tokens * per_token

    def switch_on_cost_ms(self, lag: int | None = None) -> float:
        """What drafting again costs over a plain step: the draft catches up on the `lag` tokens it has not seen
        (default: the `idle` ones decoded since it last ran), drafts one, and the target verifies two tokens
        instead of one."""
        costs = self.costs
        return (self.catch_up_ms(self.idle if lag is None else lag) + costs.draft_step_ms
                + max(0.0, costs.verify(2) - costs.verify(1)))

    def choose(self, lag: int | None = None) -> int:
        # While drafting is off, stale evidence fades back to the prior until drafting looks worth a try. The try
        # first pays the draft's catch-up (on the whole prompt, if the draft never ran), so it waits until that is
        # a small part of the plain time since: where catch-up costs more than PROBE_BUDGET of a target step a
        # token (a 2-core CPU; a launch-bound draft on a big GPU), drafting stays off for good. Asked before the
        # argmax over k, so that a policy staying off costs a few us an iteration, not ~45 (Python on a 2-core
        # CPU; 1.5% of a 3 ms Vulkan step on an H200, where adaptive measured 0.96x plain without drafting once).
        if self.idle > 0 and self.switch_on_cost_ms(lag) > PROBE_BUDGET * self.idle * self.costs.verify(1):
            return 0
        k = self.costs.best_draft_len(self.acceptance, self.k_max)
        if k > 0 and lag:
            a, costs = self.acceptance, self.costs
            gain_per_token_ms = costs.verify(1) * (1.0 - costs.tokens_per_ms(a, 0) / costs.tokens_per_ms(a, k))
            if self.catch_up_ms(lag) > PAYBACK_TOKENS * gain_per_token_ms:
                return 0
        return k

    def observe(self, k: int, n_accepted: int, draft_ms: float, verify_ms: float, catch_up: int = 0,
                chosen: bool = True) -> None:
        if not chosen:
            # Not an idle step: counting it so made prompt lookup pay the switch-on wait of a policy that had
            # turned drafting off (~8 plain steps after each miss), 1.2x where drafting after it gave 1.7x on a
            # summary prompt (real outputs, an H200's step costs).
            self.costs.observe(0, 0.0, verify_ms)
            return
        # The first draft after plain steps also catches up on every token decoded meanwhile (seen on an H200:
        # 46-158 ms for one draft token). Charging that to c_d made drafting look 4x dearer and kept it off for
        # the rest of the request; a steady draft catches up on 1-2 tokens, which its step cost does include.
        steady = catch_up <= STEADY_CATCH_UP
        self.costs.observe(k, draft_ms if steady else k * self.costs.draft_step_ms, verify_ms)
        if not steady:
            measured = max(0.0, draft_ms - (k - 1) * self.costs.draft_step_ms) / catch_up
            old = self.costs.catch_up_ms_per_token
            self.costs.catch_up_ms_per_token = measured if old is None else old + EWMA_WEIGHT * (measured - old)
        if k == 0:
            self.idle += 1
            self.accepted = self.prior[0] + IDLE_DECAY * (self.accepted - self.prior[0])
            self.drafted = self.prior[1] + IDLE_DECAY * (self.drafted - self.prior[1])
            return
        self.idle = 0
        # Positions reached: every accepted one, plus the rejected one if the run stopped early.
        attempted = n_accepted + (1 if n_accepted < k else 0)
        self.accepted = ACCEPTANCE_DECAY * self.accepted + n_accepted
        self.drafted = ACCEPTANCE_DECAY * self.drafted + attempted
