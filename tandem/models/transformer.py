"""One configurable decoder-only transformer: Llama, Qwen2 and Gemma 3 as GGUF stores them.
More: docs/internals.md."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.cache import KVCache
from tandem.config import ModelConfig
from tandem.models import decode_attention, fused_projections


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / rms(x) * weight; weight None where the projection after it holds the scale (see fuse_projections)."""
    # Half-precision squares overflow and lose the mean; normalise in float32 (float64 stays float64).
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf if weight is None else xf * weight.to(compute)).to(x.dtype)


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
        self.w = fuse_projections(config, weights)  # GGUF names, shapes checked by tandem.loading.weights
        # Each layer's weights under the same names ("attn_qkv.weight", ...): one compiled layer serves them all
        self.blocks = [{k.removeprefix(f"blk.{i}."): v for k, v in self.w.items() if k.startswith(f"blk.{i}.")}
                       for i in range(config.n_layers)]
        any_weight = self.w["token_embd.weight"]
        self.dtype, self.device = any_weight.dtype, any_weight.device
        self.output = self.w.get("output.weight", any_weight)  # tied embeddings reuse token_embd
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
        self.q_width, self.kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.decode_kernel = decode_attention.available(self.device, self.dtype, c.head_dim)
        # Gemma's q/k norms need a whole head before rope: its projections stay unfused.
        self.projection_kernels = not c.qk_norm and fused_projections.available(self.device, self.dtype, c.head_dim)
        self.split_k_outputs = (self.projection_kernels and not c.sandwich_norm  # its post-norm needs whole rows
                                and os.environ.get("TANDEM_SPLIT_K", "1") != "0")
        # add_linear_split_k's scratch: one counter a tile of rows and of output features, zero between projections
        self.arrivals = torch.zeros(-(-fused_projections.MAX_ROWS // 16),  # the most row tiles of any BLOCK_ROWS
                                    fused_projections.split_k_tiles(c.d_model), dtype=torch.int32, device=self.device)
        # forward_packed: every step of a batch of sequences in tandem's kernels (Llama/Qwen-like models on CUDA)
        self.packed = self.decode_kernel and self.split_k_outputs

    def new_cache(self, capacity: int, sequences: int = 1) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, capacity, self.dtype, self.device, sequences)

    def attention_bias(self, positions: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
        """[G*T, kv_len] additive mask, 0 where query at positions[t] may see key j (causal, within the window if
        local) and -inf elsewhere; rows repeated for the G query heads that share a KV head (see `attend`)."""
        keys = torch.arange(kv_len, device=positions.device)
        visible = keys[None, :] <= positions[:, None]
        if window:
            visible &= keys[None, :] > positions[:, None] - window
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=positions.device).masked_fill_(~visible, -math.inf)
        return bias.repeat(self.config.n_heads // self.config.n_kv_heads, 1)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
               positions: torch.Tensor, window: int) -> torch.Tensor:
        """Grouped-query attention with the G query heads of each KV head as G*T query rows: repeating K/V to H
        heads would copy the whole cache every step. bias is None under `fused_decode` (the kernel masks itself).
        Returns [1, T, H*D], the output projection's input."""
        c = self.config
        group, T = c.n_heads // c.n_kv_heads, q.shape[2]
        q = q.reshape(1, c.n_kv_heads, group * T, c.head_dim)  # [B, H_kv, G*T, D]; head h reads KV head h // G
        if bias is None:  # the kernel writes [T, H*D] itself: no transpose kernel before the output projection
            return torch.ops.tandem.decode_attention(q, keys, values, positions, self.attn_scale, window)[None]
        if group * T <= decode_attention.MAX_ROWS:
            # Decode and verify: few query rows over a long cache. Fused attention kernels split work by query
            # rows, so a handful of thread blocks would stream the whole cache; two matmuls split it by keys.
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # softmax of half scores loses mass
            scores = torch.matmul(q, keys.transpose(-1, -2)).to(acc) * self.attn_scale + bias  # [B, H_kv, G*T, S]
            out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=self.attn_scale)
        # reshape: CUDA SDPA may return its output laid out [B, T, H, D] (strided), which no view regroups.
        return out.reshape(1, c.n_heads, T, c.head_dim).transpose(1, 2).reshape(1, T, self.q_width)

    def project_qkv(self, h: torch.Tensor, w: dict[str, torch.Tensor], rope: torch.Tensor, positions: torch.Tensor,
                    cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """q, k, v of h [1, T, d]; k and v rotated and written into the layer's cache at positions (of cache row
        slots[t] where given: a pool of sequences). Returns q rotated, [1, H, T, D]. (tandem.models.fused_projections
        does all of it in one kernel on the GPU.)"""
        c, T = self.config, h.shape[1]  # w: the layer's block
        qkv = F.linear(h, w["attn_qkv.weight"])  # one matmul for q, k and v
        if "attn_qkv.bias" in w:
            # Added apart, where the compiler fuses it into the rope kernel: cuBLAS's bias-epilogue GEMMs ran
            # this projection at 1.2 TB/s on an H200, half the speed of the same shape without a bias.
            qkv = qkv + w["attn_qkv.bias"]
        q, k, v = qkv.split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        q = q.view(1, T, c.n_heads, c.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(1, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        v = v.view(1, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm:
            q = rms_norm(q, w["attn_q_norm.weight"], c.rms_eps)
            k = rms_norm(k, w["attn_k_norm.weight"], c.rms_eps)
        cos, sin = rope  # [T, D/2] each
        q = apply_rope(q, cos, sin, c.rope_interleaved)
        k = apply_rope(k, cos, sin, c.rope_interleaved)
        if slots is None:
            # index_copy_: one kernel, and capturable (no host-side indexing).
            cache_k.index_copy_(2, positions, k)
            cache_v.index_copy_(2, positions, v)
        else:  # [B, S, H_kv, D] views take a row [H_kv, D] per (slot, position)
            cache_k.transpose(1, 2).index_put_((slots, positions), k[0].transpose(0, 1))
            cache_v.transpose(1, 2).index_put_((slots, positions), v[0].transpose(0, 1))
        return q

    def add_projection(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, post_norm: torch.Tensor | None,
                       split_k: bool, sum_squares: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x + h @ weight^T (post-normed where the model has sandwich norms): the output and down projections
        joining the residual stream [1, T, d]. Returns the new stream and, when the input projections are fused
        kernels, its rows' sums of squares, from which they normalise it."""
        if split_k:  # the projection, the residual add and the sums of squares in one kernel
            x, sum_sq = torch.ops.tandem.add_linear_split_k(h[0], weight, x[0], self.arrivals)
            return x[None], sum_sq
        y = F.linear(h, weight)
        if self.config.sandwich_norm:
            y = rms_norm(y, post_norm, self.config.rms_eps)
        x = x + y
        return x, fused_projections.sum_squares(x[0]) if sum_squares else None

    def fused_decode(self, T: int) -> bool:
        """Whether attention runs as tandem.models.decode_attention's kernels (GPU decode and verify steps)."""
        group = self.config.n_heads // self.config.n_kv_heads
        return self.decode_kernel and group * T <= decode_attention.MAX_ROWS

    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, absolute positions in the cache
        cache_k: list[torch.Tensor],  # per layer [B, H_kv, S, D], written at `positions`: a KVCache's k ...
        cache_v: list[torch.Tensor],  # ... and v
        kv_len: int | None = None,  # attend over cache slots [0, kv_len); None = all of them
        last_only: bool = False,  # project only the last row to logits
        tapped: dict[int, torch.Tensor | None] | None = None,  # see `hidden`
    ) -> torch.Tensor:  # [T or 1, V] float32 (float64 for float64 models)
        x = self.hidden(tokens, positions, cache_k, cache_v, kv_len, tapped=tapped)
        return self.project(x[-1:] if last_only else x)

    def project(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] hidden states -> [T, V] logits
        x = rms_norm(x, self.w["output_norm.weight"], self.config.rms_eps)
        logits = F.linear(x, self.output)
        return logits if logits.dtype == torch.float64 else logits.float()

    def hidden(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        cache_k: list[torch.Tensor],
        cache_v: list[torch.Tensor],
        kv_len: int | None = None,
        layer: Callable | None = None,  # what runs each layer: `layer`, or a compiled copy (TorchModel.step)
        # A head draft's taps (EAGLE-3: docs/decisions/0004): each key, a layer id, gets that layer's input [T, d]
        tapped: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:  # [T, d]: the last layer's output, before the final norm (what forward projects)
        c, w = self.config, self.w
        kv_len = cache_k[0].shape[2] if kv_len is None else kv_len
        x = (F.embedding(tokens, w["token_embd.weight"]) * self.embed_scale)[None]  # [B=1, T, d]
        T = tokens.shape[0]
        fused_attention = self.fused_decode(T)
        fused_projection = self.projection_kernels and T <= fused_projections.DECODE_ROWS
        split_k = self.split_k_outputs and T <= fused_projections.DECODE_ROWS
        bias = {False: None, True: None}
        if not fused_attention:
            bias[False] = self.attention_bias(positions, kv_len, None)
            bias[True] = self.attention_bias(positions, kv_len, c.sliding_window) if c.sliding_window else bias[False]
        # The fused input projections normalise x themselves, from its rows' sums of squares
        sum_sq = fused_projections.sum_squares(x[0]) if fused_projection else None
        layer = layer or self.layer
        for i in range(c.n_layers):
            if tapped is not None and i in tapped:
                tapped[i] = x[0]
            local = c.is_local_layer(i)
            x, sum_sq = layer(x, sum_sq, self.blocks[i], local, positions, cache_k[i], cache_v[i], kv_len, bias[local],
                              fused_projection, split_k)
        return x[0]

    def layer(self, x: torch.Tensor, sum_sq: torch.Tensor | None, w: dict[str, torch.Tensor], local: bool,
              positions: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, kv_len: int,
              bias: torch.Tensor | None, fused_projection: bool, split_k: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoder layer of `hidden` over x [1, T, d]: the unit a compiled step compiles, once for every layer
        (their weights, w, are its inputs): dynamo traces one layer, not all of them (docs/decisions/0003)."""
        c = self.config
        rope = self.rope_local if local else self.rope_global
        if fused_projection:  # the norm, q, k, v, bias, rope and the cache writes in one kernel
            q = torch.ops.tandem.qkv_rope(x[0], sum_sq, c.rms_eps, w["attn_qkv.weight"], w.get("attn_qkv.bias"),
                                          rope, positions, cache_k, cache_v, c.n_heads, c.rope_interleaved)
        else:
            h = rms_norm(x, None, c.rms_eps)  # attn_norm's scale is in attn_qkv
            q = self.project_qkv(h, w, rope[:, positions], positions, cache_k, cache_v)
        keys, values = cache_k[:, :, :kv_len], cache_v[:, :, :kv_len]  # [B, H_kv, S, D]
        attn = self.attend(q, keys, values, bias, positions, c.sliding_window if local else 0)
        x, sum_sq = self.add_projection(x, attn, w["attn_output.weight"], w.get("post_attention_norm.weight"),
                                        split_k, fused_projection)
        if fused_projection:  # the norm, gate, up and the activation in one kernel
            act = torch.ops.tandem.gate_up_act(x[0], sum_sq, c.rms_eps, w["ffn_gate_up.weight"],
                                               c.activation == "gelu_tanh")[None]
        else:
            h = rms_norm(x, None, c.rms_eps)  # ffn_norm's scale is in ffn_gate_up
            gate, up = F.linear(h, w["ffn_gate_up.weight"]).chunk(2, dim=-1)  # one matmul for both
            act = self.act(gate) * up
        return self.add_projection(x, act, w["ffn_down.weight"], w.get("post_ffw_norm.weight"), split_k,
                                   fused_projection)

    def forward_ragged(
        self,
        tokens: torch.Tensor,  # [N] int64: every sequence's rows, one sequence after another
        positions: torch.Tensor,  # [N] int64, each row's position in its own sequence
        slots: torch.Tensor,  # [N] int64, the cache row (sequence) each token belongs to
        spans: list[tuple[int, int, int, int]],  # per sequence: (first row, end row, slot, keys it attends over)
        cache_k: list[torch.Tensor],  # per layer [B_pool, H_kv, S, D], one row a sequence
        cache_v: list[torch.Tensor],
        out_rows: torch.Tensor,  # [M] int64, the rows to project to logits
        tapped: dict[int, torch.Tensor | None] | None = None,  # layer inputs [N, d], as `hidden`'s
    ) -> torch.Tensor:  # [M, V] float32 (float64 for float64 models)
        """Several sequences in one forward, each at its own position with its own number of rows: the
        projections and the MLP run over all N rows at once (one read of the weights for every sequence), the
        attention sequence by sequence over its own cache row. The eager path of `forward`, generalised; a batch of
        one sequence runs `forward` itself (the backends' choice). On CUDA, `forward_packed` does this in kernels."""
        c, w = self.config, self.w
        x = (F.embedding(tokens, w["token_embd.weight"]) * self.embed_scale)[None]  # [1, N, d]
        attention = RaggedAttention(self, positions, spans)
        for i, b in enumerate(self.blocks):
            if tapped is not None and i in tapped:
                tapped[i] = x[0]
            local = c.is_local_layer(i)
            rope = self.rope_local if local else self.rope_global
            h = rms_norm(x, None, c.rms_eps)  # attn_norm's scale is in attn_qkv
            q = self.project_qkv(h, b, rope[:, positions], positions, cache_k[i], cache_v[i], slots)  # [1, H, N, D]
            attn = attention(q, cache_k[i], cache_v[i], local)  # [1, N, H*D]
            x, _ = self.add_projection(x, attn, b["attn_output.weight"], b.get("post_attention_norm.weight"),
                                       False, False)
            h = rms_norm(x, None, c.rms_eps)  # ffn_norm's scale is in ffn_gate_up
            gate, up = F.linear(h, b["ffn_gate_up.weight"]).chunk(2, dim=-1)
            x, _ = self.add_projection(x, self.act(gate) * up, b["ffn_down.weight"], b.get("post_ffw_norm.weight"),
                                       False, False)
        x = rms_norm(x[0, out_rows], w["output_norm.weight"], c.rms_eps)  # [M, d]
        logits = F.linear(x, self.output)
        return logits if logits.dtype == torch.float64 else logits.float()

    def rows_per_sequence(self) -> int:
        """The most rows of one sequence forward_packed takes: decode_attention holds G query heads x T rows."""
        return decode_attention.MAX_ROWS // (self.config.n_heads // self.config.n_kv_heads)

    def forward_packed(
        self,
        tokens: torch.Tensor,  # [N] int64: every sequence's rows, one sequence after another, then padding
        positions: torch.Tensor,  # [N] int64, each row's position in its own sequence (padding: 0)
        slots: torch.Tensor,  # [N] int64, the cache row each row's k and v go to (padding: -1, nowhere)
        seqs: torch.Tensor,  # [n, 4] int64, per sequence (first row, rows, cache row, keys it attends over)
        span: int,  # the most keys any sequence attends over (a bucket: CUDA graphs hold it)
        out_rows: torch.Tensor,  # [M] int64, the rows to project to logits
        cache_k: list[torch.Tensor],  # per layer [B_pool, H_kv, S, D], one row a sequence
        cache_v: list[torch.Tensor],
        logits: torch.Tensor,  # [>= M, V] float32, written in place: row m is out_rows[m]'s logits
        tapped: dict[int, torch.Tensor | None] | None = None,  # layer inputs [N, d], as `hidden`'s
    ) -> None:
        """forward_ragged in tandem's GPU kernels alone (six launches a layer and two more), for CUDA graphs.

        Every kernel computes a row in the same code and the same reduction order whatever rows share the launch
        (fixed tiles of rows; attention over each sequence's own chunks), and the logits are one of them, not
        cuBLAS's: a sequence's greedy output is bit for bit the same alone and in any batch. Each sequence takes
        at most rows_per_sequence() rows; a Llama/Qwen-like model (`packed`)."""
        c, w = self.config, self.w
        x, sum_sq = torch.ops.tandem.embed_rows(tokens, w["token_embd.weight"], float(self.embed_scale))  # [N, d]
        for i in range(c.n_layers):
            if tapped is not None and i in tapped:
                tapped[i] = x
            p = f"blk.{i}."
            local = c.is_local_layer(i)
            rope = self.rope_local if local else self.rope_global
            q = torch.ops.tandem.qkv_rope(x, sum_sq, c.rms_eps, w[p + "attn_qkv.weight"], w.get(p + "attn_qkv.bias"),
                                          rope, positions, cache_k[i], cache_v[i], c.n_heads, c.rope_interleaved,
                                          slots)  # [1, H, N, D]
            attn = torch.ops.tandem.ragged_decode_attention(q, cache_k[i], cache_v[i], positions, seqs, span,
                                                            self.attn_scale, (c.sliding_window or 0) if local else 0)
            x, sum_sq = torch.ops.tandem.add_linear_split_k(attn, w[p + "attn_output.weight"], x, self.arrivals)
            act = torch.ops.tandem.gate_up_act(x, sum_sq, c.rms_eps, w[p + "ffn_gate_up.weight"],
                                               c.activation == "gelu_tanh")
            x, sum_sq = torch.ops.tandem.add_linear_split_k(act, w[p + "ffn_down.weight"], x, self.arrivals)
        torch.ops.tandem.norm_logits(x, sum_sq, out_rows, w["output_norm.weight"], c.rms_eps, self.output, logits)


class RaggedAttention:
    """Attention of a ragged batch (Transformer.forward_ragged), its masks built once for every layer. Short
    sequences (G x rows <= decode_attention.MAX_ROWS) are padded (repeating their last row) and attend together;
    prompt chunks one by one. A row gets the same result as alone: masked keys add exact zeros."""

    def __init__(self, model: Transformer, positions: torch.Tensor, spans: list[tuple[int, int, int, int]]) -> None:
        c = model.config
        self.model, self.positions, self.window = model, positions, c.sliding_window
        self.group = c.n_heads // c.n_kv_heads
        short = [i for i, (b, e, _, _) in enumerate(spans) if self.group * (e - b) <= decode_attention.MAX_ROWS]
        self.short = short if len(short) > 1 else []
        self.long = [(spans[i], self._bias_pair(positions[spans[i][0] : spans[i][1]], spans[i][3]))
                     for i in range(len(spans)) if i not in self.short]
        if not self.short:
            return
        device = positions.device
        rows = max(spans[i][1] - spans[i][0] for i in self.short)
        self.kv_len = max(spans[i][3] for i in self.short)
        index = [[spans[i][0] + min(t, spans[i][1] - spans[i][0] - 1) for t in range(rows)] for i in self.short]
        self.index = torch.tensor(index, dtype=torch.long, device=device)  # [B, T] rows of the batch
        self.slots = torch.tensor([spans[i][2] for i in self.short], dtype=torch.long, device=device)
        real = [b * rows + t for b, i in enumerate(self.short) for t in range(spans[i][1] - spans[i][0])]
        self.real = torch.tensor(real, dtype=torch.long, device=device)  # flat [B*T] rows that are not padding
        self.targets = torch.cat([torch.arange(spans[i][0], spans[i][1], device=device) for i in self.short])
        pos = positions[self.index]  # [B, T]
        keys = torch.arange(self.kv_len, device=device)
        visible = keys[None, None, :] <= pos[:, :, None]  # [B, T, S]
        self.bias = {False: self._additive(visible), True: None}
        self.bias[True] = self._additive(visible & (keys[None, None, :] > pos[:, :, None] - self.window)) \
            if self.window else self.bias[False]

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:  # [B, T, S] -> [B, 1, G*T, S]
        bias = torch.zeros(visible.shape, dtype=self.model.dtype, device=visible.device)
        return bias.masked_fill_(~visible, -math.inf).repeat(1, self.group, 1)[:, None]

    def _bias_pair(self, pos: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        full = self.model.attention_bias(pos, kv_len, None)
        return full, self.model.attention_bias(pos, kv_len, self.window) if self.window else full

    def __call__(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, local: bool) -> torch.Tensor:
        """q: [1, H, N, D] rotated; cache_k/v: the layer's pool [B_pool, H_kv, S, D]. Returns [1, N, H*D]."""
        model, c = self.model, self.model.config
        out = torch.empty(q.shape[2], model.q_width, dtype=q.dtype, device=q.device)  # [N, H*D]
        window = c.sliding_window if local else 0
        for (begin, end, slot, kv_len), bias in self.long:
            out[begin:end] = model.attend(q[:, :, begin:end], cache_k[slot : slot + 1, :, :kv_len],
                                          cache_v[slot : slot + 1, :, :kv_len], bias[local],
                                          self.positions[begin:end], window)[0]
        if self.short:
            B, T = self.index.shape
            qb = q[0][:, self.index].transpose(0, 1).reshape(B, c.n_kv_heads, self.group * T, c.head_dim)
            keys = cache_k[self.slots, :, : self.kv_len]  # [B, H_kv, S, D]
            values = cache_v[self.slots, :, : self.kv_len]
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # as Transformer.attend
            scores = torch.matmul(qb, keys.transpose(-1, -2)).to(acc) * model.attn_scale + self.bias[local]
            attn = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [B, H_kv, G*T, D]
            attn = attn.reshape(B, c.n_heads, T, c.head_dim).transpose(1, 2).reshape(B * T, model.q_width)
            out[self.targets] = attn[self.real]
        return out[None]


def fuse_projections(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `weights` with q/k/v stacked into `attn_qkv` and gate/up into `ffn_gate_up`, and the RMS norms
    before them folded in: rms_norm(x) * g @ W^T = rms_norm(x) @ (W diag(g))^T.
    Fewer matmuls mean fewer launches, which a small model's decode step costs more than bytes. Parts are replaced
    as they are stacked: peak memory is one layer's projections over the weights.
    """
    fused = dict(weights)
    for i in range(config.n_layers):
        p = f"blk.{i}."
        stacks = ((p + "attn_qkv", ("attn_q", "attn_k", "attn_v"), p + "attn_norm.weight"),
                  (p + "ffn_gate_up", ("ffn_gate", "ffn_up"), p + "ffn_norm.weight"))
        for out, parts, norm in stacks:
            for suffix in (".weight", ".bias"):
                names = [p + part + suffix for part in parts]
                if all(name in fused for name in names):
                    fused[out + suffix] = torch.cat([fused.pop(name) for name in names])
            if norm in fused:  # (absent in a dict this made)
                weight, scale = fused[out + ".weight"], fused.pop(norm)
                # One rounding, as rms_norm rounds x * g: products in float32 (float64 stays float64)
                compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
                fused[out + ".weight"] = (weight.to(compute) * scale.to(compute)).to(weight.dtype)
    return fused
