"""Prompt lookup: draft tokens copied from earlier in the text, where its tail repeats (Saxena 2023's prompt lookup
decoding; llama.cpp's n-gram speculation). The engine asks it per sequence for a match and its continuation; the
verifier never needs to know where drafts came from.
"""

from __future__ import annotations


class NgramProposer:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the last n tokens.

    Example, with max_ngram=2: tokens = [5, 6, 7, 8, 5, 6] ends in (5, 6), which occurred at positions 0..1 and
    was followed by 7, 8, 5, 6; continuation(tokens, k=3) returns [7, 8, 5]. Longer n-grams are tried first. The
    index maps each n-gram to its latest end position and grows by one entry per new token, so a lookup costs O(k).
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
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

    def match(self, tokens: list[int]) -> tuple[str | None, int]:
        """(the source of the longest match of tokens' tail, how many tokens follow it there); (None, 0) if none."""
        n, follow = self._match(tokens)
        return (f"{self.name}{n}", len(tokens) - follow) if follow is not None else (None, 0)

    def hindsight(self) -> dict[str, list[bool]]:
        """Per source (match length), in order, for each generated token indexed since the last call: whether a
        lookup just before it would have proposed it. Free evidence of lookup's acceptance on this reply, drafting
        or not; the engine adds it to the sequence's estimate of each source."""
        out, self._hindsight = self._hindsight, {}
        return out

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """At most k tokens that followed the longest match of tokens' tail."""
        follow = self._follow(tokens)
        return tokens[follow : follow + k] if follow is not None else []
