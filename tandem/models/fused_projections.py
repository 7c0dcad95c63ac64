"""A decode step's projections as Triton kernels (GPU, <= 16 rows): inputs with their elementwise work fused in,
outputs split over K.

A graphed decode step of a small model is bound by its kernels' fixed costs, not by bytes: on an H200 the q/k/v
projection of a 1.5B model took 4.9 us for 6 MB, then three more kernels (bias + rope for q, for k, cache writes)
~1.5 us each plus their gaps; gate/up took 16.9 us and the SwiGLU product another kernel. Here
 - `qkv_rope`: x @ W_qkv^T + b, rope on q and k, k and v written into the cache at their positions: one kernel;
 - `gate_up_act`: act(x @ W_gate^T) * (x @ W_up^T): one kernel, the [T, 2F] intermediate never stored;
 - `linear_split_k`: x @ W^T for the output and down projections as float32 partial sums over slices of K. Their
   outputs are narrow (d_model features) and their K wide (8960 for down): split by features alone, a 1.5B model's
   down projection fills a third of an H200's SMs. cuBLAS splits K too but reduces in a kernel of its own (9.7 +
   1.6 us); here the caller adds the partials where the compiler fuses those adds into the residual add and the next
   RMS norm, one kernel fewer a projection, in a fixed order (the reduction is deterministic).
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
SPLIT_BLOCK_N = 32
SPLIT_BLOCK_K = 128
# 32 features a program, 128 of K a step, 4 warps, 4 stages: bench/gpu_kernels.py's best for the 1.5B model's down
# projection on an H200 (9.8 us a layer against cuBLAS's 12.1), within 2% of the best for its output projection.
# Always 8 slices: a constant, so that the caller's adds over the partials are 7 elementwise adds whatever the
# shapes (which the compiler traces as symbols), fused into the residual add and the norm after them. A 1.5B model's
# projections run 48 x 8 programs.
SPLIT_SLICES = 8
SPLIT_LAUNCH = dict(num_warps=4, num_stages=4)


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether these kernels serve a model: Triton, CUDA, half precision, a power-of-two head_dim holding at least
    QKV_PAIRS rope pairs. TANDEM_FUSED_PROJECTIONS=0 turns them off. Asked once per model."""
    return (triton is not None and os.environ.get("TANDEM_FUSED_PROJECTIONS", "1") != "0" and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16) and head_dim >= 2 * QKV_PAIRS
            and head_dim & (head_dim - 1) == 0)


