"""The decode loop: prefill, then draft k -> verify k+1 in one target forward -> keep n+1 -> roll back the rest.

Plain decoding is the same loop with k = 0, so speculative and plain output come from one code path.
Invariant between iterations: the target's cache holds every token but the last (the *pending* token, which the
next forward feeds first), and the proposer has been told how many tokens are final.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import torch

from tandem.backends.base import ContextOverflowError, Model
from tandem.sampling import SamplingParams, make_generator, next_token, probs_from_logits
from tandem.speculative.policy import STEADY_CATCH_UP, DraftPolicy, FixedPolicy, Plan
from tandem.speculative.proposer import Proposer
from tandem.speculative.stats import GenerationStats
from tandem.speculative.verify import verify_greedy, verify_sampled, verify_synthetic
from tandem.timing import PhaseClock

RUN_AHEAD = 8  # plain steps an iteration of the loop runs (see _plain_steps)
QUEUE_DEPTH = 3  # plain steps queued ahead of the one whose token the host waits for
LOOKUP_RUN_AHEAD = 4  # plain steps queued when the policy would draft but the proposer has nothing (see run)


def cut_tokens(new_tokens: list[int], stop_token_ids: frozenset[int], emitted: int,
               max_tokens: int) -> tuple[list[int], str | None]:
    """New tokens cut at a stop token (not returned) or at max_tokens, and why they were cut ("stop", "length",
    or None when they were not)."""
    out = []
    for token in new_tokens:
        if token in stop_token_ids:
            return out, "stop"
        out.append(token)
        if emitted + len(out) >= max_tokens:
            return out, "length"
    return out, None


class SpeculativeDecoder:
    """One generation. Iterate `run(prompt)` for lists of new tokens; then read `finish_reason` and `stats`."""

    def __init__(
        self,
        target: Model,
        sampling: SamplingParams,
        proposer: Proposer | None = None,
        policy: DraftPolicy | None = None,
        max_tokens: int = 256,
        stop_token_ids: Seq[int] = (),
        n_ctx: int | None = None,
        synthetic_acceptance: float | None = None,
        run_ahead: int | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.target = target
        self.sampling = sampling
        self.proposer = proposer
        self.policy = policy or FixedPolicy(0)
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.n_ctx = n_ctx
        # Benchmarks of random-weight models only: accept each draft position with this probability (not lossless).
        self.synthetic_acceptance = synthetic_acceptance
        self.device = torch.device(getattr(target, "torch_device", "cpu"))
        # Plain steps queued per host sync (see _plain_steps); by default only where the device runs asynchronously
        # of the host: elsewhere the steps computed past a stop token would cost their full time.
        self.run_ahead = run_ahead if run_ahead is not None else RUN_AHEAD if self.device.type == "cuda" else 1
        if self.run_ahead < 1:
            raise ValueError(f"run_ahead must be >= 1, got {run_ahead}")
        # Where plain steps' tokens land on the host (see _plain_steps): made once, not a pinned tensor and an event
        # a step. Reusing a slot is safe: its next copy is queued on the same stream, after the last one was read.
        if self.device.type == "cuda":
            self._landing = torch.empty(self.run_ahead, dtype=torch.long, pin_memory=True)
            self._landed_events = [torch.cuda.Event() for _ in range(self.run_ahead)]
        self.finish_reason: str | None = None
        self._drafted_by: str | None = None  # the source of the last iteration's drafts, if it drafted
        self.stats = GenerationStats(
            proposer=proposer.name if proposer else "none", policy=self.policy.name if proposer else "none"
        )

    def _verify(self, draft_tokens: torch.Tensor, draft_probs, logits: torch.Tensor, generator):
        if self.synthetic_acceptance is not None:
            return verify_synthetic(draft_tokens, logits, self.synthetic_acceptance, generator)
        if self.sampling.greedy:
            return verify_greedy(draft_tokens, logits)
        return verify_sampled(draft_tokens, draft_probs, probs_from_logits(logits, self.sampling), generator)

    def _emit(self, new_tokens: list[int], emitted: int) -> list[int]:
        out, finish = cut_tokens(new_tokens, self.stop_token_ids, emitted, self.max_tokens)
        self.finish_reason = finish or self.finish_reason
        return out

    def _plan(self, tokens: list[int], emitted: int) -> tuple[Plan, float]:
        """The policy's plan for the next iteration, and the ms spent catching a source up first.

        A source that must take in more than a steady draft's 1-2 tokens (the prompt, at its first use; everything
        decoded while it was off) does so before the plan is final: the catch-up shows, teacher-forced, how much of
        the text since it would have predicted, and the policy re-plans on that evidence, so that a draft that turns
        out poor costs its catch-up but no verified draft."""
        proposer, remaining = self.proposer, self.max_tokens - emitted
        lags = proposer.lags(tokens)
        # Free evidence on the tokens of the last iteration (prompt lookup in hindsight), but from a source that
        # drafted them, whose outcome the policy has already seen. None under synthetic acceptance, which is judged
        # by its outcomes alone, as in the engine (its policy takes no catch-up evidence either: make_policy).
        synthetic = self.synthetic_acceptance is not None
        for source, matched in proposer.hindsight().items():  # read every iteration: it is gathered since the last
            if not synthetic and source != self._drafted_by:
                self.policy.observe_evidence(source, matched)
        plan = self.policy.plan(lags, remaining, emitted)
        if plan.k == 0 or not self.policy.wants_evidence or (lags.get(plan.source) or 0) <= STEADY_CATCH_UP:
            return plan, 0.0
        started = time.perf_counter()
        caught = proposer.catch_up(tokens, plan.source)
        if caught is None:
            return plan, 0.0
        catch_up_ms = 1000.0 * (time.perf_counter() - started)  # synchronous: the evidence was read back
        self.policy.observe_catch_up(plan.source, caught.tokens, catch_up_ms, caught.matched)
        self.stats.record_catch_up(plan.source, catch_up_ms, caught.matches, caught.positions)
        return self.policy.plan(proposer.lags(tokens), remaining, emitted), catch_up_ms

    def _speculate(self, target_seq, pending: torch.Tensor, tokens: list[int], k: int, generator, clock,
                   source: str | None = None):
        """One iteration: draft k tokens, verify them and the pending token in one target forward, keep n + 1."""
        catch_up, forwards = 0, None
        clock.mark()
        if k > 0:
            proposal = self.proposer.propose(tokens, k, source)
            draft_tokens, draft_probs, catch_up = proposal.tokens, proposal.probs, proposal.catch_up
            forwards = proposal.forwards
        else:
            draft_tokens, draft_probs = torch.empty(0, dtype=torch.long, device=self.device), None
        k = draft_tokens.shape[0]
        clock.mark()
        base = target_seq.length
        verify_input = torch.cat([pending, draft_tokens]) if k else pending
        logits = target_seq.forward(verify_input, logits="all")  # [k+1, V]
        n_accepted, recovered = self._verify(draft_tokens, draft_probs, logits, generator)
        clock.mark()
        # The one host sync of the iteration: how many were accepted, and which tokens they are.
        result = torch.cat([n_accepted.view(1), draft_tokens, recovered.view(1)]).tolist()
        n = result[0]
        target_seq.rewind(base + 1 + n)
        draft_ms, verify_ms = clock.spans_ms()
        return result[1 : 1 + n] + result[-1:], recovered.view(1), [(k, n, draft_ms, verify_ms, catch_up, forwards)]

    def _plain_steps(self, target_seq, pending: torch.Tensor, steps: int, generator, clock):
        """Up to `steps` plain decode steps, each token read back while the steps after it run.

        Each step's input is the previous step's output, already on the device, so the host queues a step before
        the one before it has run: the GPU never waits for Python between steps (on an H200 the host side of a step,
        ~0.2 ms, is a tenth of the step). Each token is copied back as it lands, QUEUE_DEPTH steps behind the
        queue, so a stop token ends the run with at most QUEUE_DEPTH - 1 steps computed past it and dropped (the
        run read back whole computed 3.5 on average: 5% of a 100-token answer's decode).
        """
        clock.mark()
        landed = []  # (host copy, event) a step

        def queue(pending: torch.Tensor) -> torch.Tensor:
            pending = next_token(target_seq.forward(pending, logits="last"), self.sampling, generator)
            if pending.is_cuda:  # into pinned memory, or the copy would wait for the queue to drain
                slot = len(landed)
                host, event = self._landing[slot : slot + 1], self._landed_events[slot]
                host.copy_(pending.view(1), non_blocking=True)
                event.record()
                landed.append((host, event))
            else:
                landed.append((pending, None))
            return pending

        for _ in range(min(steps, QUEUE_DEPTH)):
            pending = queue(pending)
        new_tokens = []
        while len(new_tokens) < len(landed):
            host, event = landed[len(new_tokens)]
            if event is not None:
                event.synchronize()
            new_tokens.append(int(host))
            if new_tokens[-1] in self.stop_token_ids:
                break
            if len(landed) < steps:
                pending = queue(pending)
        clock.mark()
        (verify_ms,) = clock.spans_ms()
        return new_tokens, pending, [(0, 0, 0.0, verify_ms / len(landed), 0, None)] * len(landed)

    def run(self, prompt: Seq[int]) -> Iterator[list[int]]:
        prompt = list(prompt)
        stats, proposer = self.stats, self.proposer
        target_seq = self.target.new_sequence(self.n_ctx)
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(prompt) >= target_seq.capacity:
            target_seq.close()
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens but the context holds {target_seq.capacity}, with room for at "
                f"least one generated token: {len(prompt) - target_seq.capacity + 1} tokens too many"
            )
        random = not self.sampling.greedy or self.synthetic_acceptance is not None
        generator = make_generator(self.sampling.seed, self.device) if random else None
        clock = PhaseClock(self.device)
        stats.prompt_tokens = len(prompt)
        try:
            clock.mark()
            first = next_token(target_seq.forward(prompt, logits="last"), self.sampling, generator)
            if proposer is not None:
                proposer.start(prompt)
            clock.mark()
            pending = first.view(1)  # [1] on the device: the next forward's first token, never re-uploaded
            tokens = prompt + [int(first.item())]
            stats.prefill_ms = clock.spans_ms()[0]
            out = self._emit(tokens[-1:], 0)
            emitted = len(out)
            stats.generated_tokens = emitted
            yield out
            while self.finish_reason is None:
                # Wall time of the iteration itself; time the caller spends between our yields is not ours.
                iteration_started = time.perf_counter()
                room = target_seq.capacity - target_seq.length
                if room < 1:
                    self.finish_reason = "length"
                    break
                plan, catch_up_ms = self._plan(tokens, emitted) if proposer is not None else (Plan(None, 0), 0.0)
                k = max(0, min(plan.k, self.max_tokens - emitted - 1, room - 1))
                run_ahead = self.run_ahead
                lookup_miss = plan.miss and plan.k == 0
                if lookup_miss:
                    # Nothing to propose (prompt lookup found no match): verifying the pending token alone would be
                    # a plain step paying a host sync of its own, 0.2 ms of a 1.6 ms step on an H200, where prompt
                    # lookup lost 5-7% on prompts that copy nothing. A few queued plain steps instead: few, so that
                    # a copy that starts meanwhile is found soon.
                    k, run_ahead = 0, min(run_ahead, LOOKUP_RUN_AHEAD)
                if k == 0 and run_ahead > 1:
                    steps = min(run_ahead, self.max_tokens - emitted, room)
                    new_tokens, pending, iterations = self._plain_steps(target_seq, pending, steps, generator, clock)
                else:
                    new_tokens, pending, iterations = self._speculate(target_seq, pending, tokens, k, generator, clock,
                                                                      plan.source)
                # Host sync to host sync: what the iteration really cost. The policy is charged that, not only the
                # device's spans: while the host proposes, launches and reads back, a GPU idles, except under plain
                # steps queued RUN_AHEAD to a sync (H200: ~0.2 ms of a 1.85 ms step, which made prompt lookup's
                # 2-token verifies look nearly free and kept it probing at 0.85x).
                # A catch-up ahead of the plan is charged on its own (observe_catch_up), not to this iteration.
                cycle_ms = (1000.0 * (time.perf_counter() - iteration_started) - catch_up_ms) / len(iterations)
                stats.draft_ms += catch_up_ms
                for k, n, draft_ms, verify_ms, catch_up, forwards in iterations:
                    stats.draft_ms += draft_ms
                    stats.verify_ms += verify_ms
                    stats.record_iteration(k, n, plan.source if k else None)
                    self.policy.observe(k, n, draft_ms, max(verify_ms, cycle_ms - draft_ms), catch_up,
                                        chosen=not lookup_miss, source=plan.source if k else None, forwards=forwards)
                if proposer is not None:
                    proposer.accept(len(tokens) + len(new_tokens) - 1)  # all but the pending token are final
                    self._drafted_by = plan.source if k else None
                tokens += new_tokens
                out = self._emit(new_tokens, emitted)
                emitted += len(out)
                stats.generated_tokens = emitted
                stats.decode_ms += 1000.0 * (time.perf_counter() - iteration_started)
                if out:
                    yield out
        finally:
            target_seq.close()
            if proposer is not None:
                proposer.close()
                self.policy.finish(stats.generated_tokens, stopped=self.finish_reason == "stop")
                stats.belief = self.policy.belief()
