"""The draft model's side of the batched engine: its KV (a slot per engine slot), a step's drafting (one forward a
draft position over every drafting sequence) and the evidence catch-up (what the draft would have predicted of the
text it missed, read before it drafts).

Steady shapes. Where the backend replays a step only while its shape stays (Model.steady_shapes: llama.cpp's CUDA
graphs), every draft forward of a step takes one row per drafting sequence: a catch-up of two tokens goes in two
forwards, and a sequence done drafting goes on drafting what nobody reads until the longest draft is done. The
draft's positions past a sequence's accepted tokens are rewound after the verify (`settle`).

Confidence. An adaptive sequence's draft ends after a token the draft itself was unsure of (its probability of
that token's position's likeliest token below POLICY.draft_confidence): the planned k is a cap. The rule reads the
distribution a token is drawn from, never the draw, so a sampled draft keeps its exact distribution; the unsure
token is kept (its forward is paid, a verify row is cheap) and at least one token is drafted.

Greedy sequences, where the backend drafts next to the model (BatchedCache.drafts_greedy: llama.cpp), run the same
loop there in one call (`greedy_drafts`): in llama.cpp's worker process, one request a step, no logits copied back.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from tandem.backends.base import Alongside, BatchedCache, Model
from tandem.config import POLICY
from tandem.engine.generation import DRAFT_MODEL, Generation
from tandem.sampling import argmax, probs_from_logits, sample
from tandem.speculative.compat import draft_ids

# Draft tokens (a list, or a tensor [k] left on the device: Drafter.draft's keep_on_device), and (sampling) the
# distributions they came from.
Proposal = tuple[list[int] | torch.Tensor, torch.Tensor | None]


def confidence_floor(gen: Generation) -> float:
    """The draft's confidence under which a sequence's draft ends (0: it drafts its k: a fixed draft length)."""
    return 0.0 if gen.request.draft_policy == "fixed" else POLICY.draft_confidence


class Drafter:
    """A draft model and its KV slots, for the engine's steps."""

    def __init__(self, model: Model, target_vocab: int, slots: int, n_ctx: int, device: torch.device,
                 synthetic_acceptance: float | None = None) -> None:
        self.model, self.target_vocab, self.device = model, target_vocab, device
        self.synthetic = synthetic_acceptance  # benchmarks: evidence reads match with this probability
        self.kv = model.new_batched_cache(slots, n_ctx, drafting=True)

    def lag(self, gen: Generation) -> int:
        """Tokens of the sequence the draft has yet to take in (the pending one among them)."""
        return len(gen.tokens) - self.kv.length(gen.slot)

    def place(self, slot: int, own: int, source: int | None = None, copied: int = 0) -> None:
        """A new sequence in `slot` keeps what the draft holds of its first `own` tokens, or of the `copied` first
        ones of slot `source` (where the backend copies KV); the rest it takes in when it first drafts."""
        valid = min(own, self.kv.length(slot))
        if source is not None and self.kv.can_copy:
            valid = min(copied, self.kv.length(source))
            self.kv.copy_prefix(source, slot, valid)
        self.kv.rewind(slot, valid)

    def settle(self, gen: Generation) -> None:
        """After a verify: forget the drafts past the sequence's accepted tokens (the pending one is taken in
        when it next drafts)."""
        if self.kv.length(gen.slot) > len(gen.tokens) - 1:
            self.kv.rewind(gen.slot, len(gen.tokens) - 1)

    def ahead(self, gens: list[Generation], last_drafts: list[int]) -> Alongside | None:
        """The draft's feed of each sequence's last draft (which it drew but has not taken in), for the target's
        verify to run beside it (BatchedCache.forward_picking); `settle` forgets it where that draft is rejected.
        None where some slot has no room left."""
        if any(self.kv.length(g.slot) >= self.kv.capacity for g in gens):
            return None
        vocab = self.model.vocab_size
        return self.kv, [(g.slot, draft_ids([t], vocab)) for g, t in zip(gens, last_drafts, strict=True)]

    def _unseen(self, gen: Generation, end: int | None = None) -> list[int]:
        return draft_ids(gen.tokens[self.kv.length(gen.slot) : end], self.model.vocab_size)

    def draft(self, drafting: dict[int, tuple[Generation, int]], keep_on_device: bool = False
              ) -> tuple[dict[int, Proposal], int | None]:
        """Per sequence id, k drafts (fewer where its grammar ends them), and the draft forwards run: None where a
        sequence caught up on more than a steady draft's tokens (then the time is no steady draft's cost).
        keep_on_device: a lone sequence drafting on the device leaves its drafts there, a tensor [k] not yet read
        back, for a verify fed from the device (the engine reads them with its outcome)."""
        drawn: dict[int, list] = {i: [] for i in drafting}
        dists: dict[int, list] = {i: [] for i in drafting}
        gens = [gen for gen, _ in drafting.values()]
        floors = {i: confidence_floor(gen) for i, (gen, _) in drafting.items()}
        batch = [(gen.slot, self._unseen(gen)) for gen in gens]
        active = list(drafting)
        catching_up = max(len(rows) for _, rows in batch) > POLICY.steady_catch_up
        steady = self.model.steady_shapes and not catching_up
        feeds = self._steady_feeds(gens, batch) if steady else [batch]
        if self.kv.drafts_greedy and all(g.sampling.greedy and g.processor is None for g in gens):
            # the loop below, next to the model: no round trip nor logits row copied a draft forward
            drafts, forwards = self.kv.greedy_drafts(feeds, [k for _, k in drafting.values()], self.target_vocab,
                                                     steady, list(floors.values()))
            return {i: (d, None) for i, d in zip(drafting, drafts, strict=True)}, None if catching_up else forwards
        for feed in feeds[:-1]:
            self.kv.forward(feed, [True] * len(feed))
        logits, forwards = self.kv.forward(feeds[-1], [True] * len(feeds[-1])), len(feeds)
        if len(gens) == 1 and gens[0].processor is None and self.kv.steps_on_device and not steady:
            (i, (gen, k)), = drafting.items()
            drawn_i, dists_i = self._draft_on_device(gen, k, logits[0], floors[i])
            drafts = drawn_i if keep_on_device else drawn_i.tolist()
            return {i: (drafts, self._distributions(dists_i))}, None if catching_up else forwards + len(drawn_i) - 1
        while True:
            tokens, confidences = [], {}
            for i, rows in zip(active, logits, strict=False):  # fed = active + done: its first rows are active's
                gen = drafting[i][0]
                rows = rows[-1:, : self.target_vocab]  # a wider draft vocabulary must not propose unknown ids
                if gen.processor is not None:  # the draft proposes under the request's bias, penalties, grammar
                    rows = gen.processor.rows(rows, drawn[i], len(drawn[i]))
                tokens.append(self._draw(gen, rows, dists[i]))
                if floors[i]:
                    confidences[i] = self._confidence(gen, rows, dists[i])
            for i, token in zip(active, torch.cat(tokens).tolist(), strict=True):
                drawn[i].append(token)
            # read with the tokens' read, not one host synchronisation a sequence
            read = torch.stack(list(confidences.values())).tolist() if confidences else []
            ended = {i for i, c in zip(confidences, read, strict=True) if c < floors[i]}
            ended |= {i for i in active if drafting[i][0].processor is not None and
                      drafting[i][0].processor.cut_draft(drawn[i], dists[i])}
            active = [i for i in active if len(drawn[i]) < drafting[i][1] and i not in ended]
            if not active:
                break
            fed = active
            if steady:
                done = [i for i in drafting if i not in active]
                if all(drawn[i] and self.kv.length(drafting[i][0].slot) < self.kv.capacity for i in done):
                    fed = active + done
            logits = self.kv.forward([(drafting[i][0].slot, drawn[i][-1:]) for i in fed], [True] * len(fed))
            forwards += 1
        return {i: (drawn[i], self._distributions(dists[i])) for i in drafting}, None if catching_up else forwards

    def _draft_on_device(self, gen: Generation, k: int, logits: torch.Tensor, floor: float = 0.0
                         ) -> tuple[torch.Tensor, list]:
        """A lone sequence's k drafts [k], each step's token fed to the next from the device (step_on_device), none
        read back (a host synchronisation a draft step costs a GPU's draft a tenth of its step) but, where a floor
        may end the draft, its confidence. The same draws as the loop's, in the same order."""
        tokens, dists = [], []
        rows = logits[-1:, : self.target_vocab]
        for step in range(k):
            token = self._draw(gen, rows, dists)
            tokens.append(token)
            if floor and float(self._confidence(gen, rows, dists)) < floor:
                break
            if step + 1 < k:
                rows = self.kv.step_on_device(gen.slot, token.view(1))[-1:, : self.target_vocab]
        return torch.cat(tokens), dists

    @staticmethod
    def _draw(gen: Generation, rows: torch.Tensor, dists: list[torch.Tensor]) -> torch.Tensor:
        """A draft token [1] from one row [1, V]: the argmax, or sampling a draw whose distribution joins dists."""
        if gen.sampling.greedy:
            return argmax(rows)
        probs = probs_from_logits(rows, gen.sampling)
        dists.append(probs)
        return sample(probs, gen.draft_generator)

    @staticmethod
    def _confidence(gen: Generation, rows: torch.Tensor, dists: list[torch.Tensor]) -> torch.Tensor:
        """The draft's probability (a 0-d tensor, not read back) of the likeliest token of the row [1, V] its latest
        token came from: of its sampling distribution (the draw's, dists[-1]), or of the softmax (greedy). Never the
        drawn token's own."""
        if not gen.sampling.greedy:
            return dists[-1].max().float()
        if rows.device.type == "cpu":  # numpy: torch's thread pool waits for busy cores (tandem.sampling.argmax)
            row = rows[0].float().numpy()
            return torch.tensor(1.0 / np.exp(row - row.max(), dtype=np.float64).sum(), dtype=torch.float32)
        return torch.softmax(rows[0].float(), dim=-1).max()

    def _distributions(self, dists: list[torch.Tensor]) -> torch.Tensor | None:
        if not dists:
            return None
        probs = torch.cat(dists)
        if probs.shape[-1] < self.target_vocab:  # a narrower draft vocabulary gives q = 0 to the ids it lacks
            probs = torch.nn.functional.pad(probs, (0, self.target_vocab - probs.shape[-1]))
        return probs.to(self.device)

    def _steady_feeds(self, gens: list[Generation], batch: list[tuple[int, list[int]]]
                      ) -> list[list[tuple[int, list[int]]]]:
        """1-2 unseen tokens a sequence as forwards of one row per sequence, the shape of the draft steps after: a
        sequence with one feeds its last seen token again first (rewound to before it). The forwards' batches, in
        order (2 where someone had two tokens); each sequence's last token is in the last."""
        if all(len(rows) == 1 for _, rows in batch) or any(self.kv.length(g.slot) == 0 for g in gens):
            return [batch]
        first = []
        for gen, (slot, rows) in zip(gens, batch, strict=True):
            if len(rows) == 1:
                self.kv.rewind(slot, self.kv.length(slot) - 1)
                rows = self._unseen(gen)  # the last seen token, then the new one
            first.append((slot, rows[:1]))
        return [first, [(slot, rows[-1:]) for slot, rows in batch]]

    def prefill(self, chunks: list[tuple[Generation, int]]) -> None:
        """Take in each sequence's tokens up to `end` (a prompt chunk's end) beside the target's prefill, so that
        its first drafts need no catch-up (DraftPolicy._draft_may_pay says which sequences)."""
        batch = [(gen.slot, rows) for gen, end in chunks if (rows := self._unseen(gen, end))]
        if batch:
            self.kv.forward(batch, [True] * len(batch))

    def read_evidence(self, gens: list[Generation]) -> None:
        """Catch each sequence's draft up on the tokens it has not seen but the pending one (which it takes in
        when it drafts), reading its argmax at the rows before the latest generated ones (at most POLICY.evidence_rows):
        whether it would have predicted each is evidence of its acceptance (a greedy match; under sampling the same
        figure stands in). Under synthetic acceptance (benchmarks) each position matches
        with that probability, drawn as the verify draws: the catch-up is paid, the random draft's argmax unread."""
        started = time.perf_counter()
        heads, tails = [], []
        for gen in gens:
            seen, end = self.kv.length(gen.slot), len(gen.tokens) - 1
            unseen = self._unseen(gen, end)
            # Row i of the catch-up predicts token seen + i + 1; the first token checked is a generated one.
            first_checked = max(gen.prompt_len, seen + 1, end + 1 - POLICY.evidence_rows)
            split = first_checked - 1 - seen
            if split > 0:
                heads.append((gen.slot, unseen[:split]))
            if unseen[split:]:  # else nothing generated yet that the draft has not seen: nothing to check
                tails.append((gen, unseen[split:], first_checked))
        if heads:
            self.kv.forward(heads, [True] * len(heads))
        if not tails:
            return
        logits = self.kv.forward([(g.slot, rows) for g, rows, _ in tails], [False] * len(tails))
        predicted = torch.cat([argmax(rows[:, : self.target_vocab]) for rows in logits]).tolist()
        ms = 1000.0 * (time.perf_counter() - started) / len(gens)
        at = 0
        for gen, _, first_checked in tails:
            actual = gen.tokens[first_checked:]
            if self.synthetic is None:
                matched = [p == t for p, t in zip(predicted[at : at + len(actual)], actual, strict=True)]
            else:
                draws = torch.rand(len(actual), generator=gen.generator, device=gen.generator.device)
                matched = (draws < self.synthetic).tolist()
            at += len(actual)
            gen.observe_evidence(DRAFT_MODEL, matched)
            gen.stats.record_catch_up(DRAFT_MODEL, ms, sum(matched), len(matched))

    def close(self) -> None:
        self.kv.close()


class HeadDrafter(Drafter):
    """A head draft (the Gemma 4 assistant: docs/decisions/0004-head-drafts.md) in the draft model's place: the same
    draft loop (greedy, sampled, under a grammar), over the head's cache on the target's (BatchedCache.attach_head).
    It reads the target's KV and hidden states, so it has nothing to catch up on, prefill or feed ahead, and it
    reads no evidence in hindsight: llama.cpp takes a sequence's rows only at the target's next position (Y = X + 1),
    so its acceptance is learnt from its verified drafts alone."""

    def __init__(self, model: Model, target_vocab: int, target_kv: BatchedCache, device: torch.device) -> None:
        self.model, self.target_vocab, self.device = model, target_vocab, device
        self.kv, self.synthetic = target_kv.attach_head(model), None

    def ahead(self, gens: list[Generation], last_drafts: list[int]) -> Alongside | None:
        return None

    def prefill(self, chunks: list[tuple[Generation, int]]) -> None:
        pass

    def read_evidence(self, gens: list[Generation]) -> None:
        pass

