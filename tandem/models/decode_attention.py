"""Decode attention in two Triton kernels (flash-decoding, Dao et al. 2023): few query rows over a long cache.
More: docs/internals.md."""

from __future__ import annotations

import os

import torch

from tandem.models.kernel_launch import launch_dependents, pdl_options, wait_for_inputs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the matmul path in Transformer.attend serves every device there
    triton = None

CHUNK = 64  # cache slots per program: 4..64 programs per KV head over spans of 256..4096 (128: a step 1.5-3% slower)
COMBINE_ROWS = 16  # query rows per program of the combining kernel ...
COMBINE_DIMS = 32  # ... and head dimensions: registers for COMBINE_UNROLL chunks' partials at once
COMBINE_UNROLL = 16  # chunks the combining kernel reads at once: spans up to 1024 slots in one round trip
MAX_ROWS = 64  # query rows (G heads x T tokens) per KV head that one program holds


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether these kernels serve a model: Triton present, CUDA, half precision (fp32 dots would run as TF32 in
    tl.dot, less exact than the matmul path), and a head_dim Triton's dot takes. TANDEM_DECODE_KERNEL=0 turns
    them off (the matmul path then serves every device). Asked once per model, not per forward."""
    return (triton is not None and os.environ.get("TANDEM_DECODE_KERNEL", "1") != "0" and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16) and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


if triton is not None:

    @triton.jit
    def _chunk_softmax(q, k, v, pos, keys, key_ok, scale, window, HAS_WINDOW: tl.constexpr):
        """One chunk's partial softmax for query rows q at positions pos over keys (their slots): the rows' max
        score, their sum of exp(score - max) and the values weighted by those, [BLOCK_R] x 2 and
        [BLOCK_R, HEAD_DIM] float32. Masked: a key past a row's position, past kv_len, or outside its window."""
        scores = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_R, CHUNK] float32
        visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
        if HAS_WINDOW:
            visible &= keys[None, :] > pos[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        m = tl.max(scores, 1)
        # A row that sees no key in this chunk: exp(-inf - 0) = 0 rather than exp(-inf + inf) = nan.
        p = tl.exp(scores - tl.where(m == float("-inf"), 0.0, m)[:, None])
        return m, tl.sum(p, 1), tl.dot(p.to(v.dtype), v)

    @triton.jit
    def _partial_kernel(Q, K, V, POS, M, L, ACC, stride_qh, stride_qr, stride_kh, stride_ks, stride_vh, stride_vs,
                        n_rows, n_tokens, kv_len, scale, window,
                        HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, PDL: tl.constexpr):
        head, chunk, n_chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        rows = tl.arange(0, BLOCK_R)
        dims = tl.arange(0, HEAD_DIM)
        keys = chunk * CHUNK + tl.arange(0, CHUNK)
        wait_for_inputs(PDL)  # see tandem.models.kernel_launch
        row_ok, key_ok = rows < n_rows, keys < kv_len
        q = tl.load(Q + head * stride_qh + rows[:, None] * stride_qr + dims[None, :], mask=row_ok[:, None], other=0.0)
        k = tl.load(K + head * stride_kh + keys[:, None] * stride_ks + dims[None, :], mask=key_ok[:, None], other=0.0)
        # Issued before the first dot: its round trip to memory overlaps k's instead of following the softmax.
        v = tl.load(V + head * stride_vh + keys[:, None] * stride_vs + dims[None, :], mask=key_ok[:, None], other=0.0)
        # Row r is query head (r // T) of this group at token r % T (see Transformer.attend's reshape).
        pos = tl.load(POS + rows % n_tokens, mask=row_ok, other=-1)
        m, total, acc = _chunk_softmax(q, k, v, pos, keys, key_ok, scale, window, HAS_WINDOW)
        launch_dependents(PDL)
        out = (head * n_chunks + chunk) * BLOCK_R + rows
        tl.store(M + out, m)
        tl.store(L + out, total)
        tl.store(ACC + out[:, None] * HEAD_DIM + dims[None, :], acc)

    @triton.jit
    def _combine_kernel(M, L, ACC, OUT, stride_ot, n_rows, n_tokens, group,
                        HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr, DIMS: tl.constexpr,
                        n_chunks: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)  # see tandem.models.kernel_launch
        head, block, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = block * ROWS + tl.arange(0, ROWS)
        dims = part * DIMS + tl.arange(0, DIMS)
        # Unrolled by COMBINE_UNROLL: the chunks' loads are independent of the sums, so an unrolled body's go out at
        # once, one round trip to L2 where a plain loop of loads (not pipelined) waited once a chunk. Not unrolled
        # whole: at 32k slots (513 chunks) that compiled for over 20 minutes.
        m_max = tl.full([ROWS], float("-inf"), tl.float32)
        for c in tl.range(n_chunks, loop_unroll_factor=UNROLL):
            m_max = tl.maximum(m_max, tl.load(M + (head * n_chunks + c) * BLOCK_R + rows))
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIMS], tl.float32)
        # In slot order, one chunk at a time: a chunk no row sees adds 0 * 0, leaving every sum bit-identical.
        for c in tl.range(n_chunks, loop_unroll_factor=UNROLL):
            at = (head * n_chunks + c) * BLOCK_R + rows
            weight = tl.exp(tl.load(M + at) - m_max)
            total += weight * tl.load(L + at)
            acc += weight[:, None] * tl.load(ACC + at[:, None] * HEAD_DIM + dims[None, :])
        launch_dependents(PDL)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # padding rows (past n_rows) see nothing
        # Row r is query head head * group + r // T at token r % T: stored as [T, H * D], the output projection's
        # input, so no transpose kernel runs between the two.
        at = (rows % n_tokens) * stride_ot + (head * group + rows // n_tokens) * HEAD_DIM
        tl.store(OUT + at[:, None] + dims[None, :], out.to(OUT.dtype.element_ty), mask=(rows < n_rows)[:, None])


    @triton.jit
    def _ragged_partial_kernel(Q, K, V, POS, SEQS, M, L, ACC, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks,
                               stride_vb, stride_vh, stride_vs, group, scale, window,
                               HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
                               HAS_WINDOW: tl.constexpr, PDL: tl.constexpr):
        # _partial_kernel for sequence `seq` of a batch: its rows [first, first + n_tokens) of Q, its cache row
        # `slot`, its keys [0, kv_len). Programs past its keys (or of an empty entry) write nothing; the combining
        # kernel reads only its own chunks.
        head, chunk, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_chunks = tl.num_programs(1)
        # SEQS is copied in before the forward (no kernel writes it): read under the tail of the kernel before
        first, n_tokens = tl.load(SEQS + seq * 4), tl.load(SEQS + seq * 4 + 1)
        slot, kv_len = tl.load(SEQS + seq * 4 + 2), tl.load(SEQS + seq * 4 + 3)
        wait_for_inputs(PDL)  # see tandem.models.kernel_launch; before any exit, so a kernel two back has finished
        if (n_tokens > 0) & (chunk * CHUNK < kv_len):
            rows = tl.arange(0, BLOCK_R)
            dims = tl.arange(0, HEAD_DIM)
            keys = chunk * CHUNK + tl.arange(0, CHUNK)
            n_rows = group * n_tokens
            row_ok, key_ok = rows < n_rows, keys < kv_len
            # Row r is query head head * group + r // n_tokens at token r % n_tokens (as in _partial_kernel).
            token = first + rows % n_tokens
            q_at = (head * group + rows // n_tokens) * stride_qh + token * stride_qr
            q = tl.load(Q + q_at[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
            k = tl.load(K + slot * stride_kb + head * stride_kh + keys[:, None] * stride_ks + dims[None, :],
                        mask=key_ok[:, None], other=0.0)
            v = tl.load(V + slot * stride_vb + head * stride_vh + keys[:, None] * stride_vs + dims[None, :],
                        mask=key_ok[:, None], other=0.0)
            pos = tl.load(POS + token, mask=row_ok, other=-1)
            m, total, acc = _chunk_softmax(q, k, v, pos, keys, key_ok, scale, window, HAS_WINDOW)
            out = ((seq * tl.num_programs(0) + head) * n_chunks + chunk) * BLOCK_R + rows
            tl.store(M + out, m, mask=row_ok)
            tl.store(L + out, total, mask=row_ok)
            tl.store(ACC + out[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        launch_dependents(PDL)

    @triton.jit
    def _ragged_combine_kernel(M, L, ACC, SEQS, OUT, stride_ot, n_kv, n_chunks, group,
                               HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
                               ROWS: tl.constexpr, DIMS: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
        # _combine_kernel for one sequence of a batch, over its own chunks alone: the chunks past its keys would
        # add exactly zero (see _combine_kernel), so its output is the same whatever span the batch attends over.
        head, part = tl.program_id(0), tl.program_id(2)
        blocks: tl.constexpr = BLOCK_R // ROWS
        seq, block = tl.program_id(1) // blocks, tl.program_id(1) % blocks
        first, n_tokens = tl.load(SEQS + seq * 4), tl.load(SEQS + seq * 4 + 1)  # (as in _ragged_partial_kernel)
        kv_len = tl.load(SEQS + seq * 4 + 3)
        wait_for_inputs(PDL)  # see tandem.models.kernel_launch
        n_rows = group * n_tokens
        if block * ROWS < n_rows:
            rows = block * ROWS + tl.arange(0, ROWS)
            dims = part * DIMS + tl.arange(0, DIMS)
            row_ok = rows < n_rows
            own = (kv_len + CHUNK - 1) // CHUNK
            base = (seq * n_kv + head) * n_chunks
            m_max = tl.full([ROWS], float("-inf"), tl.float32)
            for c in tl.range(own, loop_unroll_factor=UNROLL):
                m_max = tl.maximum(m_max, tl.load(M + (base + c) * BLOCK_R + rows, mask=row_ok,
                                                  other=float("-inf")))
            m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
            total = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, DIMS], tl.float32)
            for c in tl.range(own, loop_unroll_factor=UNROLL):  # in slot order
                at = (base + c) * BLOCK_R + rows
                weight = tl.exp(tl.load(M + at, mask=row_ok, other=float("-inf")) - m_max)
                total += weight * tl.load(L + at, mask=row_ok, other=0.0)
                acc += weight[:, None] * tl.load(ACC + at[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None],
                                                 other=0.0)
            out = acc / tl.where(total > 0, total, 1.0)[:, None]
            token = first + rows % n_tokens
            at = token * stride_ot + (head * group + rows // n_tokens) * HEAD_DIM
            tl.store(OUT + at[:, None] + dims[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        launch_dependents(PDL)


@torch.library.custom_op("tandem::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     scale: float, window: int) -> torch.Tensor:
    """softmax(q k^T * scale, causal by positions, within `window` if > 0) v for one sequence.

    q: [1, H_kv, G*T, D], row g*T + t being query head g of the group at token t; keys, values: [1, H_kv, S, D]
    cache slots (S = the span attended over); positions: [T] int64. Returns [T, H_kv*G*D] in q's dtype: token t's
    heads side by side, as the output projection takes them.
    """
    _, n_kv, n_rows, head_dim = q.shape
    kv_len, n_tokens = keys.shape[2], positions.shape[0]
    if n_rows > MAX_ROWS:
        raise ValueError(f"decode_attention takes at most {MAX_ROWS} query rows per KV head, got {n_rows}")
    q = q.contiguous()
    block_r = max(16, triton.next_power_of_2(n_rows))
    n_chunks = triton.cdiv(kv_len, CHUNK)
    m = torch.empty(n_kv, n_chunks, block_r, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    acc = torch.empty(n_kv, n_chunks, block_r, head_dim, dtype=torch.float32, device=q.device)
    _partial_kernel[(n_kv, n_chunks)](
        q, keys, values, positions, m, total, acc, q.stride(1), q.stride(2), keys.stride(1), keys.stride(2),
        values.stride(1), values.stride(2), n_rows, n_tokens, kv_len, scale, window,
        HEAD_DIM=head_dim, BLOCK_R=block_r, CHUNK=CHUNK, HAS_WINDOW=window > 0, num_warps=4, num_stages=1,
        **pdl_options(q.device))
    group = n_rows // n_tokens
    out = q.new_empty(n_tokens, n_kv * group * head_dim)
    dims = min(COMBINE_DIMS, head_dim)
    _combine_kernel[(n_kv, block_r // COMBINE_ROWS, head_dim // dims)](
        m, total, acc, out, out.stride(0), n_rows, n_tokens, group,
        HEAD_DIM=head_dim, BLOCK_R=block_r, ROWS=COMBINE_ROWS, DIMS=dims, n_chunks=n_chunks, UNROLL=COMBINE_UNROLL,
        num_warps=4,
        **pdl_options(q.device))
    return out


@decode_attention.register_fake
def _(q, keys, values, positions, scale, window):
    return q.new_empty(positions.shape[0], q.shape[1] * q.shape[2] // positions.shape[0] * q.shape[3])


@torch.library.custom_op("tandem::ragged_decode_attention", mutates_args=())
def ragged_decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                            seqs: torch.Tensor, span: int, scale: float, window: int) -> torch.Tensor:
    """decode_attention for several sequences in one launch, each over its own cache row and its own keys.

    q: [1, H, N, D], every sequence's rows one after another (qkv_rope's output); cache_k, cache_v: [B, H_kv, S, D]
    pools, a row a sequence; positions: int64 [N]; seqs: int64 [n, 4], per entry (first row, rows, cache row,
    keys it attends over), rows = 0 for an unused entry (a padded batch), rows * (H / H_kv) <= MAX_ROWS; span: the
    most keys any entry attends over (a bucket, so a CUDA graph holds it). Returns [N, H*D]; rows no entry covers
    are left unwritten.
    """
    _, n_heads, n_rows, head_dim = q.shape
    n_kv = cache_k.shape[1]
    group = n_heads // n_kv
    if seqs.dim() != 2 or seqs.shape[1] != 4 or span > cache_k.shape[2]:
        raise ValueError(f"ragged_decode_attention: seqs {tuple(seqs.shape)} (want [n, 4]) or span {span} over a "
                         f"cache of {cache_k.shape[2]} slots")
    q = q.contiguous()
    n_seqs, n_chunks = seqs.shape[0], triton.cdiv(span, CHUNK)
    # One block of MAX_ROWS rows whatever the batch: a row's reductions are laid out the same in every launch.
    m = torch.empty(n_seqs, n_kv, n_chunks, MAX_ROWS, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    acc = torch.empty(n_seqs, n_kv, n_chunks, MAX_ROWS, head_dim, dtype=torch.float32, device=q.device)
    _ragged_partial_kernel[(n_kv, n_chunks, n_seqs)](
        q, cache_k, cache_v, positions, seqs, m, total, acc, q.stride(1), q.stride(2), cache_k.stride(0),
        cache_k.stride(1), cache_k.stride(2), cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), group, scale,
        window, HEAD_DIM=head_dim, BLOCK_R=MAX_ROWS, CHUNK=CHUNK, HAS_WINDOW=window > 0, num_warps=4,
        num_stages=1, **pdl_options(q.device))
    out = q.new_empty(n_rows, n_heads * head_dim)
    dims = min(COMBINE_DIMS, head_dim)
    _ragged_combine_kernel[(n_kv, n_seqs * (MAX_ROWS // COMBINE_ROWS), head_dim // dims)](
        m, total, acc, seqs, out, out.stride(0), n_kv, n_chunks, group,
        HEAD_DIM=head_dim, BLOCK_R=MAX_ROWS, CHUNK=CHUNK, ROWS=COMBINE_ROWS, DIMS=dims, UNROLL=COMBINE_UNROLL,
        num_warps=4,
        **pdl_options(q.device))
    return out


@ragged_decode_attention.register_fake
def _(q, cache_k, cache_v, positions, seqs, span, scale, window):
    return q.new_empty(q.shape[2], q.shape[1] * q.shape[3])
