"""Random-weight head drafts: a `gemma4-assistant` GGUF (the Gemma 4 "assistant" MTP drafter) for a gemma4 target.
More: docs/internals.md."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tandem.synthetic import gemma4
from tandem.synthetic.tiny_gguf import (
    FILE_TYPE,
    SUPPORTED_QTYPES,
    TINY_MERGES,
    TOKEN_TYPE_UNUSED,
    tiny_vocab,
    write_gguf,
)

ASSISTANT_ARCH = "gemma4-assistant"


def gemma4_assistant_layout(*, target_d_model: int, n_layers: int, d_model: int, d_ffn: int, n_heads: int,
                            n_kv_heads: int, head_dim: int, vocab_size: int, rope_base: float,
                            sliding_window: int) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], str]]]:
    """(metadata keys, tensor specs) of an assistant for a gemma4 "dense" target with these head widths, KV heads,
    vocabulary and window (its own width d_model, blocks n_layers: sliding, then full every third, as the target)."""
    kv, specs = gemma4.gemma4_layout("dense", n_layers=n_layers, d_model=d_model, d_ffn=d_ffn, n_heads=n_heads,
                                     n_kv_heads=n_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
                                     rope_base=rope_base, sliding_window=sliding_window, tie_embeddings=True)
    kv = {key.replace("gemma4.", f"{ASSISTANT_ARCH}.", 1): value for key, value in kv.items()}
    kv[f"{ASSISTANT_ARCH}.embedding_length_out"] = target_d_model
    kv[f"{ASSISTANT_ARCH}.nextn_predict_layers"] = n_layers
    without_kv = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")
    specs = [spec for spec in specs if not spec[0].endswith(without_kv)]
    specs += [
        ("nextn.pre_projection.weight", (d_model, 2 * target_d_model), "matrix"),
        ("nextn.post_projection.weight", (target_d_model, d_model), "matrix"),
    ]
    return kv, specs


def write_gemma4_assistant(
    path: str | os.PathLike[str],
    target_d_model: int = 64,
    qtype: str = "F32",
    n_layers: int = 3,
    d_model: int = 32,
    d_ffn: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int | None = None,
    context_length: int = 512,
    seed: int = 0,
    *,
    rope_base: float = 1_000_000.0,
    rms_eps: float = 1e-6,
    sliding_window: int = 8,
    metadata: dict[str, Any] | None = None,
) -> str:
    """Write a random gemma4-assistant GGUF for a write_tiny_gguf(arch="gemma4") target of the same n_kv_heads,
    head_dim, vocab_size and sliding_window; return its path. d_model must differ from target_d_model (llama.cpp
    tells the two apart by it). metadata: keys to add or replace (None deletes one)."""
    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"unsupported qtype {qtype!r}; supported: {', '.join(SUPPORTED_QTYPES)}")
    if d_model == target_d_model:
        raise ValueError(f"the assistant's width must differ from its target's ({d_model}): llama.cpp requires it")
    path = os.fspath(path)
    rng = np.random.default_rng(seed)
    tokens, types, merges = gemma4.tiny_gemma4_vocab(TINY_MERGES)
    vocab_size = vocab_size or len(tokens)
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tiny tokenizer's {len(tokens)} tokens")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [TOKEN_TYPE_UNUSED] * (vocab_size - len(types))
    layout_kv, specs = gemma4_assistant_layout(
        target_d_model=target_d_model, n_layers=n_layers, d_model=d_model, d_ffn=d_ffn, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim, vocab_size=vocab_size, rope_base=rope_base,
        sliding_window=sliding_window)
    a = ASSISTANT_ARCH
    kv: dict[str, Any] = {
        "general.name": f"tiny-{a}-{qtype.lower()}",
        "general.file_type": FILE_TYPE.get(qtype, 0),
        "general.quantization_version": 2,
        f"{a}.context_length": context_length,
        f"{a}.block_count": n_layers,
        f"{a}.attention.layer_norm_rms_epsilon": float(rms_eps),
        **layout_kv,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        **gemma4.tokenizer_kv(),
    }
    return write_gguf(path, a, kv, specs, qtype, rng, metadata)


# Random pairs of real shapes for a GPU (a gemma4 target and its assistant), written by `python -m
# tandem.synthetic.heads`. The target shapes follow the published Gemma 4 configs as far as this tree's
# tiny writer models them (sliding layers of head_dim, every third layer full with twice the width); the
# assistants' widths and depths are assumptions (check them against the real *-assistant config.json).
PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tiny": (dict(n_layers=3, d_model=64, d_ffn=128, n_heads=4, n_kv_heads=2, head_dim=32),
             dict(n_layers=3, d_model=32, d_ffn=64, n_heads=4)),
    "31b": (dict(n_layers=60, d_model=5376, d_ffn=21504, n_heads=32, n_kv_heads=16, head_dim=256,
                 vocab_size=262144, sliding_window=1024),
            dict(n_layers=4, d_model=1024, d_ffn=4096, n_heads=8)),
}


def write_head_pair(folder: str | os.PathLike[str], preset: str = "tiny", qtype: str = "Q8_0",
                    head_qtype: str = "Q8_0", seed: int = 0) -> tuple[str, str]:
    """(target path, head path): a random gemma4 target of the preset's shape and an assistant that fits it, side
    by side in `folder` (so `--draft auto` finds it)."""
    from tandem.synthetic.tiny_gguf import write_tiny_gguf

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    target_shape, head_shape = PRESETS[preset]
    os.makedirs(folder, exist_ok=True)
    target = write_tiny_gguf(os.path.join(folder, f"gemma4-{preset}-{qtype}.gguf"), arch="gemma4", layout="dense",
                             qtype=qtype, seed=seed, tie_embeddings=True, context_length=8192, **target_shape)
    shared = {key: target_shape[key] for key in ("n_kv_heads", "head_dim", "vocab_size", "sliding_window")
              if key in target_shape}
    head = write_gemma4_assistant(os.path.join(folder, f"gemma4-{preset}-{qtype}-assistant-{head_qtype}.gguf"),
                                  target_d_model=target_shape["d_model"], qtype=head_qtype, seed=seed + 1,
                                  context_length=8192, **shared, **head_shape)
    return target, head


def write_eagle3(path: str | os.PathLike[str], target_d_model: int = 64,
                 target_layers: tuple[int, int, int] = (0, 1, 1), qtype: str = "F32", d_model: int = 64,
                 d_ffn: int = 128, n_heads: int = 4, n_kv_heads: int = 2,
                 vocab_size: int | None = None, context_length: int = 512, seed: int = 0, *,
                 rope_base: float = 10000.0, rms_eps: float = 1e-6, d2t: list[int] | None = None,
                 own_embedding: bool = True, metadata: dict[str, Any] | None = None) -> str:
    """Write a random EAGLE-3 drafter (llama.cpp's `eagle3`) for a write_tiny_gguf `llama` target of width
    target_d_model; return its path. `fc` fuses the features of `target_layers` (3 ids) into d_model; one block
    reads [token embedding, fused features]. own_embedding=False shares the target's (as Llama 3.1 8B's heads do);
    d2t: the target id of each row of a draft vocabulary of its own. metadata: keys to add or replace (None
    deletes one)."""
    if len(target_layers) != 3:
        raise ValueError(f"EAGLE-3 reads exactly 3 target layers, got {target_layers}")
    path = os.fspath(path)
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    vocab_size = vocab_size or len(tokens)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [TOKEN_TYPE_UNUSED] * (vocab_size - len(types))
    endoftext, im_end = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    head_dim = d_model // n_heads
    a = "eagle3"
    kv: dict[str, Any] = {
        "general.name": f"tiny-{a}-{qtype.lower()}",
        "general.file_type": FILE_TYPE.get(qtype, 0),
        f"{a}.context_length": context_length,
        f"{a}.embedding_length": d_model,
        f"{a}.feed_forward_length": d_ffn,
        f"{a}.block_count": 1,
        f"{a}.attention.head_count": n_heads,
        f"{a}.attention.head_count_kv": n_kv_heads,
        f"{a}.attention.layer_norm_rms_epsilon": float(rms_eps),
        f"{a}.rope.freq_base": float(rope_base),
        f"{a}.rope.dimension_count": head_dim,
        f"{a}.target_layers": [int(x) for x in target_layers],
        f"{a}.target_hidden_size": target_d_model,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": endoftext,
        "tokenizer.ggml.eos_token_id": im_end,
        "tokenizer.ggml.padding_token_id": endoftext,
        "tokenizer.ggml.add_bos_token": False,
    }
    q_width, kv_width = n_heads * head_dim, n_kv_heads * head_dim
    specs = [
        *([("token_embd.weight", (vocab_size, d_model), "matrix")] if own_embedding else []),
        ("fc.weight", (d_model, 3 * target_d_model), "matrix"),
        ("blk.0.attn_norm.weight", (d_model,), "norm"),
        ("blk.0.attn_norm_2.weight", (d_model,), "norm"),
        ("blk.0.attn_q.weight", (q_width, 2 * d_model), "matrix"),
        ("blk.0.attn_k.weight", (kv_width, 2 * d_model), "matrix"),
        ("blk.0.attn_v.weight", (kv_width, 2 * d_model), "matrix"),
        ("blk.0.attn_output.weight", (d_model, q_width), "matrix"),
        ("blk.0.ffn_norm.weight", (d_model,), "norm"),
        ("blk.0.ffn_gate.weight", (d_ffn, d_model), "matrix"),
        ("blk.0.ffn_up.weight", (d_ffn, d_model), "matrix"),
        ("blk.0.ffn_down.weight", (d_model, d_ffn), "matrix"),
        ("output_norm.weight", (d_model,), "norm"),
        ("output.weight", (len(d2t) if d2t is not None else vocab_size, d_model), "matrix"),
    ]
    arrays = {"d2t": np.asarray(d2t, dtype=np.int64)} if d2t is not None else None
    return write_gguf(path, a, kv, specs, qtype, rng, metadata, arrays=arrays)


# Random EAGLE-3 pairs for a GPU (a llama target and a head that fits it): Llama 3.1 8B's shape and its EAGLE-3 head
# (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: one layer of the target's width, a 32000-token draft vocabulary by d2t). The
# layers it reads are an assumption (EAGLE-3's low, middle and high: 2, n/2, n - 3); check a converted file's
# `eagle3.target_layers`.
EAGLE3_PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tiny": (dict(n_layers=4, d_model=64, d_ffn=128, n_heads=4, n_kv_heads=2),
             dict(target_layers=(0, 2, 3), d_model=64, d_ffn=128, n_heads=4, n_kv_heads=2, draft_vocab=None)),
    "llama3-8b": (dict(n_layers=32, d_model=4096, d_ffn=14336, n_heads=32, n_kv_heads=8, vocab_size=128256),
                  dict(target_layers=(2, 16, 29), d_model=4096, d_ffn=14336, n_heads=32, n_kv_heads=8,
                       draft_vocab=32000)),
}


def write_eagle3_pair(folder: str | os.PathLike[str], preset: str = "tiny", qtype: str = "F16",
                      head_qtype: str = "F16", seed: int = 0) -> tuple[str, str]:
    """(target path, head path): a random llama target of the preset's shape and an EAGLE-3 head that fits it, side
    by side in `folder` (`--draft auto` finds it), for either backend."""
    from tandem.synthetic.tiny_gguf import write_tiny_gguf

    if preset not in EAGLE3_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(EAGLE3_PRESETS)}")
    target_shape, head_shape = EAGLE3_PRESETS[preset]
    head_shape = dict(head_shape)
    os.makedirs(folder, exist_ok=True)
    target = write_tiny_gguf(os.path.join(folder, f"llama-{preset}-{qtype}.gguf"), arch="llama", qtype=qtype,
                             seed=seed, context_length=8192, **target_shape)
    draft_vocab, vocab = head_shape.pop("draft_vocab"), target_shape.get("vocab_size")
    d2t = None
    if draft_vocab:  # a random sorted subset of the target's ids
        d2t = sorted(np.random.default_rng(seed).choice(vocab, draft_vocab, replace=False).tolist())
    head = write_eagle3(os.path.join(folder, f"llama-{preset}-{qtype}-eagle3-{head_qtype}.gguf"),
                        target_d_model=target_shape["d_model"], qtype=head_qtype, seed=seed + 1, vocab_size=vocab,
                        context_length=8192, d2t=d2t, own_embedding=d2t is None, **head_shape)
    return target, head


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write a random target and a head draft that fits it: a gemma4 "
                                     "target and its assistant, or (--eagle3) a llama target and an EAGLE-3 head")
    parser.add_argument("folder")
    parser.add_argument("--eagle3", action="store_true", help=f"presets: {', '.join(EAGLE3_PRESETS)}")
    parser.add_argument("--preset", default="tiny", help=f"gemma4 presets: {', '.join(PRESETS)}")
    parser.add_argument("--qtype", default="Q8_0", help="the target's matrices (e.g. Q4_K for a Q4_K_M stand-in)")
    parser.add_argument("--head-qtype", default="Q8_0")
    args = parser.parse_args()
    write = write_eagle3_pair if args.eagle3 else write_head_pair
    print(*write(args.folder, args.preset, args.qtype, args.head_qtype), sep="\n")
