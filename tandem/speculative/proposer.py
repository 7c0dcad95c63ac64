"""Proposers: where draft tokens come from. The verifier never needs to know which one made them.

Protocol of one request: `start(prompt)` once, then each iteration `propose(tokens, k, source)` with every token so
far (the last one not yet seen by the target), then `accept(n_valid)` telling how many leading tokens of the new
sequence are final, so the proposer can roll its own state back past anything the verifier rejected. A proposer has
one or more *sources* (the draft model, prompt lookup); before each iteration `lags(tokens)` says which of them can
propose now and what each must take in first, and the policy picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tandem.backends.base import Model, Sequence
from tandem.sampling import SamplingParams, argmax, make_generator, probs_from_logits, sample
from tandem.speculative.compat import draft_ids
from tandem.speculative.policy import DRAFT_MODEL_SOURCE, STEADY_CATCH_UP


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] int64 on the target's device (k may be below what was asked, even 0)
    probs: torch.Tensor | None  # [k, V_target] distributions the tokens were drawn from; None = deterministic
    catch_up: int = 0  # tokens the proposer evaluated before drafting (the draft model's unseen accepted tokens)
    forwards: int | None = None  # the draft model's forwards for these tokens, catch-up included (None: not one)


@dataclass
class CatchUp:
    """A draft model took in the tokens it had not seen, and said how many of the generated ones it would have
    predicted (its argmax at the row before each, teacher-forced): acceptance evidence before a single draft."""

    tokens: int  # tokens taken in
    matched: list[bool]  # per generated token among them, in order: whether the draft's argmax predicted it

    @property
    def matches(self) -> int:
        return sum(self.matched)

    @property
    def positions(self) -> int:
        return len(self.matched)


class Proposer(ABC):
    name: str

    @property
    def sources(self) -> tuple[str, ...]:
        """The names of the places drafts come from; one, but for a MixedProposer."""
        return (self.name,)

    def start(self, prompt: list[int]) -> None:
        """Take in the prompt before the first iteration."""

    @abstractmethod
    def propose(self, tokens: list[int], k: int, source: str | None = None) -> Proposal: ...

    def lag(self, n_tokens: int) -> int:
        """Tokens of a sequence of n_tokens that the proposer has yet to take in before it can draft."""
        return 0

    def ready(self, tokens: list[int]) -> bool:
        """Whether propose(tokens, k > 0) would return any token (asked before the iteration is planned)."""
        return True

    def lags(self, tokens: list[int]) -> dict[str, int | None]:
        """Per source: tokens it must take in before drafting, None where it has nothing to propose now."""
        return {self.name: self.lag(len(tokens)) if self.ready(tokens) else None}

    def catch_up(self, tokens: list[int], source: str | None = None) -> CatchUp | None:
        """Take in every unseen token now, reporting acceptance evidence; None where the source has no catch-up."""
        return None

    def hindsight(self) -> dict[str, list[bool]]:
        """Evidence gathered for free since the last call: per source, whether it would have predicted each new
        token (see NgramProposer.hindsight)."""
        return {}

    def accept(self, n_valid: int) -> None:
        """The first n_valid tokens of the sequence are final; forget anything proposed beyond them."""

    def close(self) -> None: ...


class DraftModelProposer(Proposer):
    """A small model of the same tokenizer, run autoregressively for k steps on its own KV cache."""

    name = DRAFT_MODEL_SOURCE

    def __init__(self, draft: Model, params: SamplingParams, target_vocab: int, target_device: torch.device | str,
                 n_ctx: int | None = None) -> None:
        self.draft = draft
        self.params = params
        self.target_vocab = target_vocab
        self.target_device = torch.device(target_device)
        self.n_ctx = n_ctx
        self.seq: Sequence | None = None
        self.prompt_len = 0
        self._next_logits: tuple[int, torch.Tensor] | None = None
        draft_device = getattr(draft, "torch_device", "cpu")
        # A generator of its own on the draft's device: the draft may live elsewhere than the target.
        seed = None if params.seed is None else params.seed + 1
        self.generator = None if params.greedy else make_generator(seed, draft_device)

    def start(self, prompt: list[int]) -> None:
        # No prefill here: the first propose() or catch_up() takes in the prompt. Where the policy never drafts (a
        # 2-core CPU, measured: the draft's prefill cost 0.6-3 s a request there) the draft then never runs at all.
        self.seq = self.draft.new_sequence(self.n_ctx, drafting=True)
        self.prompt_len = len(prompt)
        self._next_logits: tuple[int, torch.Tensor] | None = None  # (tokens seen, the row predicting the next)

    def _unseen(self, tokens: list[int]) -> list[int]:
        # accepted tokens the draft has not seen: 1 or 2 per iteration
        return draft_ids(tokens[self.seq.length :], self.draft.vocab_size)

    def catch_up(self, tokens: list[int], source: str | None = None) -> CatchUp:
        """Take in every unseen token in one or two batched forwards; the rows over generated tokens show which of
        them the draft would have predicted (a greedy match; under sampling the same figure stands in)."""
        assert self.seq is not None, "start() first"
        seen, unseen = self.seq.length, self._unseen(tokens)
        if not unseen:
            return CatchUp(0, [])
        # Row i of the catch-up sits at position seen + i and predicts token seen + i + 1; generated tokens start at
        # prompt_len, and the first one a row of this catch-up predicts is seen + 1.
        first_checked = max(self.prompt_len, seen + 1)
        split = first_checked - 1 - seen  # the row predicting first_checked
        if first_checked >= len(tokens) or split >= len(unseen):
            logits = self.seq.forward(unseen, logits="last")
            self._next_logits = (len(tokens), logits[-1:])
            return CatchUp(len(unseen), [])
        if split > 0:
            self.seq.forward(unseen[:split], logits="last")
        rows = self.seq.forward(unseen[split:], logits="all")  # [len(tokens) - first_checked + 1, V_draft]
        predicted = argmax(rows[:-1, : self.target_vocab]).tolist()
        actual = tokens[first_checked:]
        self._next_logits = (len(tokens), rows[-1:])
        return CatchUp(len(unseen), [p == t for p, t in zip(predicted, actual, strict=True)])

    def _draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = logits[-1:, : self.target_vocab]  # [1, V]: a wider draft vocabulary must not propose unknown ids
        if self.params.greedy:
            return argmax(logits), None
        probs = probs_from_logits(logits, self.params)
        return sample(probs, self.generator), probs

    def propose(self, tokens: list[int], k: int, source: str | None = None) -> Proposal:
        assert self.seq is not None, "start() first"
        catch_up = self._unseen(tokens)
        k = min(k, self.seq.capacity - self.seq.length - len(catch_up) + 1)
        if k <= 0:
            return Proposal(torch.empty(0, dtype=torch.long, device=self.target_device), None)
        ready, self._next_logits = self._next_logits, None
        if not catch_up and ready is not None and ready[0] == len(tokens) == self.seq.length:
            logits = ready[1]  # catch_up() already took everything in and kept the row that predicts the next token
            forwards = 0
        elif self.draft.steady_shapes and len(catch_up) <= STEADY_CATCH_UP:
            for token in catch_up:  # one row a forward, as the steps below: the step stays a replayed graph
                logits = self.seq.forward([token], logits="last")
            forwards = len(catch_up)
        else:
            logits = self.seq.forward(catch_up, logits="last")
            forwards = 1
        drawn, dists = [], []
        for i in range(k):
            token, probs = self._draw(logits)
            drawn.append(token)
            dists.append(probs)
            if i < k - 1:
                logits = self.seq.forward(token, logits="last")
                forwards += 1
        draft_tokens = torch.cat(drawn).to(self.target_device, non_blocking=True)
        if self.params.greedy:
            return Proposal(draft_tokens, None, len(catch_up), forwards)
        probs = torch.cat(dists)
        if probs.shape[-1] < self.target_vocab:  # a narrower draft vocabulary gives q = 0 to the ids it lacks
            probs = torch.nn.functional.pad(probs, (0, self.target_vocab - probs.shape[-1]))
        return Proposal(draft_tokens, probs.to(self.target_device, non_blocking=True), len(catch_up), forwards)

    def lag(self, n_tokens: int) -> int:
        return n_tokens - (self.seq.length if self.seq is not None else 0)

    def accept(self, n_valid: int) -> None:
        if self.seq is not None and self.seq.length > n_valid:
            self.seq.rewind(n_valid)
            self._next_logits = None

    def close(self) -> None:
        if self.seq is not None:
            self.seq.close()
            self.seq = None


class NgramProposer(Proposer):
    """Prompt lookup: propose what followed the most recent earlier occurrence of the last n tokens.

    Example, with max_ngram=2: tokens = [5, 6, 7, 8, 5, 6] ends in (5, 6), which occurred at positions 0..1 and
    was followed by 7, 8, 5, 6; propose(tokens, k=3) returns [7, 8, 5]. Longer n-grams are tried first. The index
    maps each n-gram to its latest end position and grows by one entry per new token, so proposing costs O(k).
    """

    name = "ngram"

    def __init__(self, target_device: torch.device | str = "cpu", max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.target_device = torch.device(target_device)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> position just after its latest occurrence
        self.indexed = 0  # tokens[:indexed] are in the index as n-gram *ends*
        self.prompt_len = 0
        self._hindsight: dict[str, list[bool]] = {}  # source -> whether its lookup would have predicted each token

    def start(self, prompt: list[int]) -> None:
        self.index.clear()
        self.indexed = 0
        self.prompt_len = len(prompt)
        self._hindsight: dict[str, list[bool]] = {}

    def _extend_index(self, tokens: list[int]) -> None:
        # Index occurrences ending before the final position, so the suffix never matches itself.
        index, lo, hi = self.index, self.min_ngram, self.max_ngram
        for end in range(self.indexed + 1, len(tokens)):
            longest = tuple(tokens[max(0, end - hi) : end])  # the n-grams ending here are its tails
            keys = [longest[len(longest) - n :] for n in range(lo, len(longest) + 1)]  # shortest first
            if end >= self.prompt_len:
                # In hindsight: what a lookup with tokens[:end] would have proposed first, and whether it was right.
                for key in reversed(keys):
                    if (follow := index.get(key)) is not None:
                        self._hindsight.setdefault(f"{self.name}{len(key)}", []).append(tokens[follow] == tokens[end])
                        break
            for key in keys:
                index[key] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def _match(self, tokens: list[int]) -> tuple[int, int | None]:
        """(n, where the continuation starts) of the longest indexed suffix of tokens; (0, None) if none."""
        self._extend_index(tokens)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) >= n and (follow := self.index.get(tuple(tokens[-n:]))) is not None:
                return n, follow
        return 0, None

    def _follow(self, tokens: list[int]) -> int | None:
        return self._match(tokens)[1]

    @property
    def sources(self) -> tuple[str, ...]:
        # One source per match length: a 3-token match inside a copied passage is right far more often than a
        # 1-token one in fresh text (0.9 against ~0.1 on a copy-and-write reply), and the policy must tell them apart.
        return tuple(f"{self.name}{n}" for n in range(self.max_ngram, self.min_ngram - 1, -1))

    def lags(self, tokens: list[int]) -> dict[str, int | None]:
        n, _ = self._match(tokens)
        return {source: 0 if source == f"{self.name}{n}" else None for source in self.sources}

    def ready(self, tokens: list[int]) -> bool:
        return self._follow(tokens) is not None

    def match(self, tokens: list[int]) -> tuple[str | None, int]:
        """(the source of the longest match of tokens' tail, how many tokens follow it there); (None, 0) if none."""
        n, follow = self._match(tokens)
        return (f"{self.name}{n}", len(tokens) - follow) if follow is not None else (None, 0)

    def hindsight(self) -> dict[str, list[bool]]:
        """Per source (match length), in order, for each generated token indexed since the last call: whether a
        lookup just before it would have proposed it. Free evidence of lookup's acceptance on this reply, drafting
        or not; the decode loop passes it to the policy."""
        out, self._hindsight = self._hindsight, {}
        return out

    def propose(self, tokens: list[int], k: int, source: str | None = None) -> Proposal:
        return Proposal(torch.tensor(self.continuation(tokens, k), dtype=torch.long, device=self.target_device), None)

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """At most k tokens that followed the longest match of tokens' tail (host ids: the batched engine's way)."""
        follow = self._follow(tokens)
        return tokens[follow : follow + k] if follow is not None else []


class MixedProposer(Proposer):
    """Prompt lookup where it has a match, the draft model elsewhere: the policy picks a source per iteration by the
    same cost model (lookup drafts for free but only where the text repeats; the draft costs steps but always has a
    guess). Each iteration's proposal comes from one source, verified against its own q (one-hot for lookup), so
    the output is the target's, token for token under greedy and in distribution under sampling."""

    name = "mixed"

    def __init__(self, draft: DraftModelProposer, lookup: NgramProposer) -> None:
        self.draft, self.lookup = draft, lookup
        self._by_source: dict[str, Proposer] = {**{s: lookup for s in lookup.sources}, draft.name: draft}

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(self._by_source)

    def start(self, prompt: list[int]) -> None:
        self.lookup.start(prompt)
        self.draft.start(prompt)

    def lags(self, tokens: list[int]) -> dict[str, int | None]:
        return {**self.lookup.lags(tokens), **self.draft.lags(tokens)}

    def lag(self, n_tokens: int) -> int:
        return self.draft.lag(n_tokens)

    def hindsight(self) -> dict[str, list[bool]]:
        return self.lookup.hindsight()

    def propose(self, tokens: list[int], k: int, source: str | None = None) -> Proposal:
        if source is None:  # a caller that does not plan by source: lookup where it matches
            return (self.lookup if self.lookup.ready(tokens) else self.draft).propose(tokens, k)
        return self._by_source[source].propose(tokens, k)

    def catch_up(self, tokens: list[int], source: str | None = None) -> CatchUp | None:
        return self.draft.catch_up(tokens) if source in (None, self.draft.name) else None

    def accept(self, n_valid: int) -> None:
        self.lookup.accept(n_valid)
        self.draft.accept(n_valid)

    def close(self) -> None:
        self.lookup.close()
        self.draft.close()
