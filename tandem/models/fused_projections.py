"""A decode step's projections as Triton kernels (GPU, tiles of 16 rows), with the elementwise work around them fused.
More: docs/internals.md."""

from __future__ import annotations

import os

import torch

from tandem.models.kernel_launch import launch_dependents, pdl_options, wait_for_inputs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: Transformer.forward's unfused path serves every device there
    triton = None

DECODE_ROWS = 16  # Transformer.forward runs these kernels for up to this many tokens (a graphed step has 9)
BLOCK_ROWS = 16  # rows a program takes; tl.dot's smallest tile (read at every launch)
# More rows (a batch of sequences) run as more programs, BLOCK_ROWS rows each, every row in the same code and
# reduction order: a row's result does not depend on which or how many rows share the launch (batch-invariant).
MAX_ROWS = 1024
# Launch configurations: the fastest of a sweep on an H200 for the 1.5B and 0.5B shapes: 16 weight rows a qkv
# program (a 1.5B model's q/k/v over 128 programs), 2 x 32 rows a gate/up program.
QKV_PAIRS = 8
QKV_BLOCK_K = 256  # 128 where it does not divide d_model
QKV_LAUNCH = dict(num_warps=2, num_stages=4)
GATE_UP_BLOCK_N = 32
GATE_UP_BLOCK_K = 128
GATE_UP_LAUNCH = dict(num_warps=4, num_stages=3)
SPLIT_BLOCK_N = 32
SPLIT_BLOCK_K = 128
# 32 features a program, 128 of K a step, 4 warps, 4 stages; K in up to 6 slices, none narrower than 384: among the
# best of the sweep for the 1.5B model's output and down projections (faster than cuBLAS with the residual add and
# sums of squares apart). A 1.5B model's projections run 48 x 4 and 48 x 6 programs.
SPLIT_SLICES = 6
SPLIT_MIN_SLICE = 384
SPLIT_LAUNCH = dict(num_warps=4, num_stages=4)


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether these kernels serve a model: Triton, CUDA, half precision, a power-of-two head_dim holding at least
    QKV_PAIRS rope pairs. TANDEM_FUSED_PROJECTIONS=0 turns them off. Asked once per model."""
    return (triton is not None and os.environ.get("TANDEM_FUSED_PROJECTIONS", "1") != "0" and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16) and head_dim >= 2 * QKV_PAIRS
            and head_dim & (head_dim - 1) == 0)


if triton is not None:

    @triton.jit
    def _load_sum_sq(SS, n_parts, stride_ss, rows, row_ok, PARTS: tl.constexpr):
        # Issued before a projection's loop and first used after it, so its latency hides behind the weights'.
        parts = tl.arange(0, PARTS)
        return tl.load(SS + parts[:, None] * stride_ss + rows[None, :],
                       mask=(parts < n_parts)[:, None] & row_ok[None, :], other=0.0)

    @triton.jit
    def _inv_rms(sum_sq, eps, K: tl.constexpr):
        # 1 / rms of each row from the sums of squares of its parts (tiles of features), added in a fixed order.
        return tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)

    @triton.jit
    def _qkv_rope_kernel(X, SS, W, B, COS, SIN, POS, SLOTS, Q, CK, CV, n_rows, n_parts, eps, n_heads, n_kv,
                         stride_xm, stride_ss, stride_rope_pos, stride_ck_b, stride_ck_h, stride_ck_s, stride_cv_b,
                         stride_cv_h, stride_cv_s,
                         K: tl.constexpr, PARTS: tl.constexpr, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                         INTERLEAVED: tl.constexpr, HAS_SLOTS: tl.constexpr, PDL: tl.constexpr):
        # Program = (tile of BLOCK_M rows, head of q, k or v stacked as W_qkv stacks them, PAIRS rope pairs of it);
        # row tiles vary fastest, so the programs reading one slab of weights run together (L2 serves the rest).
        # Tile column i holds half i % 2 of pair i // 2, so one dot yields both halves of every pair it rotates.
        HALF: tl.constexpr = HEAD_DIM // 2
        head = tl.program_id(1) // (HALF // PAIRS)
        first = (tl.program_id(1) % (HALF // PAIRS)) * PAIRS
        cols = tl.arange(0, 2 * PAIRS)
        pair, half = first + cols // 2, cols % 2
        if INTERLEAVED:  # llama.cpp's Llama: dims (2j, 2j + 1)
            dims = 2 * pair + half
        else:  # NeoX, Qwen: dims (j, j + D/2)
            dims = half * HALF + pair
        w_rows = head * HEAD_DIM + dims
        wait_for_inputs(PDL)  # see tandem.models.kernel_launch
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        ks = tl.arange(0, BLOCK_K)
        sum_sq = _load_sum_sq(SS, n_parts, stride_ss, rows, row_ok, PARTS)
        acc = tl.zeros([BLOCK_M, 2 * PAIRS], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + ks < K
            x = tl.load(X + rows[:, None] * stride_xm + k0 + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(W + w_rows[:, None] * K + k0 + ks[None, :], mask=k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        launch_dependents(PDL)
        acc *= _inv_rms(sum_sq, eps, K)[:, None]  # the norm's scale is in W (fuse_projections)
        if HAS_BIAS:
            acc += tl.load(B + w_rows).to(tl.float32)[None, :]
        x1, x2 = tl.split(tl.reshape(acc, [BLOCK_M, PAIRS, 2]))  # [BLOCK_M, PAIRS] each: the pairs' two halves
        pairs = first + tl.arange(0, PAIRS)
        dims1 = 2 * pairs if INTERLEAVED else pairs
        dims2 = dims1 + 1 if INTERLEAVED else pairs + HALF
        pos = tl.load(POS + rows, mask=row_ok, other=0)
        if HAS_SLOTS:  # a pool of sequences: row r's keys and values go to cache row SLOTS[r]; < 0 (padding): nowhere
            slot = tl.load(SLOTS + rows, mask=row_ok, other=-1)
            kv_ok = row_ok & (slot >= 0)
            slot = tl.where(kv_ok, slot, 0)
        else:
            slot = tl.zeros([BLOCK_M], tl.int64)
            kv_ok = row_ok
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
            out = CK + slot[:, None] * stride_ck_b + (head - n_heads) * stride_ck_h + pos[:, None] * stride_ck_s
            tl.store(out + dims1[None, :], x1.to(CK.dtype.element_ty), mask=kv_ok[:, None])
            tl.store(out + dims2[None, :], x2.to(CK.dtype.element_ty), mask=kv_ok[:, None])
        else:
            out = CV + slot[:, None] * stride_cv_b + (head - n_heads - n_kv) * stride_cv_h + pos[:, None] * stride_cv_s
            tl.store(out + dims1[None, :], x1.to(CV.dtype.element_ty), mask=kv_ok[:, None])
            tl.store(out + dims2[None, :], x2.to(CV.dtype.element_ty), mask=kv_ok[:, None])

    @triton.jit
    def _gate_up_kernel(X, SS, W, OUT, n_rows, n_parts, eps, F, stride_xm, stride_ss, stride_om,
                        K: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GELU: tl.constexpr, PDL: tl.constexpr):
        # W stacks gate [F, K] over up [F, K]: this program's gate rows and the up rows of the same features, for
        # one tile of BLOCK_M rows (row tiles vary fastest: see _qkv_rope_kernel).
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        wait_for_inputs(PDL)  # see tandem.models.kernel_launch
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        col_ok, row_ok = cols < F, rows < n_rows
        sum_sq = _load_sum_sq(SS, n_parts, stride_ss, rows, row_ok, PARTS)
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
        launch_dependents(PDL)
        inv_rms = _inv_rms(sum_sq, eps, K)[:, None]  # the norm's scale is in W (fuse_projections)
        gate, up = gate * inv_rms, up * inv_rms
        if GELU:  # tanh approximation, Gemma's
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
        else:  # SiLU
            act = gate * tl.sigmoid(gate)
        out = OUT + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, (act * up).to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _add_linear_split_k_kernel(X, W, R, P, OUT, SS, ARRIVALS, n_rows, N, stride_xm, stride_rm,
                                   K: tl.constexpr, K_SLICE: tl.constexpr, SLICES: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                   PDL: tl.constexpr):
        # Program = (tile of BLOCK_M rows, tile of BLOCK_N output features, slice of K):
        # P[slice] = x[rows, slice] @ W[tile, slice]^T. Row tiles vary fastest (see _qkv_rope_kernel).
        row_tile, tile, piece = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_first = piece * K_SLICE
        wait_for_inputs(PDL)  # see tandem.models.kernel_launch
        rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        col_ok, row_ok = cols < N, rows < n_rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K_SLICE, BLOCK_K):  # a constant trip count, which Triton pipelines (the last slice masks)
            k = k_first + k0 + ks
            k_ok = k < K
            x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        ok = row_ok[:, None] & col_ok[None, :]
        at = rows[:, None] * N + cols[None, :]
        tl.store(P + piece * n_rows * N + at, acc, mask=ok)
        launch_dependents(PDL)
        # Every thread's partial is stored before the arrival (a release) publishes them; the last of the tile's
        # SLICES programs to arrive reads them all from L2 (.cg: not from its own L1, which may hold none of them).
        tl.debug_barrier()
        counter = ARRIVALS + row_tile * tl.num_programs(1) + tile
        if tl.atomic_add(counter, 1, sem="acq_rel") == SLICES - 1:
            total = tl.load(P + at, mask=ok, other=0.0, cache_modifier=".cg")
            for s in range(1, SLICES):  # in slice order, whichever program arrived last
                total += tl.load(P + s * n_rows * N + at, mask=ok, other=0.0, cache_modifier=".cg")
            # As x + linear(h, W) rounds: the product to x's dtype, then the sum
            residual = tl.load(R + rows[:, None] * stride_rm + cols[None, :], mask=ok, other=0.0)
            out = (residual.to(tl.float32) + total.to(OUT.dtype.element_ty).to(tl.float32)).to(OUT.dtype.element_ty)
            tl.store(OUT + at, out, mask=ok)
            out = out.to(tl.float32)  # zero outside the tile's rows and features
            tl.store(SS + tile * n_rows + rows, tl.sum(out * out, 1), mask=row_ok)
            tl.atomic_xchg(counter, 0)  # left as found, for the next projection


def k_slices(k: int) -> tuple[int, int]:
    """How add_linear_split_k splits K: (slices, width of each), at most SPLIT_SLICES slices of about
    SPLIT_MIN_SLICE or more, each a whole number of SPLIT_BLOCK_K wide but the last (which may be short; none is
    empty)."""
    width = -(-k // max(1, min(SPLIT_SLICES, k // SPLIT_MIN_SLICE)))
    width = -(-width // SPLIT_BLOCK_K) * SPLIT_BLOCK_K
    return -(-k // width), width


def sum_squares(x: torch.Tensor) -> torch.Tensor:
    """Each row of x [T, d] as the input kernels' norm takes it: its sum of squares in float32, as [1, T] (one part).
    For a residual stream the compiler wrote (the first layer's, or every layer's with split-K off), where it fuses
    this into the kernel that wrote x."""
    return x.float().pow(2).sum(-1)[None]


def row_tiles(n_rows: int) -> int:
    """Programs of BLOCK_ROWS rows a launch over n_rows rows runs for each tile of its outputs."""
    return -(-n_rows // BLOCK_ROWS)


def _input_norm_args(x: torch.Tensor, sum_sq: torch.Tensor, what: str) -> tuple:
    n_rows = x.shape[0]
    if n_rows > MAX_ROWS:
        raise ValueError(f"{what} takes at most {MAX_ROWS} tokens, got {n_rows}")
    if sum_sq.dim() != 2 or sum_sq.shape[1] != n_rows or sum_sq.dtype != torch.float32:
        raise ValueError(f"{what}: sums of squares {tuple(sum_sq.shape)} {sum_sq.dtype} do not fit x "
                         f"{tuple(x.shape)}")
    return sum_sq.shape[0], sum_sq.stride(0), triton.next_power_of_2(sum_sq.shape[0])


@torch.library.custom_op("tandem::qkv_rope", mutates_args=("cache_k", "cache_v"))
def qkv_rope(x: torch.Tensor, sum_sq: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
             rope: torch.Tensor, positions: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, n_heads: int,
             interleaved: bool, slots: torch.Tensor | None = None) -> torch.Tensor:
    """q, k, v = rms_norm(x) @ weight^T + bias; rope on q and k at `positions`; k and v written to the cache there.

    x: [T, d] (T <= MAX_ROWS), the residual stream; sum_sq: [parts, T], float32 sums of squares of parts of each
    row of x (add_linear_split_k's, or sum_squares'); weight: [(H + 2 H_kv) D, d], q's rows then k's then v's, the
    norm's scale folded in (fuse_projections); rope: [2, slots, D/2] cos and sin (Transformer.rope_tables);
    cache_k/v: [B, H_kv, S, D]: row t's k and v go to cache row slots[t] (int64 [T]; a negative slot: written
    nowhere, a padding row), or to row 0 where slots is None. Returns q rotated: [1, H, T, D].
    """
    n_parts, stride_ss, parts_p2 = _input_norm_args(x, sum_sq, "qkv_rope")
    n_rows, d = x.shape
    n_kv, head_dim = cache_k.shape[1], cache_k.shape[3]
    x, weight = x.contiguous(), weight.contiguous()
    q = x.new_empty(1, n_heads, n_rows, head_dim)
    if slots is not None and slots.shape != (n_rows,):
        raise ValueError(f"qkv_rope: slots {tuple(slots.shape)} do not fit {n_rows} rows")
    grid = (row_tiles(n_rows), (n_heads + 2 * n_kv) * (head_dim // 2 // QKV_PAIRS))
    _qkv_rope_kernel[grid](
        x, sum_sq, weight, bias if bias is not None else weight, rope[0], rope[1], positions,
        slots if slots is not None else positions, q, cache_k, cache_v, n_rows, n_parts, eps, n_heads, n_kv,
        x.stride(0), stride_ss, rope.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(0), cache_v.stride(1), cache_v.stride(2),
        K=d, PARTS=parts_p2, HEAD_DIM=head_dim, PAIRS=QKV_PAIRS, BLOCK_M=BLOCK_ROWS,
        BLOCK_K=QKV_BLOCK_K if d % QKV_BLOCK_K == 0 else 128, HAS_BIAS=bias is not None,
        INTERLEAVED=interleaved, HAS_SLOTS=slots is not None, **QKV_LAUNCH, **pdl_options(x.device))
    return q


@qkv_rope.register_fake
def _(x, sum_sq, eps, weight, bias, rope, positions, cache_k, cache_v, n_heads, interleaved, slots=None):
    return x.new_empty(1, n_heads, x.shape[0], cache_k.shape[3])


@torch.library.custom_op("tandem::gate_up_act", mutates_args=())
def gate_up_act(x: torch.Tensor, sum_sq: torch.Tensor, eps: float, weight: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(h @ W_gate^T) * (h @ W_up^T) with h = rms_norm(x), weight = [W_gate; W_up] ([2F, d]) with the norm's
    scale folded in; act = SiLU, or GELU (tanh) if gelu. x: [T, d], T <= MAX_ROWS; sum_sq as qkv_rope takes it.
    Returns [T, F] in x's dtype."""
    n_parts, stride_ss, parts_p2 = _input_norm_args(x, sum_sq, "gate_up_act")
    n_rows, d = x.shape
    x, weight = x.contiguous(), weight.contiguous()
    features = weight.shape[0] // 2
    out = x.new_empty(n_rows, features)
    _gate_up_kernel[(row_tiles(n_rows), triton.cdiv(features, GATE_UP_BLOCK_N))](
        x, sum_sq, weight, out, n_rows, n_parts, eps, features, x.stride(0), stride_ss, out.stride(0),
        K=d, PARTS=parts_p2, BLOCK_M=BLOCK_ROWS, BLOCK_N=GATE_UP_BLOCK_N, BLOCK_K=GATE_UP_BLOCK_K, GELU=gelu,
        **GATE_UP_LAUNCH, **pdl_options(x.device))
    return out


