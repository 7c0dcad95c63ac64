"""The tensors a config needs, by GGUF name and torch shape, and a strict loader for them.
More: docs/internals.md."""

from __future__ import annotations

import os
import sys

import torch

from tandem.config import LLAMACPP_ONLY_ARCHITECTURES, ModelConfig
from tandem.loading.gguf import GGUFError, GGUFFile, dequantiser
from tandem.loading.progress import name_of, report


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `config` requires: GGUF name -> torch shape."""
    d, vocab, ffn, hd = config.d_model, config.vocab_size, config.d_ffn, config.head_dim
    q_width, kv_width = config.n_heads * hd, config.n_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    if not config.tied_embeddings:
        shapes["output.weight"] = (vocab, d)
    for i in range(config.n_layers):
        p = f"blk.{i}."
        shapes[p + "attn_norm.weight"] = (d,)
        shapes[p + "attn_q.weight"] = (q_width, d)
        shapes[p + "attn_k.weight"] = (kv_width, d)
        shapes[p + "attn_v.weight"] = (kv_width, d)
        shapes[p + "attn_output.weight"] = (d, q_width)
        if config.qkv_bias:
            shapes[p + "attn_q.bias"] = (q_width,)
            shapes[p + "attn_k.bias"] = (kv_width,)
            shapes[p + "attn_v.bias"] = (kv_width,)
        if config.qk_norm:
            shapes[p + "attn_q_norm.weight"] = (hd,)
            shapes[p + "attn_k_norm.weight"] = (hd,)
        if config.sandwich_norm:
            shapes[p + "post_attention_norm.weight"] = (d,)
            shapes[p + "post_ffw_norm.weight"] = (d,)
        shapes[p + "ffn_norm.weight"] = (d,)
        shapes[p + "ffn_gate.weight"] = (ffn, d)
        shapes[p + "ffn_up.weight"] = (ffn, d)
        shapes[p + "ffn_down.weight"] = (d, ffn)
    return shapes


def check_tensors(gguf_file: GGUFFile, config: ModelConfig | None = None) -> dict[str, tuple[int, ...]]:
    """Raise GGUFError unless every expected tensor is present with its exact shape; return the expectations."""
    config = config or gguf_file.config
    if config.architecture in LLAMACPP_ONLY_ARCHITECTURES:
        raise GGUFError(
            f"{gguf_file.path}: architecture {config.architecture!r} runs on the llama.cpp backend only "
            "(backend='llama.cpp', CLI: --backend llama.cpp); the torch backend has no model for it"
        )
    expected = expected_tensors(config)
    missing = [name for name in expected if not gguf_file.has_tensor(name)]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise GGUFError(f"{gguf_file.path}: missing tensor {shown}")
    for name, shape in expected.items():
        found = gguf_file.tensor_shape(name)
        if found != shape:
            raise GGUFError(f"{gguf_file.path}: tensor {name!r} has shape {list(found)}, expected {list(shape)}")
    return expected


LOAD_THREADS = 8


def load_weights(
    gguf_file: GGUFFile,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Every expected tensor, dequantised and cast to `dtype` on `device`, keyed by GGUF name.

    Shapes are checked for all tensors before any is dequantised, so a bad file fails in milliseconds.
    """
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    expected = check_tensors(gguf_file)
    bar = tqdm(total=len(expected), desc="loading weights", unit="tensor",
               disable=not progress or not sys.stderr.isatty())
    where = "" if torch.device(device).type == "cpu" else f" onto {device}"
    what = f"dequantising {name_of(gguf_file.path)}{where} by {dequantiser()}"
    report(what, 0, len(expected))

    def load_one(name: str) -> torch.Tensor:
        tensor = gguf_file.tensor(name, dtype=dtype, device=device)
        bar.update(1)
        return tensor

    # The dequantisers (llama.cpp's C through ctypes, or gguf-py's numpy) release the GIL: a few threads divide the
    # load time, and a small pool keeps peak memory at a few slabs. Reports go from this thread (see progress).
    workers = max(1, min(LOAD_THREADS, os.cpu_count() or 1))
    weights = {}
    with ThreadPoolExecutor(workers) as pool:
        for name, tensor in zip(expected, pool.map(load_one, expected), strict=True):
            weights[name] = tensor
            report(what, len(weights), len(expected))
    bar.close()
    return weights
