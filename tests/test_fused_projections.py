"""The GPU projection kernels (tandem.models.fused_projections) against the unfused projections they replace. On
CPU they run in Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the switch is read when the kernels are
defined); skipped without Triton."""

from __future__ import annotations

import importlib.util

import pytest
from test_decode_attention import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

CHECKS = """
import sys
from dataclasses import replace
import torch
import torch.nn.functional as F
from tandem.models import fused_projections
from tandem.synthetic.shapes import get_shape, random_model
from tandem.models.transformer import Transformer, rms_norm, rope_tables

device = sys.argv[1]
gen = torch.Generator().manual_seed(int(sys.argv[2]))

def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

def error(a, b):
    # Worst relative difference of a from b, each element against its own magnitude plus the mean (cancellation)
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs() / (b.abs() + b.abs().mean())).max().item()

def close(a, b, what, roundings=1):
    # Within `roundings` roundings to a's dtype per element
    unit = roundings * 2.0 ** -(8 if a.dtype == torch.bfloat16 else 11)
    worst = error(a, b)
    assert worst < 2 * unit, (what, worst, unit)

def parts_sum_sq(x, n_parts):
    # Sums of squares of each row over n_parts equal parts of its features: [n_parts, T], as the kernels take them
    return x.float().pow(2).reshape(x.shape[0], n_parts, -1).sum(-1).T.contiguous()

for dtype in (torch.float16, torch.bfloat16) if device == "cuda" else (torch.float16,):
    for n_heads, n_kv, head_dim, d, interleaved, bias, T, start, parts in [
            (4, 2, 32, 96, False, True, 9, 40, 3), (2, 1, 16, 64, True, False, 1, 0, 1),
            (6, 2, 64, 200, False, True, 16, 7, 5)]:
        config = replace(get_shape("tiny"), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, d_model=d,
                         rope_interleaved=interleaved)
        rows = (n_heads + 2 * n_kv) * head_dim
        weight, b = rand(rows, d, dtype=dtype, scale=0.1), rand(rows, dtype=dtype) if bias else None
        rope = rope_tables(config, 10000.0, 1.0, 128, dtype, device)
        x = rand(T, d, dtype=dtype, scale=3.0)
        positions = torch.arange(start, start + T, device=device)
        caches = [torch.zeros(1, n_kv, 128, head_dim, dtype=torch.float64 if i < 2 else dtype, device=device)
                  for i in range(4)]

        # The unfused path, as Transformer.project_qkv runs it, in float64 on the same values (the norm's scale is
        # in the weight; the kernel scales each row by 1 / rms after the dot)
        model = Transformer.__new__(Transformer)
        model.config, model.q_width, model.kv_width = config, n_heads * head_dim, n_kv * head_dim
        block = {"attn_qkv.weight": weight.double()} | ({"attn_qkv.bias": b.double()} if bias else {})
        q_ref = model.project_qkv(rms_norm(x.double(), None, 1e-6)[None], block, rope[:, positions].double(),
                                  positions, caches[0], caches[1])
        q = fused_projections.qkv_rope(x, parts_sum_sq(x, parts), 1e-6, weight, b, rope, positions, caches[2],
                                       caches[3], n_heads, interleaved)
        assert q.shape == q_ref.shape and q.dtype == dtype
        close(q, q_ref, ("q", dtype, n_heads, head_dim, interleaved))
        close(caches[2], caches[0], ("k cache", dtype, n_heads, head_dim, interleaved))
        close(caches[3], caches[1], ("v cache", dtype, n_heads, head_dim, interleaved))
        assert caches[2][:, :, :start].abs().sum() == 0 and caches[2][:, :, start + T:].abs().sum() == 0
        # A row's bits do not depend on the other rows (padding rows in a graphed step hold anything).
        other = x.clone()
        other[1:] = rand(T - 1, d, dtype=dtype) if T > 1 else other[1:]
        q_other = fused_projections.qkv_rope(other, parts_sum_sq(other, parts), 1e-6, weight, b, rope, positions,
                                             caches[2], caches[3], n_heads, interleaved)
        assert torch.equal(q_other[:, :, 0], q[:, :, 0])

    for gelu in (False, True):
        for T, d, features, parts in [(9, 96, 160, 2), (1, 64, 16, 1), (16, 200, 72, 8)]:
            x, weight = rand(T, d, dtype=dtype), rand(2 * features, d, dtype=dtype, scale=0.1)
            gate, up = (rms_norm(x.double(), None, 1e-5) @ weight.double().T).chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
            out = fused_projections.gate_up_act(x, parts_sum_sq(x, parts), 1e-5, weight, gelu)
            assert out.shape == (T, features) and out.dtype == dtype
            close(out, act * up, ("gate_up", dtype, gelu, T, d, features))

    # Five slices of K, the last short; one slice narrower than a step of the loop; two slices and three tiles of
    # features, the last tile short
    for T, d, features in [(9, 2404, 40), (1, 64, 16), (16, 1000, 72)]:
        h, weight = rand(T, d, dtype=dtype), rand(features, d, dtype=dtype, scale=0.1)
        residual = rand(T, features, dtype=dtype)
        tiles = fused_projections.split_k_tiles(features)
        arrivals = torch.zeros(tiles, dtype=torch.int32, device=device)
        out, sum_sq = fused_projections.add_linear_split_k(h, weight, residual, arrivals)
        assert out.shape == (T, features) and out.dtype == dtype and sum_sq.shape == (tiles, T)
        close(out, residual.double() + h.double() @ weight.double().T, ("add_linear_split_k", dtype, T, d, features),
              roundings=2)
        assert torch.allclose(sum_sq.sum(0), out.float().pow(2).sum(-1), rtol=1e-5)
        assert not arrivals.any(), "arrival counters left dirty"
        again = fused_projections.add_linear_split_k(h, weight, residual, arrivals)
        assert torch.equal(again[0], out) and torch.equal(again[1], sum_sq), "a second call differs"
        other, other_residual = h.clone(), residual.clone()
        if T > 1:
            other[1:], other_residual[1:] = rand(T - 1, d, dtype=dtype), rand(T - 1, features, dtype=dtype)
        out_other, sum_sq_other = fused_projections.add_linear_split_k(other, weight, other_residual, arrivals)
        assert torch.equal(out_other[0], out[0]) and torch.equal(sum_sq_other[:, 0], sum_sq[:, 0])
        for bad_residual, bad_arrivals in ((residual[:, 1:], arrivals), (residual, torch.zeros_like(arrivals[1:])),
                                           (residual, arrivals.float())):
            try:
                fused_projections.add_linear_split_k(h, weight, bad_residual, bad_arrivals)
                raise AssertionError("a residual or arrivals that do not fit accepted")
            except ValueError as e:
                assert "do not fit" in str(e)
    cache = torch.zeros(1, 1, 32, 16, dtype=dtype, device=device)
    limit = fused_projections.MAX_ROWS  # more rows than that: too many (fewer run as more tiles of rows)
    too_many = rand(limit + 1, 64, dtype=dtype)
    for call in (lambda: fused_projections.add_linear_split_k(too_many, rand(32, 64, dtype=dtype),
                                                              rand(limit + 1, 32, dtype=dtype), arrivals),
                 lambda: fused_projections.gate_up_act(too_many, parts_sum_sq(too_many, 1), 1e-6,
                                                       rand(32, 64, dtype=dtype), False),
                 lambda: fused_projections.qkv_rope(too_many, parts_sum_sq(too_many, 1), 1e-6,
                                                    rand(48, 64, dtype=dtype), None,
                                                    rope_tables(config, 1e4, 1.0, 32, dtype, device),
                                                    torch.arange(limit + 1, device=device), cache, cache.clone(),
                                                    1, False)):
        try:
            call()
            raise AssertionError(f"{limit + 1} rows accepted")
        except ValueError as e:
            assert f"at most {limit}" in str(e)
    try:  # sums of squares of other rows than x's
        fused_projections.gate_up_act(x, parts_sum_sq(x[:1], 1), 1e-6, rand(32, x.shape[1], dtype=dtype), False)
        raise AssertionError("mismatched sums of squares accepted")
    except ValueError as e:
        assert "do not fit" in str(e)

    # In the model: a step through all three kernels (norms inside) is as accurate as the unfused step, both measured
    # against the same weights in float64 (on a GPU the unfused side's cuBLAS may reduce fp16 products in fp16, so the
    # two half-precision paths are not held to each other: that failed at 0.0137 against a 4-rounding bound).
    model = random_model("tiny", device=device, dtype=dtype, n_ctx=256).transformer
    exact = Transformer(model.config, {name: t.double() for name, t in model.w.items()}, 256)
    tokens, positions = torch.arange(3, 12, device=device), torch.arange(20, 29, device=device)
    exact_cache = exact.new_cache(256)
    exact_logits = exact(tokens, positions, exact_cache.k, exact_cache.v)

    errors = {}
    for fused in (False, True):
        model.projection_kernels = model.split_k_outputs = fused
        cache = model.new_cache(256)
        logits = model(tokens, positions, cache.k, cache.v)
        errors[fused] = (error(logits, exact_logits), error(cache.k[-1][:, :, 20:29], exact_cache.k[-1][:, :, 20:29]))
    unit = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    for what, unfused_error, fused_error in zip(("logits", "k cache"), errors[False], errors[True]):
        assert fused_error < 2 * max(unfused_error, 4 * unit), (what, dtype, errors)
print("ok")
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_projection_kernels_match_the_unfused_projections(seed):
    import torch

    run_script(CHECKS, "cuda" if torch.cuda.is_available() else "cpu", seed)
