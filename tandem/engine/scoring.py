"""A prompt's own log-probabilities (what `echo` with `logprobs` returns): each token scored by the model given the
tokens before it, in chunks so a long prompt never holds [prompt, vocab] logits at once."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tandem.backends.base import Model
from tandem.engine.sequence import TokenLogprob

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
