"""The compiled step (the torch backend's prompt forward on CUDA) compiles at start and never again: a new prompt
length, offset, logits choice or model of the pair must reuse what was compiled (issue 47: a server printed dynamo's
recompile-limit warning and fell back to eager prefills). Run here with Inductor's CPU code, as CUDA runs it."""

import pytest
import torch

from tandem.backends.torch_backend import _compile_step, load_torch
from tandem.backends.torch_sequence import GRAPH_CHUNKS_MAX, prefill_chunks
from tandem.synthetic.tiny_gguf import write_tiny_gguf

pytest.importorskip("triton")  # _compile_step compiles only where Inductor's GPU generator is installed


def test_prefill_chunks_cover_the_prompt_and_end_long():
    for n in (65, 100, 512, 513, 576, 577, 1024, 1025, 1100, 1537):
        chunks = prefill_chunks(n)
        assert [a for a, _ in chunks[1:]] == [b for _, b in chunks[:-1]] and chunks[0][0] == 0 and chunks[-1][1] == n
        assert all(0 < b - a <= 512 for a, b in chunks)
        assert chunks[-1][1] - chunks[-1][0] > GRAPH_CHUNKS_MAX


@pytest.fixture(scope="module")
def compiled_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiled")
    models = []
    for name, layers, seed in (("t", 2, 1), ("d", 1, 2)):  # a target and a draft: the same code, other guards
        path = write_tiny_gguf(folder / f"{name}.gguf", n_layers=layers, context_length=2048, seed=seed)
        model = load_torch(str(path), device="cpu", graphs=False, progress=False)
        model.step, model.compiled_caches = _compile_step(model.transformer), set()
        pool = model.transformer.new_cache(1200, sequences=3)
        model.compile_prompt_forward(pool.row(0))  # what a server's start does, once per model
        models.append((model, pool))
    torch._dynamo.utils.counters.clear()
    return models


def compilations() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def prefill(model, cache, n, start, last_only, taps=()):
    """The step over a prompt of n tokens after `start` cached ones, as the backend chunks it (in inference mode,
    as the backend runs it); checked against the eager forward. taps: layers whose inputs it taps (a head draft's),
    checked too."""
    with torch.inference_mode():
        tokens = torch.arange(n) % 50
        for a, b in prefill_chunks(n):
            args = (tokens[a:b], torch.arange(start + a, start + b), cache.k, cache.v)
            got_taps, want_taps = dict.fromkeys(taps), dict.fromkeys(taps)
            got = model.step(*args, kv_len=start + b, last_only=last_only, tapped=got_taps if taps else None)
            want = model.transformer.forward(*args, kv_len=start + b, last_only=last_only, tapped=want_taps)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            for layer in taps:
                torch.testing.assert_close(got_taps[layer], want_taps[layer], atol=1e-4, rtol=1e-4)


# A compile failure falls back to eager with a warning: fail instead
@pytest.mark.filterwarnings("error:torch.compile failed")
def test_no_prompt_compiles_again(compiled_pair):
    before = compilations()
    for model, pool in compiled_pair:
        for n, start, slot, last_only in ((100, 0, 1, True), (65, 300, 1, True), (128, 0, 2, False),
                                         (513, 0, 0, True), (577, 513, 0, True), (200, 64, 2, False)):
            prefill(model, pool.row(slot), n, start, last_only)
    # a head draft's taps (the layers' inputs, read between the compiled layers) compile nothing either
    model, pool = compiled_pair[0]
    prefill(model, pool.row(1), 100, 0, True, taps=(0, 1))
    assert compilations() == before


def test_negative_control_a_one_token_piece_compiles(compiled_pair):
    model, pool = compiled_pair[0]
    before = compilations()
    with torch.inference_mode():
        model.step(torch.zeros(1, dtype=torch.long), torch.arange(7, 8), pool.row(1).k, pool.row(1).v, kv_len=8)
    assert compilations() > before
