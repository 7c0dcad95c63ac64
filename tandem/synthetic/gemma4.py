"""The gemma4 part of tiny random GGUFs: metadata, tensor list and a Gemma-4-style vocabulary.
More: docs/internals.md."""

from __future__ import annotations

from typing import Any

import numpy as np

GEMMA4_LAYOUTS = ("dense", "e2b")
SPACE = "\u2581"  # SentencePiece's visible space
TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_BYTE = 1, 2, 3, 6
SPECIALS: tuple[tuple[str, int], ...] = (
    ("<pad>", TOKEN_TYPE_CONTROL),
    ("<eos>", TOKEN_TYPE_CONTROL),
    ("<bos>", TOKEN_TYPE_CONTROL),
    ("<unk>", TOKEN_TYPE_UNKNOWN),
    ("<mask>", TOKEN_TYPE_CONTROL),
    ("<|turn>", TOKEN_TYPE_CONTROL),
    ("<turn|>", TOKEN_TYPE_CONTROL),
    ("<|channel>", TOKEN_TYPE_CONTROL),
    ("<channel|>", TOKEN_TYPE_CONTROL),
)
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3

# Gemma 4's turn format (`<|turn>role\n...<turn|>\n`, the assistant is "model"), without tools and thinking.
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' + (message['content'] | trim) + '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)

FULL_ATTENTION_PERIOD = {"dense": 3, "e2b": 2}  # tiny stand-ins for 31B's 5:1 and E2B's 4:1 local:global
PER_LAYER_INPUT_WIDTH = 32  # e2b: width of each layer's token embedding (256 in the real E2B)
ROTATED_FRACTION = 4  # full layers: 1/4 of the frequency pairs rotate (partial_rotary_factor 0.25)
ROPE_BASE_SWA = 10000.0
FINAL_LOGIT_SOFTCAP = 30.0


