"""The GPU decode-attention kernels against plain softmax attention. On CPU they run in Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess: the switch is read when the kernels are defined); skipped without Triton."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

CHECKS = textwrap.dedent("""
    import math, sys
    import torch
    from tandem.models.decode_attention import decode_attention

    device = sys.argv[1]
    gen = torch.Generator().manual_seed(int(sys.argv[2]))

    def reference(q, k, v, positions, scale, window):
        rows = torch.arange(q.shape[2])
        pos = positions.cpu()[rows % positions.shape[0]]
        keys = torch.arange(k.shape[2])
        visible = keys[None] <= pos[:, None]
        if window:
            visible &= keys[None] > pos[:, None] - window
        scores = (q.double().cpu() @ k.double().cpu().transpose(-1, -2)) * scale
        return torch.softmax(scores.masked_fill(~visible, -math.inf), -1) @ v.double().cpu()

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    for dtype in (torch.float16, torch.bfloat16) if device == "cuda" else (torch.float16,):
        for n_kv, group, T, D, start, window in [(2, 6, 9, 128, 200, 0), (1, 7, 9, 64, 3, 0), (2, 4, 1, 32, 700, 0),
                                                  (2, 2, 9, 128, 300, 50), (1, 1, 16, 16, 0, 0)]:
            S = 1600  # the longer span below: 25 chunks, more than the combining kernel unrolls at once
            q = rand(1, n_kv, group * T, D, dtype=dtype)
            k, v = rand(1, n_kv, S, D, dtype=dtype), rand(1, n_kv, S, D, dtype=dtype)
            positions = torch.arange(start, start + T, device=device)
            span = 256
            while span < start + T:
                span *= 2
            out = decode_attention(q, k[:, :, :span], v[:, :, :span], positions, 0.125, window)
            assert out.shape == (T, n_kv * group * D) and out.dtype == q.dtype
            # [1, H_kv, G*T, D] -> [T, H*D]: token t's heads side by side
            expected = reference(q, k[:, :, :span], v[:, :, :span], positions, 0.125, window)
            expected = expected.view(n_kv, group, T, D).permute(2, 0, 1, 3).reshape(T, -1)
            err = (out.double().cpu() - expected).abs().max()
            assert err < 2e-2, (dtype, n_kv, group, T, D, start, window, float(err))
            # Attending over a longer span (a later bucket) must not change a single bit: fixed chunks add zeros.
            longer = decode_attention(q, k, v, positions, 0.125, window)
            assert torch.equal(out, longer), (dtype, n_kv, group, T, D, start, window)
    print("ok")
""")


# Triton's interpreter runs tl.dot as numpy.matmul, whose BLAS kernel may round a row differently with the rows
# beside it (OpenBLAS's Haswell/Zen kernels on a 2-core AMD EPYC: batched != alone, where its SkylakeX kernel and a GPU
# agree). The kernels' batch invariance is what these tests check, not the BLAS's: on the CPU the interpreter's dot
# sums each output on its own (einsum, no BLAS), the same whatever the rows beside it.
INTERPRETER_DOT = """
import numpy as _np, types as _types
import triton.runtime.interpreter as _interpreter

def _matmul(a, b, dtype=None, **kw):
    return _np.einsum("...ij,...jk->...ik", a, b, dtype=dtype, optimize=False)

_interpreter.np = _types.SimpleNamespace(**{**{k: getattr(_np, k) for k in dir(_np) if not k.startswith("__")},
                                            "matmul": _matmul})
"""


def run_script(script: str, device: str, seed: int) -> None:
    """Run `script` (argv: device, seed) in a fresh interpreter; it must print ok."""
    env = dict(os.environ, TRITON_INTERPRET="1" if device == "cpu" else "0")
    script = INTERPRETER_DOT + script if device == "cpu" else script
    done = subprocess.run([sys.executable, "-c", script, device, str(seed)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_attention_matches_softmax_attention_and_ignores_span(seed):
    import torch

    run_script(CHECKS, "cuda" if torch.cuda.is_available() else "cpu", seed)