@gate_up_act.register_fake
def _(x, sum_sq, eps, weight, gelu):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def split_k_tiles(features: int) -> int:
    """Tiles of features add_linear_split_k splits an output into: the parts of its sums of squares, and the
    arrival counters it needs."""
    return -(-features // SPLIT_BLOCK_N)


# `arrivals` is scratch the kernel leaves as it found it (zeros), so the op is declared pure: declared mutated, the
# compiler would copy it before every call, a kernel each.
@torch.library.custom_op("tandem::add_linear_split_k", mutates_args=())
def add_linear_split_k(h: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                       arrivals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + h @ weight^T, and the float32 sums of squares of each of its tiles of features, [tiles, T]
    (qkv_rope's and gate_up_act's sum_sq). h: [T, K], T <= MAX_ROWS; weight: [N, K]; residual: [T, N];
    arrivals: int32 zeros, [row tiles, split_k_tiles(N)] (or [split_k_tiles(N)] for up to BLOCK_ROWS rows), at
    least row_tiles(T) rows of them, used by one projection at a time."""
    n_rows, d = h.shape
    features = weight.shape[0]
    tiles = split_k_tiles(features)
    if n_rows > MAX_ROWS:
        raise ValueError(f"add_linear_split_k takes at most {MAX_ROWS} tokens, got {n_rows}")
    if (residual.shape != (n_rows, features) or arrivals.dtype != torch.int32 or arrivals.dim() > 2
            or arrivals.shape[-1] != tiles or arrivals.numel() < tiles * row_tiles(n_rows)):
        raise ValueError(f"add_linear_split_k: residual {tuple(residual.shape)} or arrivals "
                         f"{tuple(arrivals.shape)} {arrivals.dtype} do not fit a [{n_rows}, {features}] output")
    h, weight = h.contiguous(), weight.contiguous()
    slices, width = k_slices(d)
    partials = h.new_empty(slices, n_rows, features, dtype=torch.float32)
    out = residual.new_empty(n_rows, features)
    sum_sq = h.new_empty(tiles, n_rows, dtype=torch.float32)
    _add_linear_split_k_kernel[(row_tiles(n_rows), tiles, slices)](
        h, weight, residual, partials, out, sum_sq, arrivals, n_rows, features, h.stride(0), residual.stride(0),
        K=d, K_SLICE=width, SLICES=slices, BLOCK_M=BLOCK_ROWS, BLOCK_N=SPLIT_BLOCK_N,
        BLOCK_K=SPLIT_BLOCK_K, **SPLIT_LAUNCH, **pdl_options(h.device))
    return out, sum_sq


# Shapes from the inputs alone (arrivals: one a tile), not from the module's constants, which Inductor's on-disk
# caches do not key on: a graph cached under other constants would fail with "incorrect fake kernel".
@add_linear_split_k.register_fake
def _(h, weight, residual, arrivals):
    return residual.new_empty(h.shape[0], weight.shape[0]), h.new_empty(arrivals.shape[-1], h.shape[0],
                                                                        dtype=torch.float32)


# The input embedding and the logits projection of a batch of sequences (Transformer.forward_packed): the same
# code for every row, so a row's logits do not depend on its batch mates. cuBLAS picks its kernel by the number of
# rows, so its rounding of a row changes with the batch.
LOGITS_BLOCK_N = 64
LOGITS_BLOCK_K = 128
LOGITS_LAUNCH = dict(num_warps=4, num_stages=4)

if triton is not None:

    @triton.jit
    def _embed_kernel(TOKENS, TABLE, OUT, SS, scale, K: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # Program = one row: its token's embedding times scale, and that row's sum of squares (one part).
        row = tl.program_id(0)
        wait_for_inputs(PDL)  # see tandem.models.kernel_launch
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < K
        token = tl.load(TOKENS + row)
        x = (tl.load(TABLE + token * K + ks, mask=k_ok, other=0.0).to(tl.float32) * scale).to(OUT.dtype.element_ty)
        launch_dependents(PDL)
        tl.store(OUT + row * K + ks, x, mask=k_ok)
        x = x.to(tl.float32)
        tl.store(SS + row, tl.sum(x * x, 0))

    @triton.jit
    def _logits_kernel(X, ROWS, SS, NW, W, OUT, n_rows, n_parts, eps, V, stride_xm, stride_ss, stride_om,
                       K: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # Program = (tile of BLOCK_M output rows, tile of BLOCK_N vocabulary entries); output row r is x's row
        # ROWS[r], normalised (rms_norm with the weight NW, rounded to x's dtype) before the dot.
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        wait_for_inputs(PDL)  # see tandem.models.kernel_launch
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok, col_ok = rows < n_rows, cols < V
        src = tl.load(ROWS + rows, mask=row_ok, other=0)
        inv_rms = _inv_rms(_load_sum_sq(SS, n_parts, stride_ss, src, row_ok, PARTS), eps, K)[:, None]
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            x = tl.load(X + src[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(NW + k, mask=k_ok, other=0.0).to(tl.float32)
            h = (x.to(tl.float32) * inv_rms * g[None, :]).to(X.dtype.element_ty)
            w = tl.load(W + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(h, tl.trans(w), acc)
        launch_dependents(PDL)
        tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@torch.library.custom_op("tandem::embed_rows", mutates_args=())
def embed_rows(tokens: torch.Tensor, table: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """table[tokens] * scale ([T, d] in table's dtype) and its rows' float32 sums of squares ([1, T], as qkv_rope
    takes them). tokens: int64 [T]."""
    n_rows, d = tokens.shape[0], table.shape[1]
    out = table.new_empty(n_rows, d)
    sum_sq = table.new_empty(1, n_rows, dtype=torch.float32)
    if n_rows:
        _embed_kernel[(n_rows,)](tokens, table.contiguous(), out, sum_sq, scale, K=d,
                                 BLOCK_K=triton.next_power_of_2(d), num_warps=4, **pdl_options(table.device))
    return out, sum_sq


@embed_rows.register_fake
def _(tokens, table, scale):
    return table.new_empty(tokens.shape[0], table.shape[1]), table.new_empty(1, tokens.shape[0], dtype=torch.float32)


@torch.library.custom_op("tandem::norm_logits", mutates_args=("out",))
def norm_logits(x: torch.Tensor, sum_sq: torch.Tensor, rows: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, out: torch.Tensor) -> None:
    """out[r] = rms_norm(x[rows[r]], norm_weight) @ weight^T in float32, for every r < rows' length.

    x: [T, d]; sum_sq: [parts, T] as qkv_rope takes it; rows: int64 [M], M <= out's rows; weight: [V, d];
    out: float32 [>= M, V], a static buffer (CUDA graphs: written in place, so no graph owns the logits).
    """
    n_out, d = rows.shape[0], x.shape[1]
    n_parts, stride_ss, parts_p2 = sum_sq.shape[0], sum_sq.stride(0), triton.next_power_of_2(sum_sq.shape[0])
    vocab = weight.shape[0]
    if out.dtype != torch.float32 or out.shape[0] < n_out or out.shape[1] != vocab or out.stride(1) != 1:
        raise ValueError(f"norm_logits: out {tuple(out.shape)} {out.dtype} does not fit {n_out} rows of {vocab}")
    _logits_kernel[(row_tiles(n_out), triton.cdiv(vocab, LOGITS_BLOCK_N))](
        x.contiguous(), rows, sum_sq, norm_weight, weight.contiguous(), out, n_out, n_parts, eps, vocab,
        x.stride(0), stride_ss, out.stride(0), K=d, PARTS=parts_p2, BLOCK_M=BLOCK_ROWS, BLOCK_N=LOGITS_BLOCK_N,
        BLOCK_K=LOGITS_BLOCK_K, **LOGITS_LAUNCH, **pdl_options(x.device))
