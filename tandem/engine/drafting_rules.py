"""When each decoding sequence drafts, from which source, and whether its draft first reads the text it missed:
the per-sequence rules the engine's plan applies before the planner (tandem.engine.planner) picks draft lengths
from the batched costs. Read with docs/batching.md ("Speculation under load").

`DraftingRules` is the part of `Engine` that holds these rules; the state they read (the costs, the shared prior,
the drafter, the target's cache, the per-step caches `_values` and `_rates`) is the engine's.
"""

from __future__ import annotations

from tandem.engine import planner
from tandem.engine.sequence import DRAFT_MODEL, Generation
from tandem.speculative.policy import (
    ACCEPTANCE_PRIOR,
    EVIDENCE_TOKENS,
    LEARNING_ITERATIONS,
    PROBE_BUDGET,
    PROBE_VALUE_MARGIN,
    STEADY_CATCH_UP,
    copied_risk,
    expected_tokens,
)

# The draft takes in a prompt beside the target's prefill only where the chance that drafting gains nothing is at
# most this (over the Beta of the request's acceptance, _draft_may_pay); elsewhere its first read takes the
# prompt in, once EVIDENCE_TOKENS are generated, where that read is judged worth it. Prompts taken in on expected
# value alone cost 2-4% at 2 and 4 requests where drafting barely paid (H100 costs, emulated).
PREFILL_MAX_RISK = 0.2
# The drafting floors (DraftingRules._floor): bisected to this precision, from an acceptance of FLOOR_TOP down, and
# kept this many steps before they are bisected again from the costs as learned by then.
FLOOR_PRECISION = 1.0 / 64
FLOOR_TOP = 0.99
FLOOR_STEPS = 64


