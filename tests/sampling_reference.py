"""An independent reference for sampling: logits -> probabilities in numpy (float64), written from the definitions,
not from `tandem.sampling`, and exact target distributions enumerated with it.

The definitions (Hugging Face's and vLLM's semantics, in Hugging Face's order: temperature, top-k, top-p, min-p):
- temperature T: scores = logits / T.
- top-k (Fan et al. 2018): keep the k highest scores; every token tied with the k-th is kept too (HF and vLLM mask
  `scores < kth`, so a tie at the k-th place keeps more than k tokens).
- top-p, nucleus (Holtzman et al. 2020): the smallest set of most likely tokens whose probability reaches top_p.
  Walking the tokens from the most likely down and adding up their mass, a token is kept while the mass taken
  before it is still below top_p; the most likely token is always kept. Among equal probabilities the order is not
  defined (it is the sort's): here the lower token id first; `group_totals` compares two results without caring.
- min-p (Nguyen et al. 2024): keep tokens whose probability (after the filters above) is >= min_p * the largest.
Each filter's survivors are renormalised by a softmax over what is left.

vLLM v1 applies min-p before top-k and top-p (an argmax-invariant processor, then its top-k/top-p sampler); min-p
then top-p cuts earlier than top-p then min-p, since top-p sees min-p's renormalised mass. tandem documents Hugging
Face's order, and this reference follows it; each filter alone means the same in both.
"""

from __future__ import annotations

import math

import numpy as np

# A row whose top-p or min-p cut falls this close to a token is ill-conditioned: float32 and float64 arithmetic may
# cut it on either side, and either answer is right.
CUT_MARGIN = 1e-5


def _softmax(scores: np.ndarray) -> np.ndarray:
    finite = np.isfinite(scores)
    out = np.zeros_like(scores)
    top = scores[finite].max()
    out[finite] = np.exp(scores[finite] - top)
    return out / out.sum()


def reference_probs_row(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                        min_p: float = 0.0) -> tuple[np.ndarray, float]:
    """One row [V] of logits -> (probabilities [V] float64, margin): margin is how far, relative to the quantity cut
    on, the nearest token lies from a top-p or min-p cut (inf where neither applies)."""
    assert temperature > 0, "temperature 0 is greedy: no distribution"
    scores = np.asarray(logits, dtype=np.float64) / temperature
    vocab = scores.shape[0]
    margin = math.inf
    if 0 < top_k < vocab:
        kth = np.sort(scores)[::-1][top_k - 1]
        scores = np.where(scores >= kth, scores, -np.inf)
    if top_p < 1.0:
        probs = _softmax(scores)
        order = sorted(range(vocab), key=lambda i: (-probs[i], i))  # most likely first, then lower id
        keep, mass_before = [], 0.0
        for i in order:
            if keep and mass_before >= top_p:
                margin = min(margin, mass_before - top_p)
                break
            if keep:
                margin = min(margin, top_p - mass_before)
            keep.append(i)
            mass_before += probs[i]
        kept = np.full(vocab, -np.inf)
        kept[keep] = scores[keep]
        scores = kept
    probs = _softmax(scores)
    if min_p > 0.0:
        threshold = min_p * probs.max()
        # Tokens tied with the largest are kept by any arithmetic (equal logits give equal probabilities).
        below_top = (probs > 0) & (probs < probs.max())
        if below_top.any():
            margin = min(margin, float(np.abs(probs[below_top] - threshold).min() / probs.max()))
        probs = np.where(probs >= threshold, probs, 0.0)
        probs = probs / probs.sum()
    return probs, margin


def reference_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> np.ndarray:
    """Rows [N, V] (or one row [V]) of logits -> probabilities of the same shape, float64."""
    rows = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    out = np.stack([reference_probs_row(row, temperature, top_k, top_p, min_p)[0] for row in rows])
    return out if np.ndim(logits) == 2 else out[0]


def group_totals(logits: np.ndarray, probs: np.ndarray) -> dict[float, tuple[int, float]]:
    """{logit value: (tokens kept, their total probability)} of one row: equal logits are interchangeable, so two
    results that keep different members of a tie (the sort's order) compare equal here, and no others do."""
    totals: dict[float, tuple[int, float]] = {}
    values, probs = np.asarray(logits, dtype=np.float64).tolist(), np.asarray(probs, dtype=np.float64).tolist()
    for value, p in zip(values, probs, strict=True):
        n, mass = totals.get(value, (0, 0.0))
        totals[value] = (n + (p > 0), mass + p)
    return totals


def exact_distribution(logits_of, prompt_ids: list[int], n_tokens: int, temperature: float, top_k: int = 0,
                       top_p: float = 1.0, min_p: float = 0.0) -> tuple[dict[tuple[int, ...], float], float]:
    """P(t1, ..., tn) of a model's next n_tokens, by enumerating the tree of tokens each position may sample, with
    the reference above: ({sequence: probability}, the smallest cut margin met). logits_of(ids) -> the model's last
    row of logits for ids, as anything numpy reads ([V] or [1, V])."""
    dist, worst = {(): 1.0}, math.inf
    for _ in range(n_tokens):
        grown = {}
        for prefix, mass in dist.items():
            row = np.asarray(logits_of(prompt_ids + list(prefix)), dtype=np.float64).reshape(-1)
            probs, margin = reference_probs_row(row, temperature, top_k, top_p, min_p)
            worst = min(worst, margin)
            for token in np.flatnonzero(probs).tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        dist = grown
    return dist, worst
