"""Logits adjustments as pure tensor functions: a bias per token id, OpenAI's frequency and presence penalties,
llama.cpp's repeat penalty, and a grammar's allowed-token bitmask. The engine applies them, in this order, to the
rows it samples or takes the argmax of, and to the rows its verifier reads (tandem.logits.processor says which
tokens each row counts); sampling's temperature, top-k/p and min-p then act on the adjusted logits.
"""

from __future__ import annotations

import math

import numpy as np
import torch

BITS = 32  # tokens a word of the bitmask covers (xgrammar's and llguidance's layout: bit i of word w = token 32w+i)


def apply_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """OpenAI's logit_bias: values added to the logits of ids. logits: [N, V]; ids, values: [B]."""
    return logits.index_add(-1, ids, values.to(logits.dtype).expand(logits.shape[0], -1))


def apply_frequency_presence(logits: torch.Tensor, counts: torch.Tensor, frequency: float,
                             presence: float) -> torch.Tensor:
    """OpenAI's penalties: logit[t] -= counts[t] * frequency + (counts[t] > 0) * presence.
    logits: [N, V]; counts: [N, V] how often each token occurs in what the row follows."""
    penalty = counts * frequency + (counts > 0).to(counts.dtype) * presence
    return logits - penalty.to(logits.dtype)


def apply_repeat_penalty(logits: torch.Tensor, ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """llama.cpp's (and CTRL's) repeat penalty on the tokens of the recent window: a positive logit divided by
    `penalty`, a negative one multiplied, so both move towards less likely (once per token, however often it
    occurs). logits: [N, V]; ids: [N, n] each row's window (repeats allowed)."""
    picked = logits.gather(-1, ids)
    return logits.scatter(-1, ids, torch.where(picked > 0, picked / penalty, picked * penalty))


def _unpack_numpy(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    """[N, vocab] uint8 (0 or 1) of CPU words: numpy's unpackbits, ~50x torch's shifts on a 152k vocabulary."""
    return np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab]


def unpack_bitmask_torch(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, W] int32 words -> [N, vocab] bool, True where the token is allowed, in torch ops (words on an
    accelerator)."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Forbidden tokens' logits set to -inf. logits: [N, V]; bitmask: [N, W] int32 words on the CPU, W * 32 >= V
    (a narrower draft's rows read the first V bits)."""
    vocab = logits.shape[-1]
    if logits.device.type != "cpu":  # upload the words (V/8 bytes), unpack on the device
        allowed = unpack_bitmask_torch(bitmask.to(logits.device, non_blocking=True), vocab)
        return logits.masked_fill(~allowed, -math.inf)
    # On the CPU in numpy, single-threaded: a minimum with a ceiling of +inf (allowed) / -inf (not), built from
    # uint8. torch's masked_fill with a scattered boolean mask and its bool -> float conversion each cost ~0.5 ms for
    # 152k tokens, and every torch op here waits on its OpenMP threads when the cores are shared (10x, seen here).
    ceiling = _unpack_numpy(bitmask, vocab).astype(np.float64 if logits.dtype == torch.float64 else np.float32)
    ceiling *= 2
    ceiling -= 1
    ceiling *= np.inf
    if logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.minimum(logits.numpy(), ceiling))
    return torch.minimum(logits, torch.from_numpy(ceiling).to(logits.dtype))
