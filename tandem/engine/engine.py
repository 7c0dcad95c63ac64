"""The batched engine: every running request advances in one step, one target forward for all of them (its stages:
Engine.step; one host synchronisation a step reads every sequence's result). Plain decoding is the same step with
k = 0. Requests never see each other: each has its own slot, positions, sampling generator and acceptance estimate,
so a request's output is the one it gets alone (exactly, greedy, where the forward is batch-invariant:
docs/batching.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch

from tandem.backends.base import Alongside, BatchedCache, Model
from tandem.config import EngineConfig
from tandem.engine import calibration
from tandem.engine.batch import Batch
from tandem.engine.cost_store import costs_path, kept_costs
from tandem.engine.costs import BatchCosts
from tandem.engine.drafter import Drafter, Proposal
from tandem.engine.generation import (
    Generation,
    GenerationChunk,
    GenerationResult,
    Request,
    StepTimes,
    TokenLogprob,
    check_prompt,
)
from tandem.engine.kv_pool import KVSlots, fit_slots
from tandem.engine.outcomes import read_outcomes, reads_argmax_only
from tandem.engine.policy import DraftPolicy
from tandem.engine.proposers import Proposers
from tandem.engine.run_ahead import LOOKUP_RUN_AHEAD, RUN_AHEAD, DeviceSpan, RunAhead
from tandem.engine.scoring import token_logprobs
from tandem.logits.processor import processor_for
from tandem.sampling import make_generator
from tandem.speculative.policy import shared_prior

log = logging.getLogger("tandem.engine")


class Engine:
    """Continuous batching with speculation per sequence. `add` requests, call `step` until `busy` is False, or
    call `generate` for a list of prompts.

    Args:
        target: the model whose output this is.
        draft: None, a Model of the same tokenizer, or "ngram" (prompt lookup).
        config: slots, draft_max, prompt_lookup, n_ctx, kv_budget_bytes, run_ahead ... (tandem.config.EngineConfig);
            `settings` given by name replace its fields (Engine(target, draft, slots=2)). A KV budget that holds
            no whole context is an error.
        synthetic_acceptance: benchmarks: drafts pass with this probability, whatever they are.
        measure_costs: time the batched forwards now, for the adaptive planner (else every drafting request
            drafts draft_max, as draft_policy "fixed").
    """

    def __init__(self, target: Model, draft: Model | str | None = None, config: EngineConfig | None = None, *,
                 synthetic_acceptance: float | None = None, measure_costs: bool = True, **settings) -> None:
        config = replace(config or EngineConfig(), **settings)
        n_ctx = config.n_ctx or target.n_ctx
        self.target = target
        self.proposers = Proposers(target, draft, synthetic_acceptance)
        models = [target] + self.proposers.kv_models
        slots = fit_slots(models, config.slots, n_ctx, config.kv_budget_bytes, config.kv_memory_fraction)
        target_kv = target.new_batched_cache(slots, n_ctx)
        run_ahead = 1 if not target_kv.steps_on_device else config.run_ahead or \
            (RUN_AHEAD if self.device.type == "cuda" else 1)
        self.config = replace(config, slots=slots, n_ctx=n_ctx, run_ahead=run_ahead)
        self.proposers.open(target, target_kv, slots, n_ctx, self.device)
        self.kv = KVSlots(target_kv, self.drafter, slots)
        self.batch = Batch()
        self._queued_steps = RunAhead(self.device, run_ahead) if run_ahead > 1 else None
        self.stop_token_ids = frozenset(target.tokenizer.eos_token_ids)
        prior = shared_prior(target, "head" if self.proposers.head else "shared")
        self.policy = DraftPolicy(None, prior, self.drafter, target_kv, config.draft_max)
        self.step_hook: Callable[[StepTimes], None] | None = None  # told of each step through the target's forward
        if self.proposers.kind and config.draft_max > 0 and measure_costs:
            self.calibrate()

    @property
    def slots(self) -> int:
        return self.config.slots

    @property
    def draft_max(self) -> int:
        return self.config.draft_max

    @property
    def n_ctx(self) -> int:
        return self.config.n_ctx

    @property
    def target_kv(self) -> BatchedCache:
        return self.kv.target

    @property
    def drafter(self) -> Drafter | None:
        return self.proposers.drafter

    @property
    def draft_model(self) -> Model | None:
        return self.proposers.draft_model

    @property
    def draft_kv(self) -> BatchedCache | None:
        return self.drafter.kv if self.drafter is not None else None

    @property
    def device(self) -> torch.device:
        return torch.device(getattr(self.target, "torch_device", "cpu"))

    @property
    def costs(self) -> BatchCosts | None:
        """The measured costs the policy plans from (None: drafting requests draft their draft_max)."""
        return self.policy.costs

    @costs.setter
    def costs(self, costs: BatchCosts | None) -> None:
        self.policy.set_costs(costs)

    @property
    def prior(self):
        """What completed requests accepted, per source, shared by every engine on this target."""
        return self.policy.prior

    @prior.setter
    def prior(self, prior) -> None:
        self.policy.prior = prior

    def calibrate(self, refresh: bool = False) -> None:
        """The planner's costs: as kept on disk for this device, pair and engine shape (cost_store.costs_path), else
        measured on these caches (empty: their slots are scratch here) and kept. refresh: measure afresh."""
        def measure() -> BatchCosts:
            return calibration.measure(self.target_kv, self.draft_kv, self.draft_max, self._synchronize)

        self.plan_from(kept_costs(self.costs_path(), measure, BatchCosts.measured, BatchCosts.from_measured,
                                  self.target, self.draft_model, refresh))

    def costs_path(self) -> str | None:
        """Where this engine's costs are kept: per device, pair and engine shape."""
        return costs_path(self.target, self.draft_model, self.draft_max, self.slots, self.n_ctx)

    def plan_from(self, costs: BatchCosts) -> None:
        """The policy plans from these costs, padded to the target's row shapes (a steady draft's where it keeps its
        shapes)."""
        costs.steady_draft = self.drafter is not None and self.draft_model.steady_shapes
        self.costs = costs.pad_rows(self.target_kv.padded_rows)

    def _synchronize(self) -> None:
        for model in (self.target, self.draft_model):
            if model is not None:
                model.synchronize()

    # --- the caller's side -----------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.batch.busy

    def kv_usage(self) -> float:
        """The fraction of KV memory running sequences hold: slots are reserved whole (a context each), so this is
        the fraction of slots in use, what admission waits on."""
        return len(self.batch.running) / self.slots

    def add(self, request: Request) -> Generation:
        """Queue a request; it joins the running batch at the next step with a free slot."""
        vocab = self.target.vocab_size
        check_prompt(request.prompt, vocab, self.n_ctx)
        proposer, sources = self.proposers.sources(request, self.config.prompt_lookup)
        gen = Generation(request, self.target.tokenizer, self.device, self.draft_max, self.stop_token_ids,
                         proposer, {source: self.prior.counts(source) for source in sources})
        gen.stats.prompt_tokens = len(request.prompt)
        gen.stats.draft_kind = "head" if self.proposers.head else "model"
        gen.processor = processor_for(request.logits, self.target.tokenizer, vocab, request.prompt, self.device)
        if self.proposers.synthetic is not None and gen.generator is None:  # greedy, but acceptance is drawn
            gen.generator = make_generator(request.sampling.seed, self.device)
        self.batch.queue(gen)
        return gen

    def cancel(self, gen: Generation) -> None:
        """Stop a generation: a waiting one leaves the queue now, a running one frees its slot at the next step."""
        self.batch.cancel(gen)

    def generate(self, requests: Iterable[Request]) -> list[GenerationResult]:
        """Run requests batched to the end; results in the order given."""
        gens = [self.add(r) for r in requests]
        pieces: dict[int, list[str]] = {g.id: [] for g in gens}
        tokens: dict[int, list[int]] = {g.id: [] for g in gens}
        logprobs: dict[int, list[TokenLogprob]] = {g.id: [] for g in gens}
        while any(g.finish_reason is None for g in gens):
            for gen, chunk in self.step():
                if gen.id in pieces:
                    pieces[gen.id].append(chunk.text)
                    tokens[gen.id].extend(chunk.tokens)
                    logprobs[gen.id].extend(chunk.logprobs or [])
        return [GenerationResult("".join(pieces[g.id]), tokens[g.id], g.finish_reason, g.stats,
                                 logprobs[g.id] if g.request.logprobs is not None else None) for g in gens]

    # --- one step ----------------------------------------------------------------------------------------------

    def step(self) -> list[tuple[Generation, GenerationChunk]]:
        """Advance every running sequence by one iteration; returns the chunks produced, in no set order.

        The stages: admit waiting requests into free slots; take this step's prompt chunks; the policy plans each
        decoding sequence's draft length; propose drafts; one target forward over every sequence's pending token,
        drafts and prompt chunks; verify each sequence on its own rows (one host synchronisation); accept, rewinding
        each slot past what its verifier rejected, and hand out the new tokens; the policy observes the step."""
        admitting = time.perf_counter()
        self.policy.begin_step(admitting)
        self._admit()
        if not self.batch.running:
            return []
        times = StepTimes(time.perf_counter(), admitting)
        decoding = self.batch.decoding()
        prefills = self._prompt_chunks(bool(decoding))
        ks = self.policy.plan(decoding, sum(len(rows) for _, rows in prefills))
        if self._runs_ahead(decoding, ks):
            return self._plain_run(decoding[0], times.started)
        times.planned = time.perf_counter()  # planning is no draft step's cost
        # A lone sequence's verify takes its drafts from the device: the host queues it while they are drawn.
        from_device = len(decoding) == 1 and not prefills and self.target_kv.steps_on_device
        span = DeviceSpan() if from_device and self.device.type == "cuda" else None
        proposals, drafted = self.proposers.propose(decoding, ks, from_device, timed=not self.policy.evidence)
        if span is not None:
            span.stop()
        times.drafted = time.perf_counter()
        ahead = self.proposers.ahead(decoding, proposals, drafted, self.costs)
        logits, target_rows = self._forward(decoding, prefills, proposals, from_device, ahead)
        times.forwarded, times.rows, times.prompts = time.perf_counter(), target_rows, bool(prefills)
        times.sequences = len(decoding) + len(prefills)
        self.policy.observe_shape(target_rows, any(ks))
        firsts = [(gen, rows) for (gen, chunk), rows in zip(prefills, logits[len(decoding) :], strict=True)
                  if gen.fed + len(chunk) == gen.prompt_len]
        outcomes, scored = read_outcomes(list(zip(decoding, logits, strict=False)), firsts, proposals, self.device,
                                         self.proposers.synthetic)
        times.finished = time.perf_counter()
        if span is not None:  # the host did not wait for the drafts: the device timed them
            times.drafted = min(times.finished, times.planned + span.ms() / 1000.0)
        if self.costs is not None and drafted is not None:
            self.costs.observe_draft(*drafted, times.draft_step_ms)
        prefill_ms = self._draft_prefill(prefills, times)
        events = self._accept(decoding, proposals, outcomes, scored, times)
        events += self._accept_prompts(prefills, outcomes, scored, prefill_ms)
        self.policy.observe_yield(decoding, ks, outcomes)
        times.ended = time.perf_counter()
        self.policy.step_ended(decoding, ks, prefills, target_rows, 1000.0 * (times.ended - times.started), drafted,
                               times.ended, bool(self.batch.running))
        if self.step_hook is not None:
            self.step_hook(times)
        return events

    def _prompt_chunks(self, decoding: bool) -> list[tuple[Generation, list[int]]]:
        """This step's prompt rows, config.prefill_chunk in all. The chunk bounds what prompts add to a step only to
        keep decoding streams flowing; with none decoding (a burst of arrivals) the prompts take
        config.idle_prefill_chunks chunks at once, so the last of the burst does not wait a step for each before it."""
        budget = self.config.prefill_chunk * (1 if decoding else self.config.idle_prefill_chunks)
        return self.batch.prompt_chunks(budget, self.target_kv.prefill_align)

    def _runs_ahead(self, decoding: list[Generation], ks: list[int]) -> bool:
        """A lone plain sequence, nothing waiting, whose steps read no logits: its plain steps queue ahead."""
        return self._queued_steps is not None and len(decoding) == len(self.batch.running) == 1 and \
            not self.batch.waiting and not any(ks) and decoding[0].processor is None and \
            decoding[0].request.logprobs is None

    def _draft_prefill(self, prefills: list, times: StepTimes) -> float:
        """The draft's share of the prompt chunks, after the timings (it is no draft step's or verify's cost); returns
        the prompt chunks' time, this share with it."""
        chunks = [(gen, gen.fed + len(rows)) for gen, rows in prefills if gen.draft_prefill] \
            if self.drafter is not None else []
        if chunks:
            self.drafter.prefill(chunks)
        times.prefilled, times.draft_prefills = time.perf_counter() if chunks else times.finished, len(chunks)
        return times.step_ms + 1000.0 * (times.prefilled - times.finished)

    def _forward(self, decoding: list[Generation], prefills: list, proposals: dict[int, Proposal],
                 from_device: bool, ahead: Alongside | None) -> tuple[list[torch.Tensor], int]:
        """The target's forward over every decoding sequence's pending token and drafts, and the prompt chunks: each
        entry's rows (or their argmax, where that is all its verify reads), and the rows run."""
        drafts = proposals[decoding[0].id][0] if from_device else None
        if isinstance(drafts, torch.Tensor):  # a lone sequence's drafts, still on the device
            gen = decoding[0]
            rows = torch.cat([torch.tensor(gen.tokens[-1:]).to(self.device, non_blocking=True), drafts])
            return [self.target_kv.step_on_device(gen.slot, rows, last_only=False)], len(rows)
        batch = [(g.slot, [g.tokens[-1]] + proposals[g.id][0]) for g in decoding]
        batch += [(g.slot, rows) for g, rows in prefills]
        # Prompt chunks want no logits but the last row of a prompt's last chunk. A greedy sequence's verify reads
        # only each row's argmax, which the backend may take where the logits are (forward_picking).
        last_only = [False] * len(decoding) + [True] * len(prefills)
        picks = [reads_argmax_only(g) for g in decoding + [g for g, _ in prefills]]
        logits = self.target_kv.forward_picking(batch, last_only, picks, ahead)
        return logits, sum(len(rows) for _, rows in batch)

    def _accept(self, decoding: list[Generation], proposals: dict[int, Proposal], outcomes: dict, scored: dict,
                times: StepTimes) -> list[tuple[Generation, GenerationChunk]]:
        """Each decoding sequence keeps its accepted drafts and the verifier's token: its slot rewound past the rest,
        its draft's settled, its stats and estimates told, its new tokens handed out."""
        events: list[tuple[Generation, GenerationChunk]] = []
        for gen in decoding:
            k = len(proposals[gen.id][0])
            source = gen.draft_source if k else None
            n, new_tokens = outcomes[gen.id]
            self.kv.extend(gen, new_tokens)
            if gen.processor is not None:
                gen.processor.accept(new_tokens)
            gen.stats.record_iteration(k, n, source)
            gen.stats.draft_ms += times.draft_ms if k else 0.0
            gen.stats.verify_ms += times.verify_ms
            gen.stats.decode_ms += times.step_ms
            if gen.proposer is not None:
                gen.observe(source, k, n)
            self._deliver(gen, new_tokens, events, scored.get(gen.id))
        return events

    def _accept_prompts(self, prefills: list, outcomes: dict, scored: dict, prefill_ms: float
                        ) -> list[tuple[Generation, GenerationChunk]]:
        """Prompt chunks taken in; a prompt read to its end gets its first token."""
        events: list[tuple[Generation, GenerationChunk]] = []
        for gen, rows in prefills:
            gen.fed += len(rows)
            gen.stats.prefill_ms += prefill_ms
            if not gen.prefilling:
                gen.tokens += outcomes[gen.id][1]
                if gen.processor is not None:
                    gen.processor.accept(outcomes[gen.id][1])
                if gen.ngram is not None:
                    gen.ngram.start(gen.request.prompt)
                self._deliver(gen, gen.tokens[-1:], events, scored.get(gen.id))
        return events

    def _plain_run(self, gen: Generation, started: float) -> list[tuple[Generation, GenerationChunk]]:
        """A lone sequence's plain steps, queued ahead of the host (RunAhead): as many as its plain plan stands for
        (fewer where prompt lookup watches its text), its max_tokens and its context allow, each one an iteration
        of its own to the stats, the costs and the plan."""
        plain_plan = self.policy.plain_plan
        standing = plain_plan.steps + 1 if plain_plan is not None else 1
        run_ahead = LOOKUP_RUN_AHEAD if gen.ngram is not None else self.config.run_ahead
        steps = min(self.config.run_ahead, run_ahead, standing, gen.request.max_tokens - gen.emitted,
                    self.kv.room(gen))
        new_tokens, forwards = self._queued_steps.run(self.target_kv, gen, steps)
        self.kv.extend(gen, new_tokens)
        step_ms = 1000.0 * (time.perf_counter() - started) / forwards
        for _ in new_tokens:
            gen.stats.record_iteration(0, 0)
            gen.stats.verify_ms += step_ms
            gen.stats.decode_ms += step_ms
            if gen.proposer is not None:
                gen.observe(None, 0, 0)
            gen.note_prediction(1.0)
            self.policy.observe_shape(1, False)
        if plain_plan is not None:
            plain_plan.steps = max(0, plain_plan.steps - len(new_tokens) + 1)
        if self.costs is not None:  # a plain step's cost as the loop runs it: cheaper queued than timed alone
            self.costs.observe_iteration(1, None, self.costs.target_ms(1, 1), step_ms)
        events = []
        self._deliver(gen, new_tokens, events, None)
        return events

    def _deliver(self, gen: Generation, new_tokens: list[int], events: list, scored: list | None) -> None:
        """Hand the caller this iteration's tokens (cut at a stop token or max_tokens), with their logprobs."""
        tokens = gen.emit(new_tokens)
        if gen.finish_reason is None and gen.processor is not None and gen.processor.finished:
            gen.finish_reason = "stop"  # the grammar is complete: only a stop token could follow
        if gen.finish_reason is None and self.kv.room(gen) <= 0:
            gen.finish_reason = "length"  # no room left for the pending token
        logprobs = token_logprobs(new_tokens, scored)[: len(tokens)] if scored is not None else None
        chunk = gen.chunk(tokens, logprobs)
        if chunk is not None:
            events.append((gen, chunk))
        if gen.finish_reason is not None:
            self._retire(gen)

    # --- admission -------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Cancelled sequences leave; waiting requests take the free slots (KVSlots.place)."""
        for gen in self.batch.cancelled():
            self._retire(gen)
        admitted = self.batch.admit(self.kv)
        self.policy.admit(admitted, len(self.batch.running))

    def _retire(self, gen: Generation) -> None:
        """The sequence leaves the batch; its slot keeps the KV of its tokens for a later prompt to reuse."""
        self.batch.leave(gen)
        self.policy.retire(gen, len(self.batch.running))
        self.kv.release(gen)
