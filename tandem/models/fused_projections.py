"""A decode step's two input projections with their elementwise work fused in (Triton, GPU, <= 16 rows).

A graphed decode step of a small model is bound by its kernels' fixed costs, not by bytes: on an H200 the q/k/v
projection of a 1.5B model took 4.9 us for 6 MB, then three more kernels (bias + rope for q, for k, cache writes)
~1.5 us each plus their gaps; gate/up took 16.9 us and the SwiGLU product another kernel. Here
 - `qkv_rope`: x @ W_qkv^T + b, rope on q and k, k and v written into the cache at their positions: one kernel;
 - `gate_up_act`: act(x @ W_gate^T) * (x @ W_up^T): one kernel, the [T, 2F] intermediate never stored.
Both also take the residual add and the RMS norm in front of them: each program reads whole input rows anyway, so it
adds the last block's output to the residual stream, sums the squares of each row as the dot goes, folds the norm's
weight into the input and scales the dot by the row's 1/rms at the end. That drops the two add + norm kernels a layer
(~2 us each plus their gaps on an H200); program 0 also writes the sum out, the residual stream's next value.
Each program reads a slab of whole weight rows and every (<= 16) input row, so an output element is one dot in a
fixed order whatever the other rows hold: padding rows never change a real row's bits (see StepGraph).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: Transformer.forward's unfused path serves every device there
    triton = None

MAX_ROWS = 16  # tokens per forward these kernels take (a graphed step has 9); tl.dot's smallest tile
# Launch configurations: the fastest of bench/gpu_kernels.py's sweep on an H200 for the 1.5B and 0.5B shapes
# (bench/results/h200-2026-12-03d): 16 weight rows a qkv program (a 1.5B model's q/k/v over 128 programs), 2 x 32
# rows a gate/up program.
QKV_PAIRS = 8
QKV_BLOCK_K = 256  # 128 where it does not divide d_model
QKV_LAUNCH = dict(num_warps=2, num_stages=4)
GATE_UP_BLOCK_N = 32
GATE_UP_BLOCK_K = 128
GATE_UP_LAUNCH = dict(num_warps=4, num_stages=3)


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether these kernels serve a model: Triton, CUDA, half precision, a power-of-two head_dim holding at least
    QKV_PAIRS rope pairs. TANDEM_FUSED_PROJECTIONS=0 turns them off. Asked once per model."""
    return (triton is not None and os.environ.get("TANDEM_FUSED_PROJECTIONS", "1") != "0" and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16) and head_dim >= 2 * QKV_PAIRS
            and head_dim & (head_dim - 1) == 0)


def takes_norm() -> bool:
    """Whether the kernels also take the residual add and the RMS norm in front of them (where they serve a model;
    TANDEM_FUSED_NORM=0: not, the add and norm then run as the compiler's kernel of their own)."""
    return os.environ.get("TANDEM_FUSED_NORM", "1") != "0"


