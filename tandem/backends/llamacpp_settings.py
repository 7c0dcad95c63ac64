"""The llama.cpp backend's settings and sizes that need neither llama.cpp nor torch loaded (the worker process's
parent reads them; so do the in-process backend and the worker)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.config import ModelConfig

DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512  # prefill chunk: the most tokens one llama_decode call takes (a multiple of 4: KERNELS)
DRAFT_N_BATCH = 32  # enough for a draft's prefill chunks and any k + 1; smaller compute buffers
Q8_BLOCK = 32  # values a Q8_0 block holds: it must divide every head width for a Q8_0 K cache


def k_q8_ok(config: ModelConfig) -> bool:
    """Whether a Q8_0 K cache fits the model's heads: its blocks must divide a head (gemma4: both head widths)."""
    head_dims = (config.head_dim, config.global_head_dim or config.head_dim)
    return all(d % Q8_BLOCK == 0 for d in head_dims)


def kv_bytes_per_token(config: ModelConfig, k_q8: bool) -> int:
    c = config  # gemma4: an upper bound (its widest heads and most KV heads on every layer)
    values = c.n_layers * c.n_kv_heads * max(c.head_dim, c.global_head_dim or 0)  # of K, and as many of V
    return (values * 34 // 32 if k_q8 else values * 2) + values * 2  # Q8_0: 34 bytes a block of 32; F16: 2 a value


def launches_asynchronously(device: str) -> bool:
    """Whether llama_decode returns once the device has the forward, before it has run it (a GPU: the logits' read
    waits for it), so that another context's forward launched before that read runs on the device beside it."""
    return device.split(":")[0].lower() != "cpu"


def steady_shapes(device: str) -> bool:
    """Whether a draft should keep its forwards' shape steady (one row a sequence a forward, a 2-token catch-up in
    two forwards) on this device: llama.cpp rebuilds a context's graph when a forward's shape differs from the one
    before (and CUDA re-captures it), which on a GPU costs about a draft step; on a CPU the rebuild is a small part
    of a step, where a forward more costs the whole step (docs/decisions/0007)."""
    return device.split(":")[0].lower() != "cpu"
