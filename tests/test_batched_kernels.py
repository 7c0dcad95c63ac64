"""The GPU kernels over a batch of sequences (Transformer.forward_packed's): each against a per-sequence
reference, and batch-invariant: a row's result is bit for bit the one it gets alone. On CPU they run in Triton's
interpreter (in a subprocess, as tests/test_decode_attention.py runs them); skipped without Triton."""

from __future__ import annotations

import importlib.util

import pytest
from test_decode_attention import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

ATTENTION = """
import math, sys
import torch
from tandem.models.decode_attention import ragged_decode_attention

device = sys.argv[1]
gen = torch.Generator().manual_seed(int(sys.argv[2]))

def rand(*shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

def reference(q, k, v, positions, scale, window):  # q [H, T, D], k/v [H_kv, S, D]: [T, H*D] in float64
    H, T, D = q.shape
    group = H // k.shape[0]
    keys = torch.arange(k.shape[1])
    visible = keys[None] <= positions.cpu()[:, None]
    if window:
        visible &= keys[None] > positions.cpu()[:, None] - window
    k, v = k.double().cpu().repeat_interleave(group, 0), v.double().cpu().repeat_interleave(group, 0)
    scores = (q.double().cpu() @ k.transpose(-1, -2)) * scale
    out = torch.softmax(scores.masked_fill(~visible, -math.inf), -1) @ v  # [H, T, D]
    return out.transpose(0, 1).reshape(T, H * D)

for dtype in (torch.float16, torch.bfloat16) if device == "cuda" else (torch.float16,):
    for n_kv, group, D, window in [(2, 6, 64, 0), (1, 7, 32, 0), (2, 2, 32, 40)]:
        B, S = 4, 384
        pool_k, pool_v = rand(B, n_kv, S, D, dtype=dtype), rand(B, n_kv, S, D, dtype=dtype)
        # (slot, start, rows): a verify of 9 rows, a one-token step, a prompt piece, a sequence at position 0
        entries = [(2, 200, 9), (0, 36, 1), (3, 301, 4), (1, 0, 1)]
        entries = [(s, start, min(T, 64 // group)) for s, start, T in entries]
        n = sum(T for _, _, T in entries)
        q = rand(1, n_kv * group, n, D, dtype=dtype)
        positions = torch.cat([torch.arange(start, start + T) for _, start, T in entries]).to(device)
        seqs, first = [], 0
        for slot, start, T in entries:
            seqs.append([first, T, slot, start + T])
            first += T
        seqs_t = torch.tensor(seqs + [[0, 0, 0, 0]], device=device)  # and an unused entry
        out = ragged_decode_attention(q, pool_k, pool_v, positions, seqs_t, S, 0.125, window)
        assert out.shape == (n, n_kv * group * D) and out.dtype == dtype
        for (slot, start, T), (first, _, _, kv_len) in zip(entries, seqs):
            rows = slice(first, first + T)
            expected = reference(q[0, :, rows], pool_k[slot, :, :kv_len], pool_v[slot, :, :kv_len],
                                 positions[rows], 0.125, window)
            err = (out[rows].double().cpu() - expected).abs().max()
            assert err < 2e-2, (dtype, n_kv, group, D, slot, float(err))
            # Alone (its own rows only, a shorter span): the same bits
            alone_seqs = torch.tensor([[0, T, slot, kv_len]], device=device)
            span = 64 * -(-kv_len // 64)
            alone = ragged_decode_attention(q[:, :, rows].contiguous(), pool_k, pool_v, positions[rows].contiguous(),
                                            alone_seqs, span, 0.125, window)
            assert torch.equal(alone, out[rows]), (dtype, n_kv, group, D, slot)
print("ok")
"""

