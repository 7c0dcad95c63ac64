"""tandem.loading.tokenizer on the tiny byte-level BPE embedded in synthetic GGUF files."""

from __future__ import annotations

import pytest

from tandem.loading.gguf import open_gguf
from tandem.loading.tokenizer import REPLACEMENT_CHAR, StreamDecoder, Tokenizer

SAMPLES = [
    "the cat and the hat",
    "Grüße aus Köln, naïve café",
    "emoji 😀👍🏽 and CJK 你好世界",
    "def f(x):\n    return x ** 2  # square\n\n\tTabs\r\n",
    "",
    " leading and trailing spaces  ",
]


@pytest.fixture(scope="module")
def tok(tiny_model_path) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_model_path("qwen2"))


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_merges_apply(tok):
    assert len(tok.encode(" the")) == 1  # "Ġt" + "he" is a merge of the tiny vocabulary
    assert tok.id_to_piece(tok.encode(" the")[0]) == "Ġthe"


def test_special_tokens_are_single_ids(tok):
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tok.encode(special)
        assert len(ids) == 1 and tok.token_to_id(special) == ids[0]
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"


def test_bos_and_eos(tok, tiny_model_path):
    config = open_gguf(tiny_model_path("qwen2")).config
    assert tok.add_bos is False and tok.encode("hi")[0] != tok.bos_token_id
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_token_id == config.bos_token_id
    assert tok.eos_token_ids == config.eos_token_ids
    assert tok.vocab_size == config.vocab_size


def test_padded_vocab(tiny_model_path):
    tok = Tokenizer.from_gguf(tiny_model_path("qwen2", vocab_size=400))
    assert tok.vocab_size == 400 and tok.decode(tok.encode(SAMPLES[2])) == SAMPLES[2]


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    text = tok.apply_chat_template(messages)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and text.endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.encode_chat(messages)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3 and ids.count(tok.token_to_id("<|im_end|>")) == 2
    assert tok.decode(ids) == text


def test_fallback_chatml_when_file_has_no_template(tiny_model_path):
    tok = Tokenizer.from_gguf(tiny_model_path("qwen2", metadata={"tokenizer.chat_template": None}))
    assert tok.chat_template is None
    assert "<|im_start|>user\nhello<|im_end|>" in tok.apply_chat_template([{"role": "user", "content": "hello"}])


def test_template_raise_exception(tiny_model_path):
    template = "{{ raise_exception('no system role allowed') }}"
    tok = Tokenizer.from_gguf(tiny_model_path("qwen2", metadata={"tokenizer.chat_template": template}))
    with pytest.raises(Exception, match="no system role allowed"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("text", SAMPLES + ["ééé😀😀😀你你你", "<|im_start|>user\n你好<|im_end|>"])
def test_stream_decoder(tok, text):
    ids = tok.encode(text)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    tail = stream.flush()
    assert all(REPLACEMENT_CHAR not in p for p in pieces)
    assert "".join(pieces) + tail == tok.decode(ids)
    if text and text[-1].isascii():
        assert tail == ""  # nothing held back once the last character is complete
