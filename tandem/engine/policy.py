"""The draft policy: before each step, what each decoding sequence drafts (its source and draft length, 0 = a plain
step) and whether its draft first reads the text it missed; after it, what the step's time and outcomes teach the
costs. One object the engine owns, with a narrow interface (`plan`, `admit`, `retire`, `observe_*`); the batched
arithmetic is the planner's (tandem.engine.planner), the measured costs `BatchCosts`. Read with docs/batching.md
("Speculation under load").

The rules in order: a cheap floor test first (`_hopeful`: at a load where no acceptance pays, nothing else runs),
then a standing plain plan, then per sequence its candidate (`_candidate`: lookup or the draft model), the planner's
draft lengths, and the evidence rules (a first read, a re-read, exploration), planned again where a read ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.backends.base import BatchedCache
from tandem.config import POLICY
from tandem.engine import planner
from tandem.engine.costs import LOOKUP, BatchCosts
from tandem.engine.drafter import Drafter
from tandem.engine.generation import DRAFT_MODEL, Generation
from tandem.speculative.policy import AcceptancePrior, copied_risk, expected_tokens


@dataclass
class PlainPlan:
    """A plan of plain steps that stands (see DraftPolicy.plan)."""

    steps: int  # further steps it stands for
    members: set[int]  # the sequences it was made for, and those that joined without being hopeful






class DraftPolicy:
    """What each sequence drafts each step, from the measured costs and each sequence's acceptance estimates.

    Args:
        costs: the batched costs (None: every drafting request drafts its draft_max, as draft_policy "fixed").
        prior: the process-wide acceptance prior that new sequences start from and completed ones teach.
        drafter: the draft model's side (None: prompt lookup alone, or no drafting).
        target_kv: the target's cache (a sequence's room left).
        draft_max: the most drafts an iteration.
    """

    def __init__(self, costs: BatchCosts | None, prior: AcceptancePrior, drafter: Drafter | None,
                 target_kv: BatchedCache, draft_max: int) -> None:
        self.costs, self.prior, self.drafter, self.target_kv = costs, prior, drafter, target_kv
        self.draft_max = draft_max
        self.evidence: list[Generation] = []  # sequences whose draft read the text before drafting this step
        self.planned_acceptance: dict[int, float] = {}  # sequence id -> the acceptance its drafts were planned at
        self.drafting_run = 0  # steps in a row that drafted
        self.previous_rows: int | None = None  # rows of the target's last forward (a plan of others pays a switch)
        self.shape_run = 0  # forwards in a row of that shape
        self.plain_plan: PlainPlan | None = None
        self.planned = False  # whether the last plan ran in full
        # (batch, source drafted by or None) -> [steps, the planner's ms, measured ms] summed over the steady steps
        # (each to the next one's start): whether the planner's cost of a step is the step's
        self.step_times: dict[tuple[int, str | None], list] = {}
        self._after_change: tuple | None = None  # (batch, source, ms over its costs) of a shape's first forward
        self._ended: tuple | None = None  # the last step's observe_step arguments and end, until the next starts
        self._step_count = 0
        self._floors: dict[tuple, tuple[float, int]] = {}  # (costs, batch, lookup) -> (floor, valid until step)
        self._values: dict[tuple, tuple] = {}  # (answer, valid until step): savings by batch size, _drafts_at
        self._rates = None

    def set_costs(self, costs: BatchCosts | None) -> None:
        """Plan from these costs (again, after changing them by hand): the answers kept from the old go."""
        self.costs, self._floors, self._values = costs, {}, {}

    def begin_step(self, now: float) -> None:
        """A step starts at `now` (perf_counter s): the step before is observed, its time running to now where it
        left sequences running (the gap is the loop's, a server's streams, every step's cost) unless that is a pause
        (POLICY.step_gap_max_ms)."""
        if self._ended is not None:
            decoding, ks, prefills, target_rows, ms, drafted, ended, busy = self._ended
            self._ended = None
            gap_ms = 1000.0 * (now - ended)
            if busy and gap_ms <= POLICY.step_gap_max_ms:
                ms += gap_ms
            self.observe_step(decoding, ks, prefills, target_rows, ms, drafted)
        self._step_count += 1
        if len(self._values) > POLICY.values_kept:  # entries past their steps
            self._values = {k: v for k, v in self._values.items() if v[1] > self._step_count}

    def admit(self, gens: list[Generation], batch: int) -> None:
        """Sequences that joined a batch of `batch`: whether each one's draft takes in its prompt beside the
        target's prefill (_draft_may_pay)."""
        for gen in gens if self.drafter is not None else ():
            gen.draft_prefill = self._draft_may_pay(gen, batch)

    def retire(self, gen: Generation, batch: int) -> None:
        """A sequence left a batch now of `batch`: what it accepted teaches the shared prior."""
        if gen.proposer is None or gen.cancelled:
            return
        for source, estimate in gen.estimates.items():
            self.prior.record(source, estimate.request_accepted, estimate.request_reached)
        if gen.proposer == "mixed" and gen.emitted:
            self.prior.record_copied(gen.copied_tokens / gen.emitted)
        if gen.finish_reason == "stop":
            self.prior.record_reply(gen.emitted)  # a natural reply length: what a first catch-up is repaid over
        estimate = gen.estimates.get(DRAFT_MODEL)
        if estimate is not None and estimate.request_reached == 0 and self.costs is not None:
            # plain time the prior did not learn from (the batch with this sequence)
            self.prior.note_unread(DRAFT_MODEL, gen.emitted * self.costs.plain_share_ms(batch + 1))
        gen.stats.belief = {"acceptance": {s: gen.acceptance(s) for s in gen.estimates},
                            "prior_acceptance": {s: e.prior[0] / e.prior[1] for s, e in gen.estimates.items()},
                            "predicted_speedup": gen.predicted_speedup}

    def observe_yield(self, decoding: list[Generation], ks: list[int], outcomes: dict) -> None:
        """What the step's planned draft-model drafts yielded against what their plans expected."""
        expected = yielded = 0.0
        for gen, k in zip(decoding, ks, strict=True):
            if k and gen.id in self.planned_acceptance:
                expected += expected_tokens(self.planned_acceptance[gen.id], k) - 1.0
                yielded += outcomes[gen.id][0]
        if expected and self.costs is not None:
            self.costs.observe_yield(len(decoding), expected, yielded)

    def _draft_may_pay(self, gen: Generation, batch: int) -> bool:
        """Whether the draft takes in the prompt beside the target's prefill: where `batch` sequences drafting alike
        would likely gain (POLICY.prefill_max_risk) and the expected gain over the reply is worth
        POLICY.probe_value_margin times that prefill (the first read's test, `_first_read_pays`, over the Beta of the
        request's prior). A draft that took in nothing must catch up on the whole prompt at its first read, a cost that
        can keep it off for good where it would pay; a draft that cannot pay on this machine, at this load, or likely
        enough leaves it to that read."""
        if DRAFT_MODEL not in gen.estimates or gen.draft_max == 0:
            return False
        if gen.request.draft_policy == "fixed" or self.costs is None:  # no costs: every draft drafts its k_max
            return True
        if self._floor(batch, False) >= 1.0:  # no acceptance pays at this load: nothing to value
            return False
        _, p_no_gain = self._value_of_drafting(gen, batch)
        return p_no_gain <= POLICY.prefill_max_risk and self._first_read_pays(gen, batch)

    def _floor(self, batch: int, lookup: bool) -> float:
        """The least acceptance at which some of `batch` sequences drafting alike (nothing to catch up, up to
        draft_max tokens, by prompt lookup or by the draft model) beats plain steps by the costs; 1.0 where none does.
        Bisected to POLICY.floor_precision from below (a lower bound), kept POLICY.floor_steps steps (the costs learn
        slowly)."""
        key = (id(self.costs), batch, lookup)
        kept = self._floors.get(key)
        if kept is not None and kept[1] > self._step_count:
            return kept[0]

        low, _ = planner.paying_bracket(self.costs, self.draft_max, batch, lookup, POLICY.floor_precision,
                                        POLICY.floor_top)
        self._floors[key] = (low, self._step_count + POLICY.floor_steps)
        return low

    def _hopeful(self, decoding: list[Generation], batch: int | None = None) -> frozenset[int] | None:
        """The sequences whose plan could draft or read this step: the cheap test that lets a batch where nothing can
        pay skip the rules' per-sequence work, and lets a plain plan stand while no joining sequence is hopeful. A
        sequence could draft by the model where its estimate, or the estimate a read or an exploration would test,
        reaches the model's floor at this batch size; by lookup where its text repeats at an acceptance that reaches
        lookup's. None (always plan): fixed drafters, or no costs."""
        if self.costs is None or any(g.request.draft_policy == "fixed" for g in decoding):
            return None
        batch = len(decoding) if batch is None else batch
        model_floor = self._floor(batch, False) if self.drafter is not None and batch else 1.0
        lookup_floor = self._floor(batch, True) if batch else 1.0
        if model_floor >= 1.0 and lookup_floor >= 1.0:
            return frozenset()  # prompt lookup's hindsight catches up when planning resumes (it is incremental)
        explore = POLICY.acceptance_prior[0] / POLICY.acceptance_prior[1]
        hopeful = set()
        for gen in decoding:
            estimate = gen.estimates.get(DRAFT_MODEL)
            if model_floor < 1.0 and estimate is not None and not gen.draft_declined:
                accepted, drafted = estimate.counts(gen.plain_iterations)
                read = POLICY.evidence_tokens
                hoped = max(accepted / drafted, (accepted + read) / (drafted + read), explore)
                if hoped >= model_floor:
                    hopeful.add(gen.id)
                    continue
            if lookup_floor < 1.0 and gen.ngram is not None:
                source, _ = gen.ngram.match(gen.tokens)
                if source is not None and gen.acceptance(source) >= lookup_floor:
                    hopeful.add(gen.id)
        return frozenset(hopeful)

    def _drafts_at(self, acceptance: float, k_max: int, batch: int) -> bool:
        """Whether `batch` sequences at this acceptance, with nothing to catch up, draft by the costs (kept
        POLICY.floor_steps steps for a given question: every new request asks it at the shared prior's counts)."""
        key = ("drafts_at", id(self.costs), acceptance, k_max, batch)
        kept = self._values.get(key)
        if kept is None or kept[1] <= self._step_count:
            kept = self._values[key] = (self._pays(acceptance, k_max, batch), self._step_count + POLICY.floor_steps)
        return kept[0]

    def _pays(self, acceptance: float, k_max: int, batch: int, lookup: bool = False) -> bool:
        """Whether some of `batch` sequences at this acceptance, nothing to catch up, draft by the costs."""
        return planner.plan([planner.Candidate(acceptance, k_max, lookup=lookup)] * batch, self.costs)[0] > 0

    def _reading_may_pay(self, candidate: planner.Candidate, prior: tuple[float, float], batch: int) -> bool:
        """Whether reading could switch on a draft that the plan keeps off at its prior: would `batch` sequences
        draft (nothing to catch up) at the acceptance that POLICY.evidence_tokens matches in a row would give? Without
        this, a prior learned from requests that accepted little would keep every later request off unread, and so
        never learn otherwise."""
        read = POLICY.evidence_tokens
        return self._drafts_at((prior[0] + read) / (prior[1] + read), candidate.k_max, batch)

    def _wants_evidence(self, gen: Generation, candidate: planner.Candidate) -> bool:
        """Whether the draft should read the text it missed before drafting: never read (nor verified) yet in
        this request, or stale (more than POLICY.evidence_tokens plain iterations since) with more than a steady
        catch-up to read. A draft that took in the prompt waits for generated tokens to read as one that did not.
        Without costs every draft drafts its k_max, and its acceptance decides nothing."""
        if candidate.fixed or self.costs is None:
            return False
        estimate = gen.estimates[DRAFT_MODEL]
        if estimate.request_reached == 0:
            return True
        return candidate.lag > 0 and gen.plain_iterations - estimate.settled_at > POLICY.evidence_tokens

    def _first_read_pays(self, gen: Generation, batch: int) -> bool:
        """The first switch-on test at this batch size: the draft takes in the prompt only where
        the drafting this may buy over the rest of the reply (expected over the estimate's uncertainty, in a batch
        of `batch` sequences drafting alike: planner.value_of_drafting) is worth POLICY.probe_value_margin times that
        catch-up, which stalls the whole batch. A long prompt, a reply near its end, a draft barely ahead of plain
        decoding or a batch that drafting hardly speeds decline. Of the rest, the draft serves only what prompt
        lookup leaves (as it has so far): beside a lookup that copies most of the reply, reading a long prompt
        would buy a few tokens."""
        gain_ms, _ = self._value_of_drafting(gen, batch)
        tokens = min(self.prior.reply_tokens, gen.request.max_tokens - gen.emitted) * (1.0 - gen.lookup_share())
        return gain_ms * tokens >= POLICY.probe_value_margin * self.costs.read_ms(self.drafter.lag(gen))

    def _worth_waiting(self, gen: Generation) -> bool:
        """The rule for a first switch-on: wait for generated tokens to read unless the drafting
        gain given up meanwhile exceeds what drafting blind risks (the catch-up and a few wasted drafts, weighted
        by the chance that the acceptance, a Beta of the estimate's counts, turns out too low to pay). At one
        sequence's costs whatever the batch: a wait delays every sequence of a batch alike."""
        gain_ms, p_no_gain = self._value_of_drafting(gen, 1)
        if gen.ngram is not None:  # or the reply copies its prompt, which lookup's hindsight would show
            p_no_gain = copied_risk(p_no_gain, self.prior)
        read_ms = self.costs.read_ms(self.drafter.lag(gen))
        extra_row_ms = max(0.0, self.costs.target_ms(1, 2) - self.costs.target_ms(1, 1))
        learning_ms = POLICY.learning_iterations * (self.costs.draft_ms(1) + extra_row_ms)
        wait = POLICY.evidence_tokens - (len(gen.tokens) - gen.prompt_len)
        return wait * gain_ms < POLICY.probe_value_margin * p_no_gain * (read_ms + learning_ms)

    def _explores(self, gen: Generation, batch: int) -> bool:
        """Whether a request reads the draft although its prior says that will not pay: where the requests since the
        prior last learned anything of the draft decoded plain long enough that this read's catch-up is within
        POLICY.explore_budget of their time (AcceptancePrior.may_explore), and drafting would pay in this batch at the
        acceptance a fresh process expects (POLICY.acceptance_prior; a machine where even that cannot pay, a CPU's pair,
        has nothing to find). A prior learned low otherwise keeps every later request from reading, so that none
        records what the draft accepts now."""
        if self.costs is None or gen.draft_max == 0 or \
                not self.prior.may_explore(DRAFT_MODEL, self.costs.read_ms(self.drafter.lag(gen))):
            return False
        return self._drafts_at(POLICY.acceptance_prior[0] / POLICY.acceptance_prior[1], gen.draft_max, batch)

    def _reread_in_budget(self, gen: Generation, batch: int) -> bool:
        """The re-probe rule: a draft back after a plain stretch reads what it missed only where
        that catch-up, which stalls the batch, costs at most POLICY.probe_budget of this sequence's share of the plain
        time since it last ran. Its estimate fades back to a prior that may look worth drafting while its text is not,
        and reads every few steps that never switch it on would cost more than they find."""
        idle = gen.plain_iterations - gen.estimates[DRAFT_MODEL].settled_at
        budget = POLICY.probe_budget * idle * self.costs.plain_share_ms(batch)
        return self.costs.read_ms(self.drafter.lag(gen)) <= budget

    def _value_of_drafting(self, gen: Generation, batch: int) -> tuple[float, float]:
        """planner.value_of_drafting for this sequence, from the savings per acceptance kept POLICY.floor_steps steps
        per batch size (sixteen plans; each sequence's estimate weighs them afresh)."""
        key = ("savings", id(self.costs), gen.draft_max, batch)
        kept = self._values.get(key)
        if kept is None or kept[1] <= self._step_count:
            kept = self._values[key] = (planner.savings(self.costs, gen.draft_max, batch),
                                        self._step_count + POLICY.floor_steps)
        accepted, drafted = gen.estimates[DRAFT_MODEL].counts(gen.plain_iterations)
        return planner.value_of_drafting(accepted, drafted, gen.draft_max, batch, self.costs,
                                         self.prior.spread_strength(DRAFT_MODEL), kept[0])

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
        return planner.Candidate(acceptance, k_max, max(0, lag - POLICY.steady_catch_up), fixed=fixed)

    def _lookup_beats_draft(self, gen: Generation, source: str, k_lookup: int, k_draft: int, lag: int) -> bool:
        """Whether one sequence drafting by lookup yields at least the tokens per ms of drafting by the draft model,
        each at its best draft length, at batch 1 (lookup drafts for free, so it wins at equal acceptance). The
        draft's catch-up on `lag` unseen tokens is charged as the planner charges it (spread over
        the iterations runs of drafting last): a long prompt the draft has not read makes lookup the better start."""
        lookup_a, draft_a = gen.acceptance(source), gen.acceptance(DRAFT_MODEL)
        if self.costs is None or lookup_a >= draft_a:
            return lookup_a >= draft_a
        if self._rates is None:  # ms of a lookup draft of k tokens and of a draft-model one, k = 0..draft_max
            overhead = self.costs.step_overhead_ms(1)  # a step's, either source
            verify = [self.costs.target_ms(1, k + 1) + overhead for k in range(self.draft_max + 1)]
            self._rates = (verify, [v + k * self.costs.draft_ms(1) for k, v in enumerate(verify)])
        lookup_ms, draft_ms = self._rates
        catch_up_ms = self.costs.catch_up_ms(max(0, lag - POLICY.steady_catch_up)) / self.costs.drafting_run
        return best_rate(lookup_a, lookup_ms, k_lookup) >= best_rate(draft_a, draft_ms, k_draft, catch_up_ms)


    def plan(self, decoding: list[Generation], prefill_rows: int) -> list[int]:
        """Draft lengths for this step (each sequence's source in gen.draft_source). Where no sequence is hopeful
        (_hopeful) the step is plain at once. A plan of plain steps stands for POLICY.replan_plain steps while no
        sequence that joins the batch is hopeful; the others are tested again when it lapses (a text that starts
        repeating waits at most that long): planning, or even testing, every sequence every step cost a batch much of a
        plain step (docs/decisions/0001)."""
        self.evidence = []
        self.planned_acceptance = {}
        self.planned = False  # whether this step ran the full plan (not the floors' or a standing plan's shortcut)
        standing = self.plain_plan
        if standing is not None and standing.steps > 0:
            # Only sequences that joined since it was made are tested: the others' hopes were when it was made.
            joined = [g for g in decoding if g.id not in standing.members]
            if self._hopeful(joined, len(decoding)) == frozenset():
                standing.steps -= 1
                standing.members.update(g.id for g in joined)
                return self._plain(decoding)
        hopeful = self._hopeful(decoding)
        if hopeful is not None and not hopeful:
            self.plain_plan = PlainPlan(POLICY.replan_plain - 1, {g.id for g in decoding})
            return self._plain(decoding)
        self.planned = True
        self._rates = None  # one sequence's tokens per ms by each source, at batch 1 (see _lookup_beats_draft)
        candidates = [self._candidate(g) for g in decoding]
        rates: dict[str, float] = {}
        ks = planner.plan(candidates, self.costs, prefill_rows, self.previous_rows, self.drafting_run > 0, rates)
        # Before a draft drafts blind (first time in the request, or back after a plain stretch), it reads the text
        # it missed, teacher-forced: how much of it it would have predicted is its acceptance on this text, known
        # before a single draft is verified, and the plan is made again with it (a
        # draft that cannot pay then never drafts, instead of drafting at the prior first). It waits for
        # POLICY.evidence_tokens generated tokens to read, unless waiting costs more than drafting blind risks. Back
        # after a plain stretch, it reads where the plan would draft and the catch-up is within the probe budget; a
        # draft that has shown fewer positions than a read would (a few drafts verified, never read) also where the read
        # passes the first read's test (a plan at its faded estimate, and a budget that a dear catch-up never
        # meets, would keep a request plain after two unlucky drafts).
        for i, (gen, candidate) in enumerate(zip(decoding, candidates, strict=True)):
            if gen.draft_source != DRAFT_MODEL or not self._wants_evidence(gen, candidate):
                continue
            reached = gen.estimates[DRAFT_MODEL].request_reached
            first, unread = reached == 0, reached < POLICY.evidence_tokens  # unread: fewer positions than a read shows
            generated = len(gen.tokens) - gen.prompt_len
            considered = ks[i] or unread and self._reading_may_pay(candidate, gen.estimates[DRAFT_MODEL].prior,
                                                                    len(decoding))
            if first and not (considered and self._first_read_pays(gen, len(decoding))):
                ks[i] = 0
                if self._explores(gen, len(decoding)):  # the prior says no, but it has not learned for long
                    if generated >= POLICY.evidence_tokens:
                        self.prior.explored(DRAFT_MODEL)
                        self.evidence.append(gen)
                elif considered:
                    gen.draft_declined = True  # this request goes on with prompt lookup alone
            elif not considered:
                continue
            elif not first and not (ks[i] and self._reread_in_budget(gen, len(decoding)) or
                                    unread and self._first_read_pays(gen, len(decoding))):
                ks[i] = 0
            elif generated >= POLICY.evidence_tokens or not self._worth_waiting(gen):
                self.evidence.append(gen)
            else:
                ks[i] = 0
        if self.evidence:
            self.drafter.read_evidence(self.evidence)
            candidates = [self._candidate(g) for g in decoding]
            ks = planner.plan(candidates, self.costs, prefill_rows, self.previous_rows, self.drafting_run > 0,
                              rates)
        self.planned_acceptance = {g.id: c.acceptance for g, c, k in zip(decoding, candidates, ks, strict=True)
                                    if k and not c.fixed and not c.lookup}
        for gen in decoding:
            gen.note_prediction(rates["planned"] / rates["plain"] if rates else 1.0)
        self.plain_plan = PlainPlan(POLICY.replan_plain - 1, {g.id for g in decoding}) if not any(ks) else None
        return ks

    @staticmethod
    def _plain(decoding: list[Generation]) -> list[int]:
        for gen in decoding:
            gen.note_prediction(1.0)
        return [0] * len(decoding)

    def observe_shape(self, rows: int, drafted: bool) -> None:
        """Note the target's forward of `rows` rows, and whether the step drafted: how long shapes and runs of
        drafting last prices a change and a start (BatchCosts.shape_run, drafting_run)."""
        if drafted:
            self.drafting_run += 1
        elif self.drafting_run:
            if self.costs is not None:
                self.costs.observe_drafting_run(self.drafting_run)
            self.drafting_run = 0
        if rows != self.previous_rows:
            if self.costs is not None and self.previous_rows is not None:
                self.costs.observe_shape_run(self.shape_run)
            self.previous_rows, self.shape_run = rows, 0
        self.shape_run += 1

    def step_ended(self, decoding: list[Generation], ks: list[int], prefills: list, target_rows: int, ms: float,
                   drafted: tuple[int, int] | None, ended: float, busy: bool) -> None:
        """A step took `ms` and ended at `ended` (perf_counter s), leaving sequences running where `busy`: observed
        when the next begins (begin_step), with the gap before it."""
        self._ended = (decoding, ks, prefills, target_rows, ms, drafted, ended, busy)

    def observe_step(self, decoding: list[Generation], ks: list[int], prefills: list, target_rows: int, ms: float,
                     drafted: tuple[int, int] | None) -> None:
        """A whole step's time against what its costs predict (BatchCosts.drafting_overrun): its forwards' costs,
        and for the two forwards after a change of shape, the change (llama.cpp's CUDA build runs the first
        uncaptured and captures the second; elsewhere the first rebuilds the graph). Those two are observed as one,
        their mean excess less the change (each alone reads as overrun); a first that no second follows (a lone
        drafting step between plain ones, as prompt lookup's are) is observed alone, less the change. Not a step
        that took in prompts, read evidence or caught a draft up (no steady step's cost)."""
        first_of_shape, self._after_change = self._after_change, None
        if self.costs is None:
            return
        model_drafting = any(k and g.draft_source == DRAFT_MODEL for g, k in zip(decoding, ks, strict=True))
        key = (len(decoding), DRAFT_MODEL if model_drafting else LOOKUP if any(ks) else None)
        if first_of_shape is not None and (self.shape_run != 2 or prefills or self.evidence or
                                           first_of_shape[:2] != key):
            # Else a drafting step never followed by one of its shape went unobserved, and its host work was free
            # to the planner (docs/decisions/0001).
            self.costs.observe_iteration(first_of_shape[0], first_of_shape[1], 0.0,
                                         first_of_shape[2] - self.costs.switch_ms)
        if prefills or self.evidence:
            return
        if model_drafting and drafted is None:
            return
        draft_ms = (self.costs.draft_ms(drafted[0]) * drafted[1] +
                    self.costs.feed_ahead_ms(drafted[0])) if model_drafting else 0.0
        predicted = draft_ms + self.costs.target_ms(len(decoding), target_rows)
        planned = predicted + self.costs.step_overhead_ms(key[0]) + \
            (self.costs.drafting_overrun(key[0], key[1] == LOOKUP) if key[1] else 0.0)  # the planner's price
        seen = self.step_times.setdefault(key, [0, 0.0, 0.0])
        seen[0], seen[1], seen[2] = seen[0] + 1, seen[1] + planned, seen[2] + ms
        if self.planned and not any(ks):
            # Planned in full and plain all the same: its plan's time is neither a plain step's (which a standing
            # plan skips) nor drafting's; counted as plain, it hid what drafting costs (docs/decisions/0001).
            return
        if self.shape_run == 1:
            self._after_change = (*key, ms - predicted)
            return
        if self.shape_run == 2:
            if first_of_shape is None or first_of_shape[:2] != key:
                return
            ms = predicted + (first_of_shape[2] + ms - predicted - self.costs.switch_ms) / 2
        self.costs.observe_iteration(*key, predicted, ms)


def best_rate(acceptance: float, ms: list[float], k_max: int, extra_ms: float = 0.0) -> float:
    """max over k = 1..k_max of E(acceptance, k) / (ms[k] + extra_ms): one sequence's best draft length's tokens
    per ms."""
    return max(expected_tokens(acceptance, k) / (ms[k] + extra_ms) for k in range(1, k_max + 1))
