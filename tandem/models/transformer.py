"""One configurable decoder-only transformer: Llama, Qwen2 and Gemma 3 as GGUF stores them.

    x = embed(tokens) * embed_scale
    for each layer:
        h = x + [post_attn_norm] attention(rope(q), rope(k), v over the KV cache)   # GQA, causal, maybe windowed
        x = h + [post_ffw_norm] down(act(gate(norm(h))) * up(norm(h)))              # SwiGLU or GeGLU
    logits = output(norm(x))

References: Touvron et al. 2023 (Llama), Qwen2 technical report 2024 (q/k/v biases), Gemma 3 report 2025 (q/k
norms, sandwich norms, 5:1 local/global attention). Weight names are GGUF's (`blk.{i}.attn_q.weight`); llama.cpp's
converter has already folded Gemma's (1 + w) into its norm weights and permuted Llama's Q/K for interleaved rope.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.cache import KVCache
from tandem.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Half-precision squares overflow and lose the mean; normalise in float32 (float64 stays float64).
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.to(compute)).to(x.dtype)


def rope_tables(config: ModelConfig, base: float, scale: float, capacity: int, dtype, device) -> torch.Tensor:
    """cos and sin for every position: [2, capacity, head_dim // 2]."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(0, config.head_dim, 2, dtype=compute, device=device) / config.head_dim)
    angles = torch.outer(torch.arange(capacity, dtype=compute, device=device) / scale, inv_freq)
    return torch.stack([angles.cos(), angles.sin()]).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [T, D/2]: halves (NeoX, Qwen/Gemma) or adjacent pairs (llama.cpp's Llama)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Transformer(torch.nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.w = weights  # GGUF name -> tensor, shapes checked by tandem.loading.weights
        any_weight = weights["token_embd.weight"]
        self.dtype, self.device = any_weight.dtype, any_weight.device
        self.output = weights.get("output.weight", any_weight)  # tied embeddings reuse token_embd
        c = config
        self.rope_global = rope_tables(c, c.rope_base, c.rope_scale, max_positions, self.dtype, self.device)
        self.rope_local = (
            rope_tables(c, c.rope_base_local, 1.0, max_positions, self.dtype, self.device)
            if c.rope_base_local is not None
            else self.rope_global
        )
        self.attn_scale = c.attn_scale if c.attn_scale is not None else 1.0 / math.sqrt(c.head_dim)
        self.embed_scale = torch.tensor(c.embed_scale, dtype=self.dtype)
        self.act = (lambda g: F.gelu(g, approximate="tanh")) if c.activation == "gelu_tanh" else F.silu

    def new_cache(self, capacity: int) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    def attention_mask(self, positions: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
        """[T, kv_len] True where query at positions[t] may see key j: causal, within the window if local."""
        keys = torch.arange(kv_len, device=positions.device)
        mask = keys[None, :] <= positions[:, None]
        if window:
            mask &= keys[None, :] > positions[:, None] - window
        return mask

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention without expanding K/V: the G query heads of each KV head become G*T query rows.

        Repeating K/V to H heads would copy the whole cache every step (300 MB a token for a 1.5B model at 4k).
        """
        c = self.config
        group, T = c.n_heads // c.n_kv_heads, q.shape[2]
        q = q.reshape(1, c.n_kv_heads, group * T, c.head_dim)  # [B, H_kv, G*T, D]; head h reads KV head h // G
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.repeat(group, 1), scale=self.attn_scale)
        return out.view(1, c.n_heads, T, c.head_dim)

    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, absolute positions in the cache
        cache: KVCache,
        kv_len: int | None = None,  # attend over cache[:kv_len]; None = the whole capacity (fixed shapes for graphs)
        last_only: bool = False,  # project only the last row to logits
    ) -> torch.Tensor:  # [T or 1, V] float32 (float64 for float64 models)
        c, w = self.config, self.w
        kv_len = cache.capacity if kv_len is None else kv_len
        x = (F.embedding(tokens, w["token_embd.weight"]) * self.embed_scale)[None]  # [B=1, T, d]
        T = tokens.shape[0]
        masks = {
            False: self.attention_mask(positions, kv_len, None),
            True: self.attention_mask(positions, kv_len, c.sliding_window),
        }
        for i in range(c.n_layers):
            p = f"blk.{i}."
            local = c.is_local_layer(i)
            cos, sin = (self.rope_local if local else self.rope_global)[:, positions]  # [T, D/2] each

            h = rms_norm(x, w[p + "attn_norm.weight"], c.rms_eps)
            q = F.linear(h, w[p + "attn_q.weight"], w.get(p + "attn_q.bias"))
            k = F.linear(h, w[p + "attn_k.weight"], w.get(p + "attn_k.bias"))
            v = F.linear(h, w[p + "attn_v.weight"], w.get(p + "attn_v.bias"))
            q = q.view(1, T, c.n_heads, c.head_dim).transpose(1, 2)  # [B, H, T, D]
            k = k.view(1, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
            v = v.view(1, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
            if c.qk_norm:
                q = rms_norm(q, w[p + "attn_q_norm.weight"], c.rms_eps)
                k = rms_norm(k, w[p + "attn_k_norm.weight"], c.rms_eps)
            q = apply_rope(q, cos, sin, c.rope_interleaved)
            k = apply_rope(k, cos, sin, c.rope_interleaved)
            cache.write(i, positions, k, v)
            keys, values = cache.k[i, :, :, :kv_len], cache.v[i, :, :, :kv_len]  # [B, H_kv, S, D]
            attn = self.attend(q, keys, values, masks[local])  # [B, H, T, D]
            attn = F.linear(attn.transpose(1, 2).reshape(1, T, c.n_heads * c.head_dim), w[p + "attn_output.weight"])
            if c.sandwich_norm:
                attn = rms_norm(attn, w[p + "post_attention_norm.weight"], c.rms_eps)
            x = x + attn

            h = rms_norm(x, w[p + "ffn_norm.weight"], c.rms_eps)
            ffn = F.linear(self.act(F.linear(h, w[p + "ffn_gate.weight"])) * F.linear(h, w[p + "ffn_up.weight"]),
                           w[p + "ffn_down.weight"])
            if c.sandwich_norm:
                ffn = rms_norm(ffn, w[p + "post_ffw_norm.weight"], c.rms_eps)
            x = x + ffn

        x = x[0, -1:] if last_only else x[0]  # [T, d]
        x = rms_norm(x, w["output_norm.weight"], c.rms_eps)
        logits = F.linear(x, self.output)
        return logits if logits.dtype == torch.float64 else logits.float()
