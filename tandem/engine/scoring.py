"""Log-probabilities: a prompt's own (what `echo` with `logprobs` returns: each token scored by the model given the
tokens before it, in chunks so a long prompt never holds [prompt, vocab] logits at once), and a decode iteration's
emitted tokens (score_rows on the device, token_logprobs after the read-back)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tandem.backends.base import Model
from tandem.engine.generation import TokenLogprob

SCORE_CHUNK = 256  # prompt tokens a forward: [256, 152k] float32 logits are 155 MB


def prompt_logprobs(model: Model, ids: Seq[int], top: int, chunk: int = SCORE_CHUNK) -> list[TokenLogprob]:
    """For each prompt token, its log-probability given the tokens before it and the `top` likeliest tokens at its
    position; the first token, which nothing predicts, has logprob None (OpenAI's echo shows null there).

    Raw log-softmax of the logits (TokenLogprob's convention), from a fresh sequence: nothing else is touched.
    """
    if not ids:
        return []
    out = [TokenLogprob(ids[0], None)]
    seq = model.new_sequence(len(ids))
    try:
        for start in range(0, len(ids), chunk):
            piece = list(ids[start:start + chunk])
            logits = seq.forward(piece, logits="all")  # [T, V]: row r predicts ids[start + r + 1]
            targets = list(ids[start + 1:start + 1 + len(piece)])
            if not targets:
                break
            dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
            logprobs = torch.log_softmax(logits[:len(targets)].to(dtype), dim=-1)  # [T', V]
            chosen = logprobs[torch.arange(len(targets), device=logprobs.device),
                              torch.tensor(targets, device=logprobs.device)].tolist()
            best = logprobs.topk(top, dim=-1) if top else None
            values = best.values.tolist() if best is not None else [[] for _ in targets]
            indices = best.indices.tolist() if best is not None else [[] for _ in targets]
            out += [TokenLogprob(t, v, list(zip(i, tv, strict=True)))
                    for t, v, i, tv in zip(targets, chosen, indices, values, strict=True)]
    finally:
        seq.close()
    return out


def score_rows(logits: torch.Tensor, draft_tokens: torch.Tensor, token: torch.Tensor | None,
               top: int) -> list[torch.Tensor]:
    """Log-probabilities an iteration may need for its emitted tokens (see TokenLogprob), on the device: each
    draft token's at its row, the target's own token's at every row (where it lands depends on how many drafts are
    accepted, known only after the host sync), and the `top` likeliest at every row.
    logits: [k+1, V]; draft_tokens: [k]; token: [] the recovered or bonus token, or [k+1] each row's (None: greedy,
    each row's argmax)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logprobs = torch.log_softmax(logits.to(dtype), dim=-1)  # [k+1, V]
    k = draft_tokens.shape[0]
    drafted = logprobs[torch.arange(k, device=logits.device), draft_tokens]  # [k]
    best = logprobs.topk(top, dim=-1) if top else None
    if token is None:
        own = logprobs.amax(dim=-1)
    else:  # one token for every row, or each row's own (a greedy choice over adjusted logits)
        own = logprobs.gather(-1, token.expand(logprobs.shape[0]).unsqueeze(-1)).squeeze(-1)
    return [drafted, own, best.values if best else logprobs[:, :0], best.indices if best else
            torch.empty(logprobs.shape[0], 0, dtype=torch.long, device=logits.device)]


def token_logprobs(new_tokens: list[int], scored: list) -> list[TokenLogprob]:
    """The emitted tokens' log-probabilities from score_rows' (read back) output: drafts for the accepted rows,
    then the target's own token at the row after them."""
    drafted, own, top_values, top_tokens = scored
    n = len(new_tokens) - 1  # accepted drafts
    values = drafted[:n] + [own[n]]
    return [TokenLogprob(t, v, list(zip(top_tokens[r], top_values[r], strict=True)))
            for r, (t, v) in enumerate(zip(new_tokens, values, strict=True))]
