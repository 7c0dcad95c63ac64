"""Sampling as pure tensor functions: logits -> probabilities -> tokens, with no host synchronisation.

The same transform (temperature, then top-k, top-p, min-p, as Hugging Face orders them) is applied to the target's
and the draft's logits; rejection sampling then reproduces the target's *transformed* distribution exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


class SamplingError(ValueError):
    """Invalid sampling parameters."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); OpenAI allows 0..2, we accept any finite >= 0
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1 = off
    min_p: float = 0.0  # drop tokens below min_p * max probability; 0 = off
    seed: int | None = None  # seeds the request's generator; None = nondeterministic

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise SamplingError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        # top_k = 1 is greedy too; treating it so keeps verification exact-match and cheap.
        return self.temperature == 0.0 or self.top_k == 1


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [N, V] into the sampling distribution [N, V] (float32, or float64 for float64 logits)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(dtype) / max(params.temperature, 1e-6)
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always stays.
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        # Explicitly: a top_p below float32's smallest normal rounds to 0, and 0 >= 0 would drop everything.
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of probs [N, V] -> [N] (int64), on probs' device, without a host sync."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) (int64, the first of equal maxima, as torch's). On the CPU through numpy: torch's
    thread pool waits for busy cores, ~10-200x numpy's time over a 152k-wide row (docs/decisions/0007)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64) or logits.requires_grad:
        return logits.argmax(dim=-1)
    return torch.from_numpy(np.asarray(logits.numpy().argmax(axis=-1), dtype=np.int64))


def picked(rows: torch.Tensor) -> torch.Tensor:
    """[T] token ids: the argmax of logits rows [T, V], or the rows themselves where the backend picked them already
    (BatchedCache.forward_picking returns a greedy entry's argmax, [T] int64)."""
    return rows if rows.dim() == 1 else argmax(rows)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
