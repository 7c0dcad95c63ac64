"""speculative/compat.check_compatible, the only guard against a draft whose token ids mean other text, on the paths
users take: `tandem generate --draft` and tandem.generate(draft=...)."""

from __future__ import annotations

import pytest

import tandem
from tandem.cli import main
from tandem.loading.gguf import open_gguf
from tandem.speculative.compat import VocabularyMismatchError, check_compatible
from tandem.synthetic.tiny_gguf import tiny_vocab


@pytest.fixture(scope="module")
def target_path(tiny_model_path):
    return tiny_model_path(seed=0)


def vocab_size(path: str) -> int:
    return open_gguf(path).config.vocab_size


@pytest.mark.parametrize("why, draft_options, message", [
    ("a vocabulary 200 larger", dict(pad=200), "vocabulary sizes"),
    ("another end-of-sequence id", dict(metadata={"tokenizer.ggml.eos_token_id": 7}), "end-of-sequence ids"),
    ("one BPE merge of many", dict(metadata={"tokenizer.ggml.merges": tiny_vocab()[2][:1]}), "tokenizes differently"),
])
def test_generate_refuses_a_draft_with_another_tokenizer(tiny_model_path, target_path, capsys, why, draft_options,
                                                         message):
    options = dict(draft_options)
    if "pad" in options:
        options["vocab_size"] = vocab_size(target_path) + options.pop("pad")
    draft_path = tiny_model_path(seed=0, **options)
    assert main(["generate", "--model", target_path, "--draft", draft_path, "--backend", "torch", "--prompt", "hi",
                 "--max-tokens", "4"]) == 2, why
    err = capsys.readouterr().err
    assert "cannot draft for target" in err and message in err, err
    with pytest.raises(VocabularyMismatchError, match=message):
        tandem.generate(tandem.load(target_path), prompt="hi", draft=draft_path, max_tokens=4)


@pytest.mark.no_drafts_expected("compatibility only: the adaptive policy may keep another model's weights off")
def test_a_draft_with_the_same_tokenizer_passes(tiny_model_path, target_path, capsys):
    # Padding within 128 ids (Qwen2.5-32B pads to 152064, its small drafts to 151936) and other weights are fine.
    target = tandem.load(target_path)
    for draft_path in (tiny_model_path(seed=1), tiny_model_path(seed=0, vocab_size=vocab_size(target_path) + 100)):
        check_compatible(target, tandem.load(draft_path))
    assert main(["generate", "--model", target_path, "--draft", tiny_model_path(seed=1), "--backend", "torch",
                 "--prompt", "hi", "--max-tokens", "4", "--json"]) == 0
    assert '"finish_reason"' in capsys.readouterr().out
