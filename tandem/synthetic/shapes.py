"""Random-weight models of named real shapes, built directly on the device: systems benchmarks without the files.
More: docs/internals.md."""

from __future__ import annotations

from dataclasses import replace

import torch

from tandem.config import ModelConfig

WEIGHT_STD = 0.02  # like a freshly initialised transformer: activations stay finite through 64 layers in bf16
QWEN_EPS = 1e-6
QWEN_ROPE_BASE = 1_000_000.0
QWEN_CONTEXT = 32768


def _qwen2(name: str, n_layers: int, d_model: int, d_ffn: int, n_heads: int, n_kv_heads: int, vocab_size: int,
           tied: bool) -> ModelConfig:
    return ModelConfig(
        architecture="qwen2", vocab_size=vocab_size, n_layers=n_layers, d_model=d_model, d_ffn=d_ffn,
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=d_model // n_heads, context_length=QWEN_CONTEXT,
        rms_eps=QWEN_EPS, rope_base=QWEN_ROPE_BASE, qkv_bias=True, tied_embeddings=tied, name=name,
    )


SHAPES: dict[str, ModelConfig] = {
    "qwen2.5-32b": _qwen2("qwen2.5-32b", 64, 5120, 27648, 40, 8, 152064, tied=False),
    "qwen2.5-14b": _qwen2("qwen2.5-14b", 48, 5120, 13824, 40, 8, 152064, tied=False),
    "qwen2.5-7b": _qwen2("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, tied=False),
    "qwen2.5-3b": _qwen2("qwen2.5-3b", 36, 2048, 11008, 16, 2, 151936, tied=True),
    "qwen2.5-1.5b": _qwen2("qwen2.5-1.5b", 28, 1536, 8960, 12, 2, 151936, tied=True),
    "qwen2.5-0.5b": _qwen2("qwen2.5-0.5b", 24, 896, 4864, 14, 2, 151936, tied=True),
    # The Coder models share their base models' shapes; named too, since the real pair is a Coder pair.
    "qwen2.5-coder-1.5b": _qwen2("qwen2.5-coder-1.5b", 28, 1536, 8960, 12, 2, 151936, tied=True),
    "qwen2.5-coder-0.5b": _qwen2("qwen2.5-coder-0.5b", 24, 896, 4864, 14, 2, 151936, tied=True),
    # For tests: milliseconds on a CPU. The vocabulary must hold the tiny tokenizer's ~310 ids.
    "tiny": replace(_qwen2("tiny", 2, 64, 128, 4, 2, 512, tied=False), context_length=4096),
    "tiny-draft": replace(_qwen2("tiny-draft", 1, 32, 64, 2, 1, 512, tied=False), context_length=4096),
}


def get_shape(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic shape {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]


SHAPE_OVERRIDES = ("n_layers", "d_model", "d_ffn", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
                   "context_length")


def parse_shape(spec: str) -> ModelConfig:
    """A named shape, optionally with dimensions replaced: "qwen2.5-0.5b" or "qwen2.5-0.5b:n_layers=4,d_ffn=1024"
    (a small model with the real vocabulary, say, for a CPU run of a GPU benchmark). Setting d_model or n_heads
    alone keeps head_dim = d_model / n_heads."""
    name, _, overrides = spec.partition(":")
    config = get_shape(name.strip())
    if not overrides:
        return config
    values: dict[str, int] = {}
    for item in overrides.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in SHAPE_OVERRIDES:
            raise ValueError(f"bad shape override {item!r} in {spec!r}; use KEY=INT with KEY one of "
                             f"{', '.join(SHAPE_OVERRIDES)}")
        values[key] = int(value)
    if "head_dim" not in values and ("d_model" in values or "n_heads" in values):
        values["head_dim"] = values.get("d_model", config.d_model) // values.get("n_heads", config.n_heads)
    return replace(config, **values, name=spec)


def tiny_tokenizer(vocab_size: int):
    """The tiny test tokenizer (tandem.synthetic.tiny_gguf), built in memory: encodes any text to ids < ~310."""
    from tandem.loading.tokenizer import CHATML_TEMPLATE, Tokenizer, _build_backend
    from tandem.synthetic.tiny_gguf import tiny_vocab

    tokens, types, merges = tiny_vocab()
    if vocab_size < len(tokens):
        raise ValueError(f"a synthetic shape needs vocab_size >= {len(tokens)} (the tiny tokenizer), got {vocab_size}")
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    backend = _build_backend("qwen2", metadata, "<synthetic>")
    endoftext, im_end = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    return Tokenizer(backend, bos_token_id=endoftext, eos_token_ids=(im_end,), add_bos=False,
                     chat_template=CHATML_TEMPLATE)


def random_model(shape: str | ModelConfig, device: str = "cpu", dtype: str | torch.dtype = "bfloat16",
                 n_ctx: int = 4096, seed: int = 0):
    """A TorchModel of `shape` (a SHAPES name or a ModelConfig) with random weights (std WEIGHT_STD, norms 1)
    drawn on `device` (bf16 32B: ~65 GB); the same seed builds the same weights. Its path is "synthetic:<name>",
    its tokenizer the tiny test one."""
    from tandem.backends.torch_backend import TorchModel, parse_device, parse_dtype
    from tandem.loading.weights import expected_tensors

    config = get_shape(shape) if isinstance(shape, str) else shape
    torch_device, torch_dtype = parse_device(device), parse_dtype(dtype)
    generator = torch.Generator(device=torch_device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    # expected_tensors lists embeddings, then layer by layer: each tensor is drawn in place on the device.
    for name, tensor_shape in expected_tensors(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(tensor_shape, dtype=torch_dtype, device=torch_device)
        else:
            w = torch.empty(tensor_shape, dtype=torch_dtype, device=torch_device)
            weights[name] = w.normal_(0.0, WEIGHT_STD, generator=generator)
    n_ctx = min(n_ctx, config.context_length)
    return TorchModel(config, weights, tiny_tokenizer(config.vocab_size), path=f"synthetic:{config.name}",
                      n_ctx=n_ctx)


def weight_bytes(model) -> int:
    """Bytes of weights one step streams: the torch backend's tensors, or the GGUF file for llama.cpp."""
    import os

    transformer = getattr(model, "transformer", None)
    if transformer is not None:
        seen = {id(t): t for t in transformer.w.values()}  # tied embeddings counted once
        return sum(t.numel() * t.element_size() for t in seen.values())
    path = getattr(model, "path", "")
    return os.path.getsize(path) if path and os.path.exists(path) else 0