def tiny_gemma4_vocab(merges_from: tuple[tuple[str, str], ...]) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): specials, 256 byte tokens, single characters, then merge results.

    `merges_from` are gpt2-alphabet merges (Ġ = space); they are respelled with ▁, and those across a newline
    (Ċ) are dropped, since llama.cpp's gemma4 pre-tokenizer never lets a merge span one.
    """
    tokens = [text for text, _ in SPECIALS]
    types = [kind for _, kind in SPECIALS]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TOKEN_TYPE_BYTE] * 256
    chars = [SPACE, "\n", "\t"] + [chr(c) for c in range(0x21, 0x7F)]
    tokens += chars
    types += [TOKEN_TYPE_NORMAL] * len(chars)
    known, merges = set(tokens), []
    for left, right in merges_from:
        if "Ċ" in left + right:
            continue
        left, right = left.replace("Ġ", SPACE), right.replace("Ġ", SPACE)
        if left not in known or right not in known:
            raise AssertionError(f"merge {left!r} + {right!r} uses a token not yet in the vocabulary")
        if left + right not in known:
            tokens.append(left + right)
            types.append(TOKEN_TYPE_NORMAL)
            known.add(left + right)
        merges.append(f"{left} {right}")
    return tokens, types, merges


def tokenizer_kv() -> dict[str, Any]:
    """The tokenizer keys of a gemma4 file (besides tokens, types and merges)."""
    return {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.pre": "gemma4",
        "tokenizer.ggml.bos_token_id": BOS_ID,
        "tokenizer.ggml.eos_token_id": EOS_ID,
        "tokenizer.ggml.unknown_token_id": UNK_ID,
        "tokenizer.ggml.padding_token_id": PAD_ID,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": GEMMA4_CHAT_TEMPLATE,
    }


def gemma4_layout(
    layout: str,
    *,
    n_layers: int,
    d_model: int,
    d_ffn: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    rope_base: float,
    sliding_window: int,
    tie_embeddings: bool,
) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], str]]]:
    """(metadata keys, tensor specs (name, torch shape, kind)) of a gemma4 file; kinds as in synthetic.py plus
    "rope_freqs" and "scale"."""
    if layout not in GEMMA4_LAYOUTS:
        raise ValueError(f"unknown gemma4 layout {layout!r}; choose one of {', '.join(GEMMA4_LAYOUTS)}")
    period = FULL_ATTENTION_PERIOD[layout]
    is_full = [(i + 1) % period == 0 for i in range(n_layers)]
    if not any(is_full) or all(is_full):
        raise ValueError(f"gemma4 needs sliding and full layers: give n_layers >= {period}, got {n_layers}")
    full_head_dim = 2 * head_dim
    kv_heads = [max(1, n_kv_heads // 2) if full else n_kv_heads for full in is_full]
    shared = n_layers // 2 if layout == "e2b" else 0  # last layers reuse earlier layers' KV
    has_kv = [i < n_layers - shared for i in range(n_layers)]
    ffn = [2 * d_ffn if not kv else d_ffn for kv in has_kv]
    per_layer = PER_LAYER_INPUT_WIDTH if layout == "e2b" else 0

    a = "gemma4"
    kv: dict[str, Any] = {
        f"{a}.embedding_length": d_model,
        f"{a}.feed_forward_length": ffn if len(set(ffn)) > 1 else d_ffn,
        f"{a}.attention.head_count": n_heads,
        f"{a}.attention.head_count_kv": kv_heads,
        f"{a}.attention.key_length": full_head_dim,
        f"{a}.attention.value_length": full_head_dim,
        f"{a}.attention.key_length_swa": head_dim,
        f"{a}.attention.value_length_swa": head_dim,
        f"{a}.rope.dimension_count": full_head_dim,
        f"{a}.rope.dimension_count_swa": head_dim,
        f"{a}.rope.freq_base": float(rope_base),
        f"{a}.rope.freq_base_swa": ROPE_BASE_SWA,
        f"{a}.attention.sliding_window": sliding_window,
        f"{a}.attention.sliding_window_pattern": [not full for full in is_full],  # True = sliding
        f"{a}.attention.shared_kv_layers": shared,
        f"{a}.embedding_length_per_layer_input": per_layer,
        f"{a}.final_logit_softcapping": FINAL_LOGIT_SOFTCAP,
    }

    specs: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab_size, d_model), "matrix")]
    if per_layer:
        specs += [
            ("per_layer_token_embd.weight", (vocab_size, per_layer * n_layers), "matrix"),
            ("per_layer_model_proj.weight", (per_layer * n_layers, d_model), "matrix"),
            ("per_layer_proj_norm.weight", (per_layer,), "norm"),
        ]
    specs.append(("rope_freqs.weight", (full_head_dim // 2,), "rope_freqs"))
    for i in range(n_layers):
        p, hd = f"blk.{i}.", full_head_dim if is_full[i] else head_dim
        q_width, kv_width = n_heads * hd, kv_heads[i] * hd
        specs += [(p + "attn_norm.weight", (d_model,), "norm"), (p + "attn_q.weight", (q_width, d_model), "matrix")]
        if has_kv[i]:
            specs.append((p + "attn_k.weight", (kv_width, d_model), "matrix"))
            if not (is_full[i] and layout == "dense"):  # the 31B's full layers take V = K
                specs.append((p + "attn_v.weight", (kv_width, d_model), "matrix"))
        specs += [
            (p + "attn_output.weight", (d_model, q_width), "matrix"),
            (p + "attn_q_norm.weight", (hd,), "norm"),
        ]
        if has_kv[i]:
            specs.append((p + "attn_k_norm.weight", (hd,), "norm"))
        specs += [
            (p + "post_attention_norm.weight", (d_model,), "norm"),
            (p + "layer_output_scale.weight", (1,), "scale"),
            (p + "ffn_norm.weight", (d_model,), "norm"),
            (p + "ffn_gate.weight", (ffn[i], d_model), "matrix"),
            (p + "ffn_up.weight", (ffn[i], d_model), "matrix"),
            (p + "ffn_down.weight", (d_model, ffn[i]), "matrix"),
            (p + "post_ffw_norm.weight", (d_model,), "norm"),
        ]
        if per_layer:
            specs += [
                (p + "inp_gate.weight", (per_layer, d_model), "matrix"),
                (p + "proj.weight", (d_model, per_layer), "matrix"),
                (p + "post_norm.weight", (d_model,), "norm"),
            ]
    specs.append(("output_norm.weight", (d_model,), "norm"))
    if not tie_embeddings:
        specs.append(("output.weight", (vocab_size, d_model), "matrix"))
    return kv, specs


def special_tensor(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """float32 values of the gemma4-only tensor kinds."""
    if kind == "rope_freqs":  # frequency divisors: 1 rotates, a huge one leaves a pair unrotated
        n_rotated = shape[0] // ROTATED_FRACTION
        return np.array([1.0] * n_rotated + [1e30] * (shape[0] - n_rotated), dtype=np.float32)
    if kind == "scale":
        return rng.uniform(0.5, 1.0, size=shape).astype(np.float32)
    raise ValueError(f"unknown tensor kind {kind!r}")
