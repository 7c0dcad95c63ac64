"""Proposers: where draft tokens come from. The verifier never needs to know which one made them.

Protocol of one request: `start(prompt)` once, then each iteration `propose(tokens, k)` with every token so far
(the last one not yet seen by the target), then `accept(n_valid)` telling how many leading tokens of the new
sequence are final, so the proposer can roll its own state back past anything the verifier rejected.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tandem.backends.base import Model, Sequence
from tandem.sampling import SamplingParams, make_generator, probs_from_logits, sample


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] int64 on the target's device (k may be below what was asked, even 0)
    probs: torch.Tensor | None  # [k, V_target] distributions the tokens were drawn from; None = deterministic
    catch_up: int = 0  # tokens the proposer evaluated before drafting (the draft model's unseen accepted tokens)


class Proposer(ABC):
    name: str

    def start(self, prompt: list[int]) -> None:
        """Take in the prompt before the first iteration."""

    @abstractmethod
    def propose(self, tokens: list[int], k: int) -> Proposal: ...

    def lag(self, n_tokens: int) -> int:
        """Tokens of a sequence of n_tokens that the proposer has yet to take in before it can draft."""
        return 0

    def ready(self, tokens: list[int]) -> bool:
        """Whether propose(tokens, k > 0) would return any token (asked before the iteration is planned)."""
        return True

    def accept(self, n_valid: int) -> None:
        """The first n_valid tokens of the sequence are final; forget anything proposed beyond them."""

    def close(self) -> None: ...


class DraftModelProposer(Proposer):
    """A small model of the same tokenizer, run autoregressively for k steps on its own KV cache."""

    name = "draft-model"

    def __init__(self, draft: Model, params: SamplingParams, target_vocab: int, target_device: torch.device | str,
                 n_ctx: int | None = None) -> None:
        self.draft = draft
        self.params = params
        self.target_vocab = target_vocab
        self.target_device = torch.device(target_device)
        self.n_ctx = n_ctx
        self.seq: Sequence | None = None
        draft_device = getattr(draft, "torch_device", "cpu")
        # A generator of its own on the draft's device: the draft may live elsewhere than the target.
        seed = None if params.seed is None else params.seed + 1
        self.generator = None if params.greedy else make_generator(seed, draft_device)

    def start(self, prompt: list[int]) -> None:
        # No prefill here: the first propose() catches up on the prompt. Where the policy never drafts (a 2-core
        # CPU, measured: the draft's prefill cost 0.6-3 s a request there) the draft then never runs at all.
        self.seq = self.draft.new_sequence(self.n_ctx, drafting=True)

    def _draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = logits[-1:, : self.target_vocab]  # [1, V]: a wider draft vocabulary must not propose unknown ids
        if self.params.greedy:
            return logits.argmax(dim=-1), None
        probs = probs_from_logits(logits, self.params)
        return sample(probs, self.generator), probs

    def propose(self, tokens: list[int], k: int) -> Proposal:
        assert self.seq is not None, "start() first"
        catch_up = tokens[self.seq.length :]  # accepted tokens the draft has not seen: 1 or 2 per iteration
        k = min(k, self.seq.capacity - self.seq.length - len(catch_up) + 1)
        if k <= 0:
            return Proposal(torch.empty(0, dtype=torch.long, device=self.target_device), None)
        if any(t >= self.draft.vocab_size for t in catch_up):
            # A target with a wider (padded) vocabulary emitted an id the draft has no embedding for (Qwen2.5-32B
            # has 152064 rows, its 0.5B-3B drafts 151936; a random 32B emits one every ~1200 tokens): feed the draft
            # a stand-in. Its proposals after it may be worse; the target still verifies every one.
            catch_up = [t if t < self.draft.vocab_size else 0 for t in catch_up]
        logits = self.seq.forward(catch_up, logits="last")
        drawn, dists = [], []
        for i in range(k):
            token, probs = self._draw(logits)
            drawn.append(token)
            dists.append(probs)
            if i < k - 1:
                logits = self.seq.forward(token, logits="last")
        draft_tokens = torch.cat(drawn).to(self.target_device, non_blocking=True)
        if self.params.greedy:
            return Proposal(draft_tokens, None, len(catch_up))
        probs = torch.cat(dists)
        if probs.shape[-1] < self.target_vocab:  # a narrower draft vocabulary gives q = 0 to the ids it lacks
            probs = torch.nn.functional.pad(probs, (0, self.target_vocab - probs.shape[-1]))
        return Proposal(draft_tokens, probs.to(self.target_device, non_blocking=True), len(catch_up))

    def lag(self, n_tokens: int) -> int:
        return n_tokens - (self.seq.length if self.seq is not None else 0)

    def accept(self, n_valid: int) -> None:
        if self.seq is not None and self.seq.length > n_valid:
            self.seq.rewind(n_valid)

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

    def start(self, prompt: list[int]) -> None:
        self.index.clear()
        self.indexed = 0

    def _extend_index(self, tokens: list[int]) -> None:
        # Index occurrences ending before the final position, so the suffix never matches itself.
        for end in range(self.indexed + 1, len(tokens)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n >= 0:
                    self.index[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def _follow(self, tokens: list[int]) -> int | None:
        """Where the continuation of the longest indexed suffix of tokens starts, if any."""
        self._extend_index(tokens)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) >= n and (follow := self.index.get(tuple(tokens[-n:]))) is not None:
                return follow
        return None

    def ready(self, tokens: list[int]) -> bool:
        return self._follow(tokens) is not None

    def propose(self, tokens: list[int], k: int) -> Proposal:
        follow = self._follow(tokens)
        found = tokens[follow : follow + k] if follow is not None else []
        return Proposal(torch.tensor(found, dtype=torch.long, device=self.target_device), None)
