"""Shared fixtures: tiny random GGUF files built once per session, and the `real` marker."""

from __future__ import annotations

import os

import pytest
import torch

# Tiny models are all small kernels: with two OpenMP threads on a busy 2-core machine each one waits on the
# other's barrier (seen here: 1.4 ms a forward with one thread, 210 ms with two).
torch.set_num_threads(1)

# Settings that make a tiny file valid for the K-quants (rows must be multiples of 256 values).
K_QUANT_SHAPES = dict(d_model=256, d_ffn=512, n_heads=4, n_kv_heads=2, head_dim=64)


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; repeated so the marker is known when pytest runs without it.
    config.addinivalue_line("markers", "real: needs the real model pair from the registry (slow, ~1.6 GB)")
    # Costs the adaptive policy measures for the tests' models stay out of the user's $TANDEM_HOME.
    import tempfile

    os.environ.setdefault("TANDEM_COSTS", tempfile.mkdtemp(prefix="tandem-costs-"))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_model_path(arch="qwen2", qtype="F32", **kw) -> path of a cached random-weight GGUF.

    K-quant qtypes get K_QUANT_SHAPES unless the caller passes shapes.
    """
    from tandem.loading.synthetic import write_tiny_gguf

    root = tmp_path_factory.mktemp("tiny_gguf")
    cache: dict[tuple, str] = {}

    def make(arch: str = "qwen2", qtype: str = "F32", **kw) -> str:
        if qtype.endswith("_K"):
            kw = {**K_QUANT_SHAPES, **kw}
        key = (arch, qtype, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            path = os.path.join(root, f"{arch}-{qtype}-{len(cache)}.gguf")
            cache[key] = write_tiny_gguf(path, arch=arch, qtype=qtype, **kw)
        return cache[key]

    return make
