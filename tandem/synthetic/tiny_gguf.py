"""Tiny GGUF files with random weights, for tests (and random models of real shapes).
More: docs/internals.md."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

# Merges applied in this order (rank); each result becomes a token. Spelled in gpt2's byte-level alphabet
# (Ġ is the space byte), and every part is a byte symbol or an earlier merge's result.
TINY_MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġt", "he"),
    ("r", "e"),
    ("Ġ", "s"),
    ("a", "t"),
    ("o", "r"),
    ("e", "n"),
    ("Ġ", "w"),
    ("Ġ", "c"),
    ("i", "s"),
    ("i", "t"),
    ("Ġ", "o"),
    ("e", "s"),
    ("Ġ", "f"),
    ("a", "n"),
    ("Ġ", "b"),
    ("in", "g"),
    ("Ġ", "p"),
    ("Ġ", "i"),
    ("e", "d"),
    ("Ġ", "d"),
    ("o", "u"),
    ("l", "l"),
    ("Ġ", "m"),
    ("a", "r"),
    ("Ġ", "h"),
    ("Ġ", "Ġ"),
    ("ĠĠ", "ĠĠ"),
    ("Ġa", "n"),
    ("Ġan", "d"),
    ("Ġo", "f"),
    ("Ġt", "o"),
    ("Ġ", "in"),
    ("d", "e"),
    ("de", "f"),
    ("Ġ", "def"),
    ("r", "n"),
    ("u", "rn"),
    ("Ġ", "re"),
    ("Ġre", "t"),
    ("Ġret", "urn"),
    ("Ġ", "="),
    ("Ġ", "("),
    ("(", ")"),
    (")", ":"),
    ("Ċ", "ĠĠĠĠ"),
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNUSED = 1, 3, 5

# llama.cpp's `general.file_type` (LlamaFileType) for a file whose matrices are all `qtype`.
FILE_TYPE = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q3_K": 12,
    "Q4_K": 15,
    "Q5_K": 17,
    "Q6_K": 18,
    "BF16": 32,
}
SUPPORTED_QTYPES = tuple(FILE_TYPE)

from tandem.loading.tokenizer import CHATML_TEMPLATE  # noqa: E402  (the tiny files' chat template)
from tandem.synthetic import gemma4  # noqa: E402
from tandem.synthetic.gemma4 import tiny_gemma4_vocab  # noqa: E402
from tandem.synthetic.random_blocks import K_QUANTS, set_scales  # noqa: E402


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny byte-level BPE, specials last."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())  # the 256 byte symbols
    known = set(tokens)
    merges = []
    for left, right in TINY_MERGES:
        if left not in known or right not in known:
            raise AssertionError(f"merge {left!r} + {right!r} uses a token not yet in the vocabulary")
        if left + right not in known:
            tokens.append(left + right)
            known.add(left + right)
        merges.append(f"{left} {right}")
    types = [TOKEN_TYPE_NORMAL] * len(tokens)
    tokens += SPECIAL_TOKENS
    types += [TOKEN_TYPE_CONTROL] * len(SPECIAL_TOKENS)
    return tokens, types, merges


def _random_k_blocks(rows: int, cols: int, qtype: str, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random but valid K-quant blocks [rows, row_bytes] whose values have ~zero mean and ~`std` spread."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, size=(rows * cols // block, type_size), dtype=np.uint8)
    set_scales(blocks, qtype, std, signs=False)
    return blocks.reshape(rows, -1)


def _encode_matrix(values: np.ndarray, qtype: str, std: float, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    """(array for GGUFWriter.add_tensor, raw_dtype) for a float32 matrix stored as `qtype`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    if qtype == "F32":
        return values.astype(np.float32), None
    if qtype == "F16":
        return values.astype(np.float16), None
    if qtype == "F64":  # not runnable by tandem; used to test the unsupported-type error
        return values.astype(np.float64), None
    gtype = GGMLQuantizationType[qtype]
    block = GGML_QUANT_SIZES[gtype][0]
    if values.shape[-1] % block:
        raise ValueError(
            f"{qtype} needs rows that are a multiple of {block} values; got a row of {values.shape[-1]} "
            f"(pick d_model/d_ffn/n_heads*head_dim multiples of {block}, e.g. d_model=256)"
        )
    if qtype in K_QUANTS:
        return _random_k_blocks(values.shape[0], values.shape[1], qtype, std, rng), gtype
    return quantize(values.astype(np.float32), gtype), gtype


def _value_type(value: Any) -> Any:
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.INT32 if value < 0 else GGUFValueType.UINT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, (list, tuple)):
        return GGUFValueType.ARRAY
    raise TypeError(f"cannot store metadata value {value!r} of type {type(value).__name__} in GGUF")