PROJECTIONS = """
import sys
import torch
import torch.nn.functional as F
from dataclasses import replace
from tandem.models import fused_projections as fp
from tandem.synthetic.shapes import get_shape
from tandem.models.transformer import apply_rope, rms_norm, rope_tables

device = sys.argv[1]
gen = torch.Generator().manual_seed(int(sys.argv[2]))

def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

def close(a, b, what, tol):
    a, b = a.double().cpu(), b.double().cpu()
    worst = ((a - b).abs() / (b.abs() + b.abs().mean())).max().item()
    assert worst < tol, (what, worst)

dtype = torch.float16 if device == "cpu" else torch.bfloat16  # the interpreter has no bf16
n_heads, n_kv, D, d, F_ = 4, 2, 32, 96, 80
N = 37  # three tiles of 16 rows, the last one short
config = replace(get_shape("tiny"), n_heads=n_heads, n_kv_heads=n_kv, head_dim=D, d_model=d)
rope = rope_tables(config, 10000.0, 1.0, 128, dtype, device)
x = rand(N, d, dtype=dtype, scale=3.0)
sum_sq = x.float().pow(2).sum(-1)[None].contiguous()
picks = [3, 17, 36]  # rows computed alone below, one a tile

# qkv_rope with a pool: row t's k, v land in cache row slots[t] at positions[t]; slot -1 writes nowhere
weight = rand((n_heads + 2 * n_kv) * D, d, dtype=dtype, scale=0.1)
bias = rand((n_heads + 2 * n_kv) * D, dtype=dtype)
positions = torch.randint(0, 100, (N,), generator=gen).to(device)
slots = torch.randint(0, 3, (N,), generator=gen).to(device)
slots[5] = -1
pos_slot = [(int(s), int(p)) for s, p in zip(slots.tolist(), positions.tolist())]
for i in range(N):  # distinct (slot, position) pairs: no two rows write one cache slot
    while pos_slot[i] in pos_slot[:i]:
        positions[i] = (positions[i] + 1) % 100
        pos_slot[i] = (int(slots[i]), int(positions[i]))
ck = torch.zeros(4, n_kv, 128, D, dtype=dtype, device=device)
cv = torch.zeros_like(ck)
q = fp.qkv_rope(x, sum_sq, 1e-6, weight, bias, rope, positions, ck, cv, n_heads, False, slots)
h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)  # unrounded, as the kernels scale
qkv = h @ weight.double().T + bias.double()
cos, sin = rope[0, positions].double(), rope[1, positions].double()
q_ref = apply_rope(qkv[:, : n_heads * D].view(N, n_heads, D).transpose(0, 1), cos, sin, False)
k_ref = apply_rope(qkv[:, n_heads * D : (n_heads + n_kv) * D].view(N, n_kv, D).transpose(0, 1), cos, sin, False)
v_ref = qkv[:, (n_heads + n_kv) * D :].view(N, n_kv, D).transpose(0, 1)
close(q[0], q_ref, "q", 1e-2)
for t in range(N):
    s, p = int(slots[t]), int(positions[t])
    if s >= 0:
        close(ck[s, :, p], k_ref[:, t], "k", 1e-2)
        close(cv[s, :, p], v_ref[:, t], "v", 1e-2)
assert ck[3].abs().sum() == 0 and cv[3].abs().sum() == 0, "a cache row no slot names was written"
written = sum(1 for s in slots.tolist() if s >= 0)
assert int((ck.abs().sum(-1) > 0).sum()) == written * n_kv, "padding row wrote the cache"
for t in picks:  # alone: the same bits
    ck1, cv1 = torch.zeros_like(ck), torch.zeros_like(cv)
    q1 = fp.qkv_rope(x[t : t + 1], sum_sq[:, t : t + 1].contiguous(), 1e-6, weight, bias, rope,
                     positions[t : t + 1], ck1, cv1, n_heads, False, slots[t : t + 1])
    assert torch.equal(q1[0, :, 0], q[0, :, t]), ("qkv_rope alone", t)

# gate_up_act and add_linear_split_k over 37 rows: against the reference, and alone the same bits
gu = rand(2 * F_, d, dtype=dtype, scale=0.1)
act = fp.gate_up_act(x, sum_sq, 1e-6, gu, False)
g, u = (h @ gu.double().T).chunk(2, -1)
close(act, F.silu(g) * u, "gate_up_act", 2e-2)
down = rand(d, F_, dtype=dtype, scale=0.1)
tiles = fp.split_k_tiles(d)
arrivals = torch.zeros(fp.row_tiles(N), tiles, dtype=torch.int32, device=device)
out, ss = fp.add_linear_split_k(act, down, x, arrivals)
close(out, x.double() + act.double() @ down.double().T, "add_linear_split_k", 2e-2)
assert not arrivals.any(), "arrival counters left dirty"
close(ss.sum(0), out.float().pow(2).sum(-1), "sums of squares", 1e-5)
for t in picks:
    a1 = fp.gate_up_act(x[t : t + 1], sum_sq[:, t : t + 1].contiguous(), 1e-6, gu, False)
    assert torch.equal(a1[0], act[t]), ("gate_up_act alone", t)
    o1, s1 = fp.add_linear_split_k(act[t : t + 1], down, x[t : t + 1], arrivals[:1])
    assert torch.equal(o1[0], out[t]) and torch.equal(s1[:, 0], ss[:, t]), ("add_linear_split_k alone", t)

# embed_rows and norm_logits: rows picked by index, against rms_norm + linear
table = rand(50, d, dtype=dtype)
tokens = torch.randint(0, 50, (N,), generator=gen).to(device)
emb, emb_ss = fp.embed_rows(tokens, table, 2.0)
assert torch.equal(emb, table[tokens] * torch.tensor(2.0, dtype=dtype))
close(emb_ss[0], emb.float().pow(2).sum(-1), "embedding sums of squares", 1e-5)
V = 200  # not a multiple of the vocabulary tile
head = rand(V, d, dtype=dtype, scale=0.1)
norm = rand(d, dtype=dtype)
rows = torch.tensor([36, 0, 5, 5, 20, 17] * 4, device=device)  # 24 rows: two tiles
logits = torch.full((32, V), float("nan"), device=device)
fp.norm_logits(out, ss, rows, norm, 1e-6, head, logits)
expected = rms_norm(out[rows], norm, 1e-6).double() @ head.double().T
close(logits[:24], expected, "norm_logits", 2e-2)
assert logits[24:].isnan().all(), "rows past the index written"
for r in (0, 4, 23):
    one = torch.empty(1, V, device=device)
    fp.norm_logits(out, ss, rows[r : r + 1].contiguous(), norm, 1e-6, head, one)
    assert torch.equal(one[0], logits[r]), ("norm_logits alone", r)
print("ok")
"""


@pytest.mark.parametrize("seed", [0])
def test_ragged_attention_matches_reference_and_alone(seed):
    import torch

    run_script(ATTENTION, "cuda" if torch.cuda.is_available() else "cpu", seed)


@pytest.mark.parametrize("seed", [0])
def test_projections_over_row_tiles_match_reference_and_alone(seed):
    import torch

    run_script(PROJECTIONS, "cuda" if torch.cuda.is_available() else "cpu", seed)
