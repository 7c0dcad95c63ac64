"""The llama.cpp backend's settings and sizes that need neither llama.cpp nor torch loaded (the worker process's
parent reads them; so do the in-process backend and the worker)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.config import ModelConfig

DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512  # prefill chunk: the most tokens one llama_decode call takes (a multiple of 4: KERNELS)
DRAFT_N_BATCH = 32  # enough for a draft's prefill chunks and any k + 1; smaller compute buffers
Q8_BLOCK = 32  # values a Q8_0 block holds: it must divide every head width for a Q8_0 KV cache


def kv_q8_ok(config: ModelConfig) -> bool:
    """Whether a Q8_0 KV cache fits the model's heads: its blocks must divide a head (gemma4: both head widths)."""
    head_dims = (config.head_dim, config.global_head_dim or config.head_dim)
    return all(d % Q8_BLOCK == 0 for d in head_dims)


def kv_bytes_per_token(config: ModelConfig, kv_q8: bool) -> int:
    c = config  # gemma4: an upper bound (its widest heads and most KV heads on every layer)
    values = 2 * c.n_layers * c.n_kv_heads * max(c.head_dim, c.global_head_dim or 0)
    return values * 34 // 32 if kv_q8 else values * 2  # Q8_0: 34 bytes a block of 32; else F16


def captures_graphs(device: str) -> bool:
    """Whether llama.cpp replays a context's step as a CUDA graph: only while consecutive llama_decode calls have
    one shape (ggml-cuda's graph warm-up; a context keeps one graph). A call of another shape runs uncaptured, one
    launch a kernel, and the next same-shaped call captures again: a 1.5B draft alternating 2-row catch-ups with
    1-row steps cost 3.6-4.2 ms a step on an H200 where a replayed step costs 1.9 (h200-2026-12-05-regime)."""
    return device.split(":")[0].lower() == "cuda"
