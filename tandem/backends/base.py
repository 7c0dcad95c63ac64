"""The interface every backend implements; `tandem.spec` talks to models only through it.

A `Model` is loaded weights plus a tokenizer. A `Sequence` is one KV cache over that model: the decode loop owns
one per model per request, feeds it tokens and rewinds it. Rewinding is O(1) (the cache is static and indexed by
absolute position), so speculation can throw away rejected draft tokens without copying anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tandem.config import ModelConfig
    from tandem.loading.tokenizer import Tokenizer


class ContextOverflowError(ValueError):
    """More tokens than a sequence's KV cache can hold."""


class Sequence(ABC):
    """One KV cache. Positions 0..length-1 hold the tokens fed so far."""

    capacity: int  # most tokens this cache can hold

    @property
    @abstractmethod
    def length(self) -> int: ...

    @abstractmethod
    def forward(self, tokens: Seq[int] | torch.Tensor, logits: str = "all") -> torch.Tensor:
        """Feed T tokens at positions length..length+T-1 and return their logits.

        logits="all" gives [T, vocab] (a verify needs every row); "last" gives [1, vocab] (a prefill needs only the
        next-token row, and skipping the rest saves T-1 output projections). Float32, on the model's device.
        Raises ContextOverflowError (and changes nothing) when length + T > capacity.
        """

    @abstractmethod
    def rewind(self, length: int) -> None:
        """Forget every position >= length (0 <= length <= self.length)."""

    def close(self) -> None:
        """Free what this sequence holds (a llama.cpp context, a cache slot)."""

    def _check_room(self, n_new: int) -> None:
        if self.length + n_new > self.capacity:
            raise ContextOverflowError(
                f"{self.length} tokens in the cache + {n_new} new = {self.length + n_new} exceeds the "
                f"context of {self.capacity} tokens by {self.length + n_new - self.capacity}"
            )

    def _check_rewind(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length}: the cache holds {self.length} tokens")


class Model(ABC):
    """Loaded weights, their tokenizer and the means to open KV caches over them."""

    path: str
    config: ModelConfig
    tokenizer: Tokenizer
    backend: str  # "torch" | "llama.cpp"
    device: str  # e.g. "cpu", "cuda:0", "vulkan:0"
    n_ctx: int  # default capacity of a new sequence

    @abstractmethod
    def new_sequence(self, n_ctx: int | None = None, drafting: bool = False) -> Sequence:
        """Open an empty KV cache holding up to n_ctx tokens (default self.n_ctx).

        drafting=True sizes it for a draft model: one-token steps and short catch-ups, whose numerics need match
        nothing (a target's forwards must give a token the same logits however many tokens share the forward).
        """

    def logits(self, ids: Seq[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] for ids from position 0, in a fresh cache: no side effects on any other."""
        seq = self.new_sequence(max(len(ids), 1))
        try:
            return seq.forward(list(ids), logits="all")
        finally:
            seq.close()

    def synchronize(self) -> None:
        """Wait for queued device work (for honest timings); a no-op on synchronous backends."""

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.config.architecture} {self.path!r} on {self.device} ({self.backend})>"
