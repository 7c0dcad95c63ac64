"""Verification: which draft tokens the target keeps. Pure functions; they never touch a model.

Terms (as vLLM defines them): of k draft tokens the first n are *accepted*; then the target emits one more token,
a *recovered* token drawn from the residual distribution when draft token n+1 was rejected, or a *bonus* token
drawn from the target's last row when all k were accepted. Each iteration therefore yields n + 1 tokens.

Sampled verification is the rule of Leviathan et al. 2023 and Chen et al. 2023: accept draft token x with
probability min(1, p(x) / q(x)); on rejection draw from norm(max(0, p - q)). The emitted tokens then follow the
target's distribution p exactly, whatever the draft's q.

The sampled and synthetic rules return device tensors and never synchronise: the caller reads (n, token) in one
transfer. The greedy rule compares on the host, after that transfer has brought back the target's argmaxes.
"""

from __future__ import annotations

import torch

from tandem.sampling import picked


def verify_greedy(draft_tokens: list[int], target_tokens: list[int]) -> tuple[int, list[int]]:
    """The longest prefix of the drafts that the target's argmax at each row agrees with, then the target's own
    token after it (on the host: the engine reads every greedy row's argmax back in one transfer).

    Args:
        draft_tokens: the k proposed tokens.
        target_tokens: the target's argmax at the pending token and at each draft: k + 1 of them.
    Returns:
        (n_accepted, the tokens this iteration emits: the accepted drafts and the target's token after them).
    """
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_tokens[n]:
        n += 1
    return n, draft_tokens[:n] + [target_tokens[n]]


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of k draft tokens against the target.

    Args:
        draft_tokens: [k] int64, drawn from draft_probs.
        draft_probs: [k, V] the distribution each draft token was drawn from; None for a deterministic proposer
            (n-gram lookup), whose q is one-hot on its token.
        target_probs: [k+1, V] the target's (transformed) distribution at every position.
        generator: the request's generator, on target_probs' device.
    Returns:
        (n_accepted [] int64, next_token [] int64): the recovered or bonus token.
    """
    k, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    rows = torch.arange(k, device=target_probs.device)
    if draft_probs is None:
        draft_probs = torch.zeros(k, vocab, dtype=target_probs.dtype, device=target_probs.device)
        draft_probs[rows, draft_tokens] = 1.0
    p_draft = target_probs[rows, draft_tokens]  # [k] p(x_i)
    q_draft = draft_probs[rows, draft_tokens]  # [k] q(x_i) > 0, since x_i was drawn from q
    u = torch.rand(k, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    # u < p/q, written without the division so q's rounding can't turn a certain accept into a reject.
    accepted = u * q_draft < p_draft
    n_accepted = torch.cumprod(accepted.long(), dim=0).sum()

    # Candidates for every outcome at once, so choosing one needs no host sync: the residual after a rejection at
    # row i (i < k), or the target's last row (bonus) when all k were accepted.
    residual = (target_probs[:k] - draft_probs).clamp_min(0.0)  # [k, V]
    mass = residual.sum(dim=-1, keepdim=True)
    # mass == 0 means p == q on that row, where rejection has probability 0; any valid row avoids a 0/0.
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), target_probs[:k])
    candidates = torch.cat([residual, target_probs[k:]], dim=0)  # [k+1, V]
    next_token = torch.multinomial(candidates[n_accepted], 1, generator=generator).squeeze(-1)
    return n_accepted, next_token


def verify_synthetic(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, rate: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Benchmarks only, NOT lossless: accept each draft position with probability `rate` (like llama.cpp's
    --spec-synth-rates), whatever the tokens are, so the systems cost of a given acceptance can be measured
    with random-weight models. The next token is the target's argmax at the first rejected position."""
    k = draft_tokens.shape[0]
    u = torch.rand(k, generator=generator, device=target_logits.device)
    n_accepted = torch.cumprod((u < rate).long(), dim=0).sum()
    return n_accepted, picked(target_logits)[n_accepted]


def verify_synthetic_picked(drafts: list[int], target_tokens: torch.Tensor, rate: float,
                            generator: torch.Generator | None) -> tuple[int, list[int]]:
    """verify_synthetic where the target's tokens were picked on the host (a llama.cpp backend's greedy rows, [k + 1]
    int64 on the CPU): the same draws and outcome, as (accepted drafts, new tokens), in Python rather than the
    handful of tensor operations that cost a step 0.1-0.2 ms on a host whose caches the forwards evict."""
    draws = torch.rand(len(drafts), generator=generator).tolist()
    n_accepted = next((i for i, u in enumerate(draws) if u >= rate), len(drafts))
    return n_accepted, list(drafts[:n_accepted]) + [int(target_tokens[n_accepted])]