if triton is not None:

    @triton.jit
    def _qkv_rope_kernel(X, W, B, COS, SIN, POS, Q, CK, CV, n_rows, n_heads, n_kv, stride_xm, stride_rope_pos,
                         stride_ck_h, stride_ck_s, stride_cv_h, stride_cv_s, K: tl.constexpr,
                         HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr):
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
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + ks < K
            x = tl.load(X + rows[:, None] * stride_xm + k0 + ks[None, :], mask=(rows < n_rows)[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(W + w_rows[:, None] * K + k0 + ks[None, :], mask=k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
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
    def _gate_up_kernel(X, W, OUT, n_rows, F, stride_xm, stride_om, K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GELU: tl.constexpr):
        # W stacks gate [F, K] over up [F, K]: this program's gate rows and the up rows of the same features.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        col_ok, row_ok = cols < F, rows < n_rows
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + ks < K
            x = tl.load(X + rows[:, None] * stride_xm + k0 + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_mask = col_ok[:, None] & k_ok[None, :]
            w_gate = tl.load(W + cols[:, None] * K + k0 + ks[None, :], mask=w_mask, other=0.0)
            w_up = tl.load(W + (F + cols[:, None]) * K + k0 + ks[None, :], mask=w_mask, other=0.0)
            gate = tl.dot(x, tl.trans(w_gate), gate)
            up = tl.dot(x, tl.trans(w_up), up)
        if GELU:  # tanh approximation, Gemma's
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
        else:  # SiLU
            act = gate * tl.sigmoid(gate)
        out = OUT + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, (act * up).to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


    @triton.jit
    def _linear_split_k_kernel(X, W, P, n_rows, N, stride_xm, K: tl.constexpr, K_SLICE: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Program = (BLOCK_N output features, slice of K): P[slice, rows, features] = x[:, slice] @ W[features, slice]^T
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_first = tl.program_id(1) * K_SLICE
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        col_ok, row_ok = cols < N, rows < n_rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K_SLICE, BLOCK_K):  # a constant trip count, which Triton pipelines; K_SLICE % BLOCK_K == 0
            k = k_first + k0 + ks
            k_ok = k < K
            x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        out = P + (tl.program_id(1) * n_rows + rows[:, None]) * N + cols[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


def k_slice_width(k: int) -> int:
    """Width of each of linear_split_k's SPLIT_SLICES slices of K: a whole number of SPLIT_BLOCK_K (slices past K
    hold zeros)."""
    width = -(-k // SPLIT_SLICES)
    return -(-width // SPLIT_BLOCK_K) * SPLIT_BLOCK_K


@torch.library.custom_op("tandem::qkv_rope", mutates_args=("cache_k", "cache_v"))
def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rope: torch.Tensor,
             positions: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, n_heads: int,
             interleaved: bool) -> torch.Tensor:
    """q, k, v = x @ weight^T + bias; rope on q and k at `positions`; k and v written to the cache there.

    x: [T, d] (T <= MAX_ROWS); weight: [(H + 2 H_kv) D, d], q's rows then k's then v's; rope: [2, slots, D/2]
    cos and sin (Transformer.rope_tables); cache_k/v: [1, H_kv, S, D]. Returns q rotated: [1, H, T, D].
    """
    n_rows, d = x.shape
    n_kv, head_dim = cache_k.shape[1], cache_k.shape[3]
    if n_rows > MAX_ROWS:
        raise ValueError(f"qkv_rope takes at most {MAX_ROWS} tokens, got {n_rows}")
    x, weight = x.contiguous(), weight.contiguous()
    q = x.new_empty(1, n_heads, n_rows, head_dim)
    grid = ((n_heads + 2 * n_kv) * (head_dim // 2 // QKV_PAIRS),)
    _qkv_rope_kernel[grid](
        x, weight, bias if bias is not None else weight, rope[0], rope[1], positions, q, cache_k, cache_v,
        n_rows, n_heads, n_kv, x.stride(0), rope.stride(1), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(1), cache_v.stride(2),
        K=d, HEAD_DIM=head_dim, PAIRS=QKV_PAIRS, BLOCK_M=MAX_ROWS,
        BLOCK_K=QKV_BLOCK_K if d % QKV_BLOCK_K == 0 else 128, HAS_BIAS=bias is not None,
        INTERLEAVED=interleaved, **QKV_LAUNCH)
    return q


@qkv_rope.register_fake
def _(x, weight, bias, rope, positions, cache_k, cache_v, n_heads, interleaved):
    return x.new_empty(1, n_heads, x.shape[0], cache_k.shape[3])


@torch.library.custom_op("tandem::gate_up_act", mutates_args=())
def gate_up_act(x: torch.Tensor, weight: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(x @ W_gate^T) * (x @ W_up^T), weight = [W_gate; W_up] ([2F, d]); act = SiLU, or GELU (tanh) if gelu.
    x: [T, d], T <= MAX_ROWS. Returns [T, F] in x's dtype."""
    n_rows, d = x.shape
    if n_rows > MAX_ROWS:
        raise ValueError(f"gate_up_act takes at most {MAX_ROWS} tokens, got {n_rows}")
    x, weight = x.contiguous(), weight.contiguous()
    features = weight.shape[0] // 2
    out = x.new_empty(n_rows, features)
    _gate_up_kernel[(triton.cdiv(features, GATE_UP_BLOCK_N),)](
        x, weight, out, n_rows, features, x.stride(0), out.stride(0), K=d,
        BLOCK_M=MAX_ROWS, BLOCK_N=GATE_UP_BLOCK_N, BLOCK_K=GATE_UP_BLOCK_K, GELU=gelu, **GATE_UP_LAUNCH)
    return out


@gate_up_act.register_fake
def _(x, weight, gelu):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@torch.library.custom_op("tandem::linear_split_k", mutates_args=())
def linear_split_k(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T as float32 partial sums over slices of K: [SPLIT_SLICES, T, N] whose sum over the first
    dimension is the product. x: [T, K], T <= MAX_ROWS; weight: [N, K]."""
    n_rows, d = x.shape
    if n_rows > MAX_ROWS:
        raise ValueError(f"linear_split_k takes at most {MAX_ROWS} tokens, got {n_rows}")
    x, weight = x.contiguous(), weight.contiguous()
    features = weight.shape[0]
    partials = x.new_empty(SPLIT_SLICES, n_rows, features, dtype=torch.float32)
    _linear_split_k_kernel[(triton.cdiv(features, SPLIT_BLOCK_N), SPLIT_SLICES)](
        x, weight, partials, n_rows, features, x.stride(0), K=d, K_SLICE=k_slice_width(d),
        BLOCK_M=MAX_ROWS, BLOCK_N=SPLIT_BLOCK_N, BLOCK_K=SPLIT_BLOCK_K, **SPLIT_LAUNCH)
    return partials


@linear_split_k.register_fake
def _(x, weight):
    return x.new_empty(SPLIT_SLICES, x.shape[0], weight.shape[0], dtype=torch.float32)


def add_partials(partials: torch.Tensor) -> torch.Tensor:
    """linear_split_k's partials [S, T, N] summed in slice order, float32. Added one by one, not .sum(0): Inductor
    made that a reduction kernel of its own over the outer dimension (9.5 us on an H200, more than the projection);
    S - 1 elementwise adds fuse into the residual add and the norm that consume them."""
    total = partials[0]
    for i in range(1, partials.shape[0]):
        total = total + partials[i]
    return total