def architecture_kv(arch: str, context_length: int, d_model: int, d_ffn: int, n_layers: int, n_heads: int,
                    n_kv_heads: int, rms_eps: float, rope_base: float, head_dim: int) -> dict[str, Any]:
    """The `{arch}.*` hyperparameter keys llama.cpp reads for a transformer of these dimensions."""
    return {
        f"{arch}.context_length": context_length,
        f"{arch}.embedding_length": d_model,
        f"{arch}.feed_forward_length": d_ffn,
        f"{arch}.block_count": n_layers,
        f"{arch}.attention.head_count": n_heads,
        f"{arch}.attention.head_count_kv": n_kv_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(rms_eps),
        f"{arch}.rope.freq_base": float(rope_base),
        f"{arch}.rope.dimension_count": head_dim,
    }


TensorSpec = tuple[str, tuple[int, ...], str]  # (GGUF name, torch shape, kind: matrix | norm | bias | ...)


def tensor_specs(arch: str, n_layers: int, d_model: int, d_ffn: int, n_heads: int, n_kv_heads: int,
                  head_dim: int, vocab_size: int, qkv_bias: bool, tie_embeddings: bool) -> list[TensorSpec]:
    """(name, torch shape, kind) of every tensor of a qwen2/llama/gemma3 file."""
    q_width, kv_width = n_heads * head_dim, n_kv_heads * head_dim
    specs: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab_size, d_model), "matrix")]
    for i in range(n_layers):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (d_model,), "norm"),
            (p + "attn_q.weight", (q_width, d_model), "matrix"),
            (p + "attn_k.weight", (kv_width, d_model), "matrix"),
            (p + "attn_v.weight", (kv_width, d_model), "matrix"),
            (p + "attn_output.weight", (d_model, q_width), "matrix"),
        ]
        if qkv_bias:
            specs += [
                (p + "attn_q.bias", (q_width,), "bias"),
                (p + "attn_k.bias", (kv_width,), "bias"),
                (p + "attn_v.bias", (kv_width,), "bias"),
            ]
        if arch == "gemma3":
            specs += [
                (p + "attn_q_norm.weight", (head_dim,), "norm"),
                (p + "attn_k_norm.weight", (head_dim,), "norm"),
                (p + "post_attention_norm.weight", (d_model,), "norm"),
                (p + "post_ffw_norm.weight", (d_model,), "norm"),
            ]
        specs += [
            (p + "ffn_norm.weight", (d_model,), "norm"),
            (p + "ffn_gate.weight", (d_ffn, d_model), "matrix"),
            (p + "ffn_up.weight", (d_ffn, d_model), "matrix"),
            (p + "ffn_down.weight", (d_model, d_ffn), "matrix"),
        ]
    specs.append(("output_norm.weight", (d_model,), "norm"))
    if not tie_embeddings:
        specs.append(("output.weight", (vocab_size, d_model), "matrix"))
    return specs


