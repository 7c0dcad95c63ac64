"""`tandem.load`'s defaults are the CLI's (one definition, tandem.config): the backend "auto" picks llama.cpp for a
quantised file off CUDA where it is installed, torch for float weights or where a torch dtype is asked for; and
`threads` reaches the backend."""

from __future__ import annotations

import importlib.util

import pytest

import tandem
from tandem.api import pick_backend
from tandem.cli import build_parser
from tandem.config import DEFAULT_BACKEND, DEFAULT_DEVICE

LLAMACPP = importlib.util.find_spec("llama_cpp") is not None


def test_the_python_api_and_the_cli_share_their_defaults():
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert (args.backend, args.device, args.dtype, args.threads) == (DEFAULT_BACKEND, DEFAULT_DEVICE, None, None)
    import inspect

    defaults = {k: v.default for k, v in inspect.signature(tandem.load).parameters.items()}
    assert (defaults["backend"], defaults["device"], defaults["dtype"], defaults["threads"]) == \
        (DEFAULT_BACKEND, DEFAULT_DEVICE, None, None)
    for command in ("serve", "bench", "doctor"):
        assert build_parser().parse_args([command, "--threads", "1"]).threads == 1


@pytest.mark.skipif(not LLAMACPP, reason="llama-cpp-python is not installed")
def test_auto_is_llamacpp_for_quantised_files_on_cpu(tiny_model_path):
    quantised, floats = tiny_model_path(qtype="Q4_0", seed=0), tiny_model_path(seed=0)
    assert pick_backend(quantised, "cpu") == "llama.cpp" and pick_backend(floats, "cpu") == "torch"
    assert pick_backend(quantised, "cpu", "float64") == "torch"  # a torch dtype asks for torch
    assert pick_backend(quantised, "cuda") == "torch"
    model = tandem.load(quantised, threads=1)
    assert (model.backend, model.n_threads) == ("llama.cpp", 1)
    assert tandem.load(quantised, dtype="float64").backend == "torch"
    assert tandem.load(floats).backend == "torch"


def test_threads_must_be_positive(tiny_model_path):
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        tandem.load(tiny_model_path(seed=0), threads=0)