class DraftingRules:
    """The rules; mixed into Engine, whose state they read."""

    def _draft_may_pay(self, gen: Generation, batch: int) -> bool:
        """Whether the draft takes in the prompt beside the target's prefill: where `batch` sequences drafting alike
        would likely gain (PREFILL_MAX_RISK) and the expected gain over the reply is worth PROBE_VALUE_MARGIN times
        that prefill (the first read's test, `_first_read_pays`, over the Beta of the request's prior). A draft that
        took in nothing must catch up on the whole prompt at its first read, a cost that kept it off for good where
        it would have paid (H200/H100, 32B target: the engine never drafted at 1 and 2 requests); a draft that
        cannot pay on this machine (a CPU's 1.5B/0.5B pair), at this load, or likely enough leaves it to that read."""
        if DRAFT_MODEL not in gen.estimates or gen.draft_max == 0:
            return False
        if gen.request.draft_policy == "fixed" or self.costs is None:  # no costs: every draft drafts its k_max
            return True
        if self._floor(batch, False) >= 1.0:  # no acceptance pays at this load: nothing to value
            return False
        _, p_no_gain = self._value_of_drafting(gen, batch)
        return p_no_gain <= PREFILL_MAX_RISK and self._first_read_pays(gen, batch)

    def _floor(self, batch: int, lookup: bool) -> float:
        """The least acceptance at which some of `batch` sequences drafting alike (nothing to catch up, up to
        draft_max tokens, by prompt lookup or by the draft model) beats plain steps by the costs; 1.0 where none does.
        Bisected to FLOOR_PRECISION from below (a lower bound), kept FLOOR_STEPS steps (the costs learn slowly)."""
        key = (id(self.costs), batch, lookup)
        kept = self._floors.get(key)
        if kept is not None and kept[1] > self._step_count:
            return kept[0]

        def pays(a: float) -> bool:
            return planner.plan([planner.Candidate(a, self.draft_max, lookup=lookup)] * batch, self.costs)[0] > 0

        low, high = 0.0, FLOOR_TOP
        if not pays(high):
            low = 1.0
        while high - low > FLOOR_PRECISION:
            middle = (low + high) / 2
            low, high = (low, middle) if pays(middle) else (middle, high)
        self._floors[key] = (low, self._step_count + FLOOR_STEPS)
        return low

    def _may_draft(self, decoding: list[Generation]) -> bool:
        """Whether this step's plan could have any sequence draft or read: the cheap test that lets a batch where
        nothing can pay skip the rules' per-sequence work (at 64 requests it cost more than the forward's host side).
        A sequence could draft by the model where its estimate, or the estimate a read or an exploration would test,
        reaches the model's floor at this batch size; by lookup where its text repeats at an acceptance that
        reaches lookup's. Fixed drafters, and an engine without costs, always plan."""
        if self.costs is None or any(g.request.draft_policy == "fixed" for g in decoding):
            return True
        batch = len(decoding)
        if batch == 0:
            return False
        model_floor = self._floor(batch, False) if self.drafter is not None else 1.0
        lookup_floor = self._floor(batch, True)
        if model_floor >= 1.0 and lookup_floor >= 1.0:
            return False  # prompt lookup's hindsight catches up when planning resumes (NgramProposer is incremental)
        explore = ACCEPTANCE_PRIOR[0] / ACCEPTANCE_PRIOR[1]
        for gen in decoding:
            estimate = gen.estimates.get(DRAFT_MODEL)
            if model_floor < 1.0 and estimate is not None and not gen.draft_declined:
                accepted, drafted = estimate.counts(gen.plain_iterations)
                hoped = max(accepted / drafted, (accepted + EVIDENCE_TOKENS) / (drafted + EVIDENCE_TOKENS), explore)
                if hoped >= model_floor:
                    return True
            if lookup_floor < 1.0 and gen.ngram is not None:
                source, _ = gen.ngram.match(gen.tokens)
                if source is not None and gen.acceptance(source) >= lookup_floor:
                    return True
        return False

    def _drafts_at(self, acceptance: float, k_max: int, batch: int) -> bool:
        """Whether `batch` sequences at this acceptance, with nothing to catch up, draft by the costs (once a step
        for a given question: every new request asks it at the shared prior's counts)."""
        key = ("drafts_at", acceptance, k_max, batch)
        if key not in self._values:
            self._values[key] = planner.plan([planner.Candidate(acceptance, k_max)] * batch, self.costs)[0] > 0
        return self._values[key]


    def _reading_may_pay(self, candidate: planner.Candidate, prior: tuple[float, float], batch: int) -> bool:
        """Whether reading could switch on a draft that the plan keeps off at its prior: would `batch` sequences
        draft (nothing to catch up) at the acceptance that EVIDENCE_TOKENS matches in a row would give? Without
        this, a prior learned from requests that accepted little would keep every later request off unread, and so
        never learn otherwise."""
        return self._drafts_at((prior[0] + EVIDENCE_TOKENS) / (prior[1] + EVIDENCE_TOKENS), candidate.k_max, batch)

    def _lookup_may_pay(self, decoding: list[Generation]) -> bool:
        """Whether some sequence's text now repeats where its lookup estimate beats the least acceptance at which
        one more row pays in this batch (a plain batch's tokens per ms times a row's cost): then a plain plan is
        not kept. A cheap check, so that a batch of plain text is not replanned every step for 1-token matches."""
        lookups = [g for g in decoding if g.ngram is not None]
        if not lookups:
            return False
        if self.costs is None:
            return True
        b = len(decoding)
        least = b / self.costs.target_ms(b, b) * max(0.0, self.costs.target_ms(b, b + 1) - self.costs.target_ms(b, b))
        for gen in lookups:
            source, _ = gen.ngram.match(gen.tokens)
            if source is not None and gen.acceptance(source) > least:
                return True
        return False

    def _wants_evidence(self, gen: Generation, candidate: planner.Candidate) -> bool:
        """Whether the draft should read the text it missed before drafting: never read (nor verified) yet in
        this request, or stale (more than EVIDENCE_TOKENS plain iterations since) with more than a steady
        catch-up to read. A draft that took in the prompt waits for generated tokens to read as one that did not.
        Without costs every draft drafts its k_max, and its acceptance decides nothing."""
        if candidate.fixed or self.costs is None:
            return False
        estimate = gen.estimates[DRAFT_MODEL]
        if estimate.request_reached == 0:
            return True
        return candidate.lag > 0 and gen.plain_iterations - estimate.settled_at > EVIDENCE_TOKENS

    def _first_read_pays(self, gen: Generation, batch: int) -> bool:
        """The first switch-on test at this batch size: the draft takes in the prompt only where
        the drafting this may buy over the rest of the reply (expected over the estimate's uncertainty, in a batch
        of `batch` sequences drafting alike: planner.value_of_drafting) is worth PROBE_VALUE_MARGIN times that
        catch-up, which stalls the whole batch. A long prompt, a reply near its end, a draft barely ahead of plain
        decoding or a batch that drafting hardly speeds decline. Of the rest, the draft serves only what prompt
        lookup leaves (as it has so far): beside a lookup that copies most of the reply, reading a long prompt
        would buy a few tokens."""
        gain_ms, _ = self._value_of_drafting(gen, batch)
        tokens = min(self.prior.reply_tokens, gen.request.max_tokens - gen.emitted) * (1.0 - gen.lookup_share())
        return gain_ms * tokens >= PROBE_VALUE_MARGIN * self.costs.read_ms(self.drafter.lag(gen))

    def _worth_waiting(self, gen: Generation) -> bool:
        """The rule for a first switch-on: wait for generated tokens to read unless the drafting
        gain given up meanwhile exceeds what drafting blind risks (the catch-up and a few wasted drafts, weighted
        by the chance that the acceptance, a Beta of the estimate's counts, turns out too low to pay). At one
        sequence's costs whatever the batch: a wait delays every sequence of a batch alike, and valued as one
        sequence's share of its batch it waited 8 steps where reading at once drafted 5% more (3 requests, real
        text, H200 costs, emulated: bench/engine_emulation.py)."""
        gain_ms, p_no_gain = self._value_of_drafting(gen, 1)
        if gen.ngram is not None:  # or the reply copies its prompt, which lookup's hindsight would show
            p_no_gain = copied_risk(p_no_gain, self.prior)
        read_ms = self.costs.read_ms(self.drafter.lag(gen))
        extra_row_ms = max(0.0, self.costs.target_ms(1, 2) - self.costs.target_ms(1, 1))
        learning_ms = LEARNING_ITERATIONS * (self.costs.draft_ms(1) + extra_row_ms)
        wait = EVIDENCE_TOKENS - (len(gen.tokens) - gen.prompt_len)
        return wait * gain_ms < PROBE_VALUE_MARGIN * p_no_gain * (read_ms + learning_ms)

    def _explores(self, gen: Generation, batch: int) -> bool:
        """Whether a request reads the draft although its prior says that will not pay: where the requests since the
        prior last learned anything of the draft decoded plain long enough that this read's catch-up is within
        EXPLORE_BUDGET of their time (AcceptancePrior.may_explore), and drafting would pay in this batch at the
        acceptance a fresh process expects (ACCEPTANCE_PRIOR; a machine where even that cannot pay, a CPU's pair,
        has nothing to find). A prior learned low otherwise keeps every later request from reading, so that none
        records what the draft accepts now (emulated, Vulkan costs: after requests at acceptance 0.5, requests at
        0.8 never drafted)."""
        if self.costs is None or gen.draft_max == 0 or \
                not self.prior.may_explore(DRAFT_MODEL, self.costs.read_ms(self.drafter.lag(gen))):
            return False
        return self._drafts_at(ACCEPTANCE_PRIOR[0] / ACCEPTANCE_PRIOR[1], gen.draft_max, batch)

    def _reread_in_budget(self, gen: Generation, batch: int) -> bool:
        """The re-probe rule: a draft back after a plain stretch reads what it missed only where
        that catch-up, which stalls the batch, costs at most PROBE_BUDGET of this sequence's share of the plain time
        since it last ran. Its estimate fades back to a prior that may look worth drafting while its text is not:
        re-read every few steps, it cost 2-4% at 2 requests and acceptance 0.6 on an H100's costs (emulated,
        bench/regime_emulation.py), for reads that never switched it on."""
        idle = gen.plain_iterations - gen.estimates[DRAFT_MODEL].settled_at
        return self.costs.read_ms(self.drafter.lag(gen)) <= PROBE_BUDGET * idle * self.costs.plain_share_ms(batch)

    def _value_of_drafting(self, gen: Generation, batch: int) -> tuple[float, float]:
        """planner.value_of_drafting for this sequence, once a step for a given estimate (sixteen plans: new
        requests share their prior's counts, and a burst of them would plan it each)."""
        estimate = gen.estimates[DRAFT_MODEL]
        key = (*estimate.counts(gen.plain_iterations), gen.draft_max, batch)
        if (id(self.costs), key) not in self._values:
            self._values[id(self.costs), key] = planner.value_of_drafting(
                *key, self.costs, self.prior.spread_strength(DRAFT_MODEL))
        return self._values[id(self.costs), key]

    def _candidate(self, gen: Generation) -> planner.Candidate | None:
        """What the planner may have this sequence draft: prompt lookup where its text repeats and lookup promises
        at least what the draft model does (by the batch-1 costs), else the draft model (gen.draft_source says
        which); None where it cannot draft."""
        gen.draft_source = None
        if gen.proposer is None:
            return None
        room = self.target_kv.capacity - self.target_kv.length(gen.slot)
        k_max = min(gen.draft_max, gen.request.max_tokens - gen.emitted - 1, room - 1)
        if k_max <= 0:
            return None
        fixed = gen.request.draft_policy == "fixed"
        model = DRAFT_MODEL in gen.estimates and not gen.draft_declined
        if gen.ngram is not None:
            source, available = gen.ngram.match(gen.tokens)
            for name, matched in gen.ngram.hindsight().items():
                gen.observe_evidence(name, matched)
            lag = self.drafter.lag(gen) if model else 0
            if source is not None and (not model or self._lookup_beats_draft(gen, source, min(k_max, available),
                                                                             k_max, lag)):
                gen.draft_source = source
                return planner.Candidate(gen.acceptance(source), min(k_max, available), fixed=fixed, lookup=True)
        if not model:
            return None
        gen.draft_source = DRAFT_MODEL
        lag = self.drafter.lag(gen)
        # Beside prompt lookup, a draft's accepted token is worth only what lookup would not have copied for free
        # in the iterations after (its share of the reply so far): planned as that much less acceptance.
        acceptance = gen.acceptance(DRAFT_MODEL) * (1.0 - gen.lookup_share()) if gen.ngram is not None else \
            gen.acceptance(DRAFT_MODEL)
        return planner.Candidate(acceptance, k_max, max(0, lag - STEADY_CATCH_UP), fixed=fixed)

    def _lookup_beats_draft(self, gen: Generation, source: str, k_lookup: int, k_draft: int, lag: int) -> bool:
        """Whether one sequence drafting by lookup yields at least the tokens per ms of drafting by the draft model,
        each at its best draft length, at batch 1 (lookup drafts for free, so it wins at equal acceptance). The
        draft's catch-up on `lag` unseen tokens is charged as the planner charges it (spread over
        the iterations runs of drafting last): a long prompt the draft has not read makes lookup the better start."""
        lookup_a, draft_a = gen.acceptance(source), gen.acceptance(DRAFT_MODEL)
        if self.costs is None or lookup_a >= draft_a:
            return lookup_a >= draft_a
        if self._rates is None:  # ms of a lookup draft of k tokens and of a draft-model one, k = 0..draft_max
            verify = [self.costs.target_ms(1, k + 1) for k in range(self.draft_max + 1)]
            self._rates = (verify, [v + k * self.costs.draft_ms(1) for k, v in enumerate(verify)])
        lookup_ms, draft_ms = self._rates
        catch_up_ms = self.costs.catch_up_ms(max(0, lag - STEADY_CATCH_UP)) / self.costs.drafting_run
        return best_rate(lookup_a, lookup_ms, k_lookup) >= best_rate(draft_a, draft_ms, k_draft, catch_up_ms)


def best_rate(acceptance: float, ms: list[float], k_max: int, extra_ms: float = 0.0) -> float:
    """max over k = 1..k_max of E(acceptance, k) / (ms[k] + extra_ms): one sequence's best draft length's tokens
    per ms."""
    return max(expected_tokens(acceptance, k) / (ms[k] + extra_ms) for k in range(1, k_max + 1))