if triton is not None:

    @triton.jit
    def _load_sum(X, DELTA, rows, n_rows, k0, ks, K: tl.constexpr, HAS_DELTA: tl.constexpr):
        # Rows of x + delta over columns k0 + ks, and their mask.
        k_ok = k0 + ks < K
        mask = (rows < n_rows)[:, None] & k_ok[None, :]
        at = rows[:, None] * K + k0 + ks[None, :]
        x = tl.load(X + at, mask=mask, other=0.0)
        if HAS_DELTA:  # rounded to x's dtype as the unfused `x + delta` is: the stream keeps the same bits
            x = (x.to(tl.float32) + tl.load(DELTA + at, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        return x, at, mask

    @triton.jit
    def _write_sum(X, DELTA, X_SUM, rows, n_rows, ks, K: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_DELTA: tl.constexpr):
        # The residual stream's next value, written by program 0 in a pass of its own before the projection's loop:
        # the same store under a runtime branch inside that loop kept Triton from pipelining its loads (H200, 1.5B
        # decode step: 2.98 ms against 1.70).
        for k0 in range(0, K, BLOCK_K):
            x, at, mask = _load_sum(X, DELTA, rows, n_rows, k0, ks, K, HAS_DELTA)
            tl.store(X_SUM + at, x, mask=mask)

    @triton.jit
    def _input_block(X, DELTA, NORM, rows, n_rows, k0, ks, sumsq, K: tl.constexpr, HAS_DELTA: tl.constexpr,
                     HAS_NORM: tl.constexpr):
        # Rows of x + delta over columns k0 + ks, times the norm weight; sumsq gathers each row's squares.
        x, at, mask = _load_sum(X, DELTA, rows, n_rows, k0, ks, K, HAS_DELTA)
        k_ok = k0 + ks < K
        if HAS_NORM:
            xf = x.to(tl.float32)
            sumsq += tl.sum(xf * xf, axis=1)
            x = (xf * tl.load(NORM + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
        return x, sumsq

    @triton.jit
    def _qkv_rope_kernel(X, DELTA, NORM, X_SUM, eps, W, B, COS, SIN, POS, Q, CK, CV, n_rows, n_heads, n_kv,
                         stride_rope_pos, stride_ck_h, stride_ck_s, stride_cv_h, stride_cv_s, K: tl.constexpr,
                         HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         HAS_DELTA: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                         INTERLEAVED: tl.constexpr):
        # Program = (head of q, k or v stacked as W_qkv stacks them, PAIRS rope pairs of it). Tile column i holds
        # half i % 2 of pair i // 2, so one dot yields both halves of every pair this program rotates.
        HALF: tl.constexpr = HEAD_DIM // 2
        head = tl.program_id(0) // (HALF // PAIRS)
        first = (tl.program_id(0) % (HALF // PAIRS)) * PAIRS
        cols = tl.arange(0, 2 * PAIRS)
        pair, half = first + cols // 2, cols % 2
        if INTERLEAVED:  # llama.cpp's Llama: dims (2j, 2j + 1)
            dims = 2 * pair + half
        else:  # NeoX, Qwen: dims (j, j + D/2)
            dims = half * HALF + pair
        w_rows = head * HEAD_DIM + dims
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, 2 * PAIRS], tl.float32)
        sumsq = tl.zeros([BLOCK_M], tl.float32)
        if tl.program_id(0) == 0:
            _write_sum(X, DELTA, X_SUM, rows, n_rows, ks, K, BLOCK_K, HAS_DELTA)
        for k0 in range(0, K, BLOCK_K):
            x, sumsq = _input_block(X, DELTA, NORM, rows, n_rows, k0, ks, sumsq, K, HAS_DELTA, HAS_NORM)
            w = tl.load(W + w_rows[:, None] * K + k0 + ks[None, :], mask=(k0 + ks < K)[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_NORM:
            acc *= tl.rsqrt(sumsq / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(B + w_rows).to(tl.float32)[None, :]
        x1, x2 = tl.split(tl.reshape(acc, [BLOCK_M, PAIRS, 2]))  # [BLOCK_M, PAIRS] each: the pairs' two halves
        pairs = first + tl.arange(0, PAIRS)
        dims1 = 2 * pairs if INTERLEAVED else pairs
        dims2 = dims1 + 1 if INTERLEAVED else pairs + HALF
        row_ok = rows < n_rows
        pos = tl.load(POS + rows, mask=row_ok, other=0)
        if head < n_heads + n_kv:  # q or k: rotate
            at = pos[:, None] * stride_rope_pos + pairs[None, :]
            cos = tl.load(COS + at, mask=row_ok[:, None], other=0.0).to(tl.float32)
            sin = tl.load(SIN + at, mask=row_ok[:, None], other=0.0).to(tl.float32)
            x1, x2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        if head < n_heads:
            out = Q + (head * n_rows + rows[:, None]) * HEAD_DIM
            tl.store(out + dims1[None, :], x1.to(Q.dtype.element_ty), mask=row_ok[:, None])
            tl.store(out + dims2[None, :], x2.to(Q.dtype.element_ty), mask=row_ok[:, None])
        elif head < n_heads + n_kv:
            out = CK + (head - n_heads) * stride_ck_h + pos[:, None] * stride_ck_s
            tl.store(out + dims1[None, :], x1.to(CK.dtype.element_ty), mask=row_ok[:, None])
            tl.store(out + dims2[None, :], x2.to(CK.dtype.element_ty), mask=row_ok[:, None])
        else:
            out = CV + (head - n_heads - n_kv) * stride_cv_h + pos[:, None] * stride_cv_s
            tl.store(out + dims1[None, :], x1.to(CV.dtype.element_ty), mask=row_ok[:, None])
            tl.store(out + dims2[None, :], x2.to(CV.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _gate_up_kernel(X, DELTA, NORM, X_SUM, eps, W, OUT, n_rows, F, K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_DELTA: tl.constexpr,
                        HAS_NORM: tl.constexpr, GELU: tl.constexpr):
        # W stacks gate [F, K] over up [F, K]: this program's gate rows and the up rows of the same features.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        col_ok, row_ok = cols < F, rows < n_rows
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        sumsq = tl.zeros([BLOCK_M], tl.float32)
        if tl.program_id(0) == 0:
            _write_sum(X, DELTA, X_SUM, rows, n_rows, ks, K, BLOCK_K, HAS_DELTA)
        for k0 in range(0, K, BLOCK_K):
            x, sumsq = _input_block(X, DELTA, NORM, rows, n_rows, k0, ks, sumsq, K, HAS_DELTA, HAS_NORM)
            w_mask = col_ok[:, None] & (k0 + ks < K)[None, :]
            w_gate = tl.load(W + cols[:, None] * K + k0 + ks[None, :], mask=w_mask, other=0.0)
            w_up = tl.load(W + (F + cols[:, None]) * K + k0 + ks[None, :], mask=w_mask, other=0.0)
            gate = tl.dot(x, tl.trans(w_gate), gate)
            up = tl.dot(x, tl.trans(w_up), up)
        if HAS_NORM:
            rstd = tl.rsqrt(sumsq / K + eps)[:, None]
            gate, up = gate * rstd, up * rstd
        if GELU:  # tanh approximation, Gemma's
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
        else:  # SiLU
            act = gate * tl.sigmoid(gate)
        out = OUT + rows[:, None] * F + cols[None, :]
        tl.store(out, (act * up).to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check_rows(x: torch.Tensor, delta: torch.Tensor | None, op: str) -> int:
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{op} takes at most {MAX_ROWS} tokens, got {x.shape[0]}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"{op}: delta {tuple(delta.shape)} does not match x {tuple(x.shape)}")
    return x.shape[0]


@torch.library.custom_op("tandem::qkv_rope", mutates_args=("cache_k", "cache_v"))
def qkv_rope(x: torch.Tensor, delta: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
             weight: torch.Tensor, bias: torch.Tensor | None, rope: torch.Tensor, positions: torch.Tensor,
             cache_k: torch.Tensor, cache_v: torch.Tensor, n_heads: int,
             interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + delta; h = rms_norm(s) * norm; q, k, v = h @ weight^T + bias; rope on q and k at `positions`; k and
    v written to the cache there. delta None: s = x; norm None: h = s.

    x, delta: [T, d] (T <= MAX_ROWS); weight: [(H + 2 H_kv) D, d], q's rows then k's then v's; rope: [2, slots,
    D/2] cos and sin (Transformer.rope_tables); cache_k/v: [1, H_kv, S, D]. Returns q rotated, [1, H, T, D], and s.
    """
    n_rows = _check_rows(x, delta, "qkv_rope")
    d = x.shape[1]
    n_kv, head_dim = cache_k.shape[1], cache_k.shape[3]
    x, weight = x.contiguous(), weight.contiguous()
    q, x_sum = x.new_empty(1, n_heads, n_rows, head_dim), torch.empty_like(x)
    grid = ((n_heads + 2 * n_kv) * (head_dim // 2 // QKV_PAIRS),)
    _qkv_rope_kernel[grid](
        x, delta.contiguous() if delta is not None else x, norm if norm is not None else x, x_sum, eps, weight,
        bias if bias is not None else weight, rope[0], rope[1], positions, q, cache_k, cache_v,
        n_rows, n_heads, n_kv, rope.stride(1), cache_k.stride(1), cache_k.stride(2), cache_v.stride(1),
        cache_v.stride(2), K=d, HEAD_DIM=head_dim, PAIRS=QKV_PAIRS, BLOCK_M=MAX_ROWS,
        BLOCK_K=QKV_BLOCK_K if d % QKV_BLOCK_K == 0 else 128, HAS_DELTA=delta is not None,
        HAS_NORM=norm is not None, HAS_BIAS=bias is not None, INTERLEAVED=interleaved, **QKV_LAUNCH)
    return q, x_sum


@qkv_rope.register_fake
def _(x, delta, norm, eps, weight, bias, rope, positions, cache_k, cache_v, n_heads, interleaved):
    return x.new_empty(1, n_heads, x.shape[0], cache_k.shape[3]), torch.empty_like(x)


@torch.library.custom_op("tandem::gate_up_act", mutates_args=())
def gate_up_act(x: torch.Tensor, delta: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
                weight: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + delta; h = rms_norm(s) * norm; act(h @ W_gate^T) * (h @ W_up^T), weight = [W_gate; W_up] ([2F, d]);
    act = SiLU, or GELU (tanh) if gelu. delta None: s = x; norm None: h = s. x, delta: [T, d], T <= MAX_ROWS.
    Returns the product, [T, F] in x's dtype, and s."""
    n_rows = _check_rows(x, delta, "gate_up_act")
    x, weight = x.contiguous(), weight.contiguous()
    features = weight.shape[0] // 2
    out, x_sum = x.new_empty(n_rows, features), torch.empty_like(x)
    _gate_up_kernel[(triton.cdiv(features, GATE_UP_BLOCK_N),)](
        x, delta.contiguous() if delta is not None else x, norm if norm is not None else x, x_sum, eps, weight, out,
        n_rows, features, K=x.shape[1], BLOCK_M=MAX_ROWS, BLOCK_N=GATE_UP_BLOCK_N, BLOCK_K=GATE_UP_BLOCK_K,
        HAS_DELTA=delta is not None, HAS_NORM=norm is not None, GELU=gelu, **GATE_UP_LAUNCH)
    return out, x_sum


@gate_up_act.register_fake
def _(x, delta, norm, eps, weight, gelu):
    return x.new_empty(x.shape[0], weight.shape[0] // 2), torch.empty_like(x)