def write_tiny_gguf(
    path: str | os.PathLike[str],
    arch: str = "qwen2",
    qtype: str = "F32",
    n_layers: int = 2,
    d_model: int = 64,
    d_ffn: int = 128,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    context_length: int = 512,
    seed: int = 0,
    tie_embeddings: bool = False,
    *,
    qkv_bias: bool | None = None,
    rope_base: float | None = None,
    rms_eps: float = 1e-6,
    sliding_window: int = 8,
    metadata: dict[str, Any] | None = None,
    tensor_qtypes: dict[str, str] | None = None,
    skip_tensors: Iterable[str] = (),
    shape_overrides: dict[str, tuple[int, ...]] | None = None,
    layout: str = "dense",
) -> str:
    """Write a random-weight GGUF for `arch` and return its path.

    Args:
        qtype: storage type of the 2-D matrices (one of SUPPORTED_QTYPES); norms and biases stay F32.
        head_dim: per-head width; default d_model // n_heads (gemma3 writes it as attention.key_length); gemma4:
            the sliding-window layers' width, default 32 (full-attention layers get twice that).
        vocab_size: default the tiny tokenizer's size; larger pads with unused `[PADn]` tokens.
        qkv_bias: q/k/v biases; default on for qwen2 only.
        metadata: raw metadata keys to add or replace (a value of None deletes the key).
        tensor_qtypes, skip_tensors, shape_overrides: per-tensor storage type, tensors to leave out, and
            shapes to write instead of the correct ones (for testing the loader's errors).
        layout: gemma4 only: "dense" (the 31B's tensors) or "e2b" (per-layer embeddings, shared KV layers);
            see tandem.synthetic.gemma4.
    """

    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"unsupported qtype {qtype!r}; supported: {', '.join(SUPPORTED_QTYPES)}")
    path = os.fspath(path)
    rng = np.random.default_rng(seed)
    head_dim = head_dim or (32 if arch == "gemma4" else d_model // n_heads)
    qkv_bias = (arch == "qwen2") if qkv_bias is None else qkv_bias
    rope_base = rope_base if rope_base is not None else (10000.0 if arch == "llama" else 1_000_000.0)

    tokens, types, merges = tiny_gemma4_vocab(TINY_MERGES) if arch == "gemma4" else tiny_vocab()
    n_real = len(tokens)
    vocab_size = vocab_size or n_real
    if vocab_size < n_real:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tiny tokenizer's {n_real} tokens")
    tokens += [f"[PAD{i}]" for i in range(n_real, vocab_size)]
    types += [TOKEN_TYPE_UNUSED] * (vocab_size - n_real)
    if arch == "gemma4":
        tokenizer_kv: dict[str, Any] = gemma4.tokenizer_kv()
    else:
        endoftext, im_end = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
        tokenizer_kv = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.bos_token_id": endoftext,
            "tokenizer.ggml.eos_token_id": im_end,
            "tokenizer.ggml.padding_token_id": endoftext,
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": CHATML_TEMPLATE,
        }

    a = arch
    kv: dict[str, Any] = {
        "general.name": f"tiny-{arch}-{qtype.lower()}",
        "general.file_type": FILE_TYPE.get(qtype, 0),
        "general.quantization_version": 2,
        **architecture_kv(arch, context_length, d_model, d_ffn, n_layers, n_heads, n_kv_heads, rms_eps, rope_base,
                          head_dim),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        **tokenizer_kv,
    }
    if arch == "gemma3" or head_dim != d_model // n_heads:
        kv[f"{a}.attention.key_length"] = head_dim
        kv[f"{a}.attention.value_length"] = head_dim
    if arch == "gemma3":
        kv[f"{a}.attention.sliding_window"] = sliding_window
    if arch == "llama":
        kv[f"{a}.vocab_size"] = vocab_size
    if arch == "gemma4":
        gemma4_kv, gemma4_specs = gemma4.gemma4_layout(
            layout, n_layers=n_layers, d_model=d_model, d_ffn=d_ffn, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, vocab_size=vocab_size, rope_base=rope_base, sliding_window=sliding_window,
            tie_embeddings=tie_embeddings,
        )
        for key in ("feed_forward_length", "attention.head_count_kv", "rope.dimension_count"):
            kv.pop(f"{a}.{key}")
        kv.update(gemma4_kv)
    # --- tensors: torch-order shapes, same names as tandem.loading.weights.expected_tensors --------------------
    if arch == "gemma4":
        specs = gemma4_specs
    else:
        specs = tensor_specs(arch, n_layers, d_model, d_ffn, n_heads, n_kv_heads, head_dim, vocab_size, qkv_bias,
                              tie_embeddings)
    skip, shape_overrides = set(skip_tensors), shape_overrides or {}
    specs = [(name, tuple(shape_overrides.get(name, shape)), kind) for name, shape, kind in specs if name not in skip]
    return write_gguf(path, arch, kv, specs, qtype, rng, metadata, tensor_qtypes)


def write_gguf(path: str, arch: str, kv: dict[str, Any], specs: Iterable[tuple[str, tuple[int, ...], str]],
               qtype: str, rng: np.random.Generator, metadata: dict[str, Any] | None = None,
               tensor_qtypes: dict[str, str] | None = None, arrays: dict[str, np.ndarray] | None = None) -> str:
    """A GGUF of `kv` (metadata: keys to add or replace, None deletes one) and random tensors of `specs` (name,
    shape, kind: "norm", "bias", "rope_freqs", "scale" or a matrix stored as qtype, or tensor_qtypes[name]), drawn
    from rng in their order, then `arrays` as given (an EAGLE-3 head's d2t map); the writer of every synthetic
    file. Returns path."""
    from gguf import GGUFWriter

    kv = dict(kv)
    for key, value in (metadata or {}).items():
        if value is None:
            kv.pop(key, None)
        else:
            kv[key] = value
    writer = GGUFWriter(path, arch)
    for key, value in kv.items():
        if isinstance(value, (list, tuple)):
            writer.add_array(key, list(value))
        else:
            writer.add_key_value(key, value, _value_type(value))
    tensor_qtypes = tensor_qtypes or {}
    for name, shape, kind in specs:
        if kind == "norm":  # norms near 1 (for gemma3 this is the 1 + w llama.cpp's converter already folds in)
            writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        if kind in ("rope_freqs", "scale"):
            writer.add_tensor(name, gemma4.special_tensor(kind, shape, rng))
            continue
        if kind == "bias":
            writer.add_tensor(name, (0.02 * rng.standard_normal(shape)).astype(np.float32))
            continue
        std = 0.1 if name == "token_embd.weight" else min(0.1, 1.0 / math.sqrt(shape[-1]))
        values = (std * rng.standard_normal(shape)).astype(np.float32)
        array, raw_dtype = _encode_matrix(values, tensor_qtypes.get(name, qtype), std, rng)
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    for name, array in (arrays or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
