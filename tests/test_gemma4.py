"""Gemma 4 on the llama.cpp backend: tiny random gemma4 GGUFs of both layouts (the 31B's dense tensors and E2B's
per-layer embeddings with shared KV layers) load, decode and speculate; tokenizer and chat template come from the
file; the vocabulary check pairs the two layouts; the torch backend refuses gemma4 and names llama.cpp."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

from conftest import assert_speculated  # noqa: E402

import tandem  # noqa: E402
from tandem.engine import Engine, Request  # noqa: E402
from tandem.loading.gguf import GGUFError, open_gguf  # noqa: E402
from tandem.loading.tokenizer import Tokenizer  # noqa: E402
from tandem.speculative.compat import VocabularyMismatchError, check_compatible  # noqa: E402

LAYOUTS = {"dense": dict(layout="dense", n_layers=3), "e2b": dict(layout="e2b", n_layers=4)}
# A sliding window of 8 tokens: every prompt and generation below crosses it several times.
PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "{\"name\": \"tandem\", \"items\": [1, 2,", "hi"]


def gemma4_path(tiny_model_path, layout: str, qtype: str = "Q8_0", seed: int = 5) -> str:
    return tiny_model_path(arch="gemma4", qtype=qtype, seed=seed, tie_embeddings=True, **LAYOUTS[layout])


@pytest.fixture(scope="module")
def pairs(tiny_model_path):
    """layout -> (target, draft): Q8_0 and Q4_0 quantizations of the same random weights (the dense draft agrees
    about half the time, the e2b one about a tenth: both accept and reject)."""
    loaded = {
        layout: tuple(
            tandem.load(gemma4_path(tiny_model_path, layout, qtype), backend="llama.cpp", n_ctx=256, n_threads=1)
            for qtype in ("Q8_0", "Q4_0")
        )
        for layout in LAYOUTS
    }
    yield loaded
    for pair in loaded.values():
        for model in pair:
            model.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loads_and_decodes_both_layouts(pairs, layout):
    target, _ = pairs[layout]
    config = target.config
    assert (config.architecture, target.backend) == ("gemma4", "llama.cpp")
    assert config.head_dim == 32 and config.global_head_dim == 64 and config.sliding_window == 8
    assert config.sliding_layers == ((True, True, False) if layout == "dense" else (True, False, True, False))
    ids = target.tokenizer.encode(PROMPTS[0])
    seq = target.new_sequence()
    logits = seq.forward(ids)
    assert logits.shape == (len(ids), target.vocab_size) and torch.isfinite(logits).all()
    # Final logit soft-capping (30): no logit reaches the cap.
    assert logits.abs().max() < 30
    seq.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensors_of_each_layout(tiny_model_path, layout):
    gf = open_gguf(gemma4_path(tiny_model_path, layout))
    names = set(gf.tensor_names)
    assert "rope_freqs.weight" in names and "output.weight" not in names
    assert "blk.0.layer_output_scale.weight" in names and "blk.0.post_ffw_norm.weight" in names
    if layout == "dense":  # full-attention layers take V = K
        assert "blk.2.attn_k.weight" in names and "blk.2.attn_v.weight" not in names
        assert not any(name.startswith("per_layer") for name in names)
    else:  # per-layer embeddings; the last two layers reuse earlier layers' KV and have a double-wide FFN
        assert {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "blk.3.inp_gate.weight"} <= names
        assert "blk.1.attn_v.weight" in names and "blk.2.attn_k.weight" not in names
        assert gf.tensor_shape("blk.3.ffn_up.weight")[0] == 2 * gf.tensor_shape("blk.0.ffn_up.weight")[0]


def test_tokenizer_agrees_with_llamacpp_and_chat_template_renders(pairs, monkeypatch):
    import llama_cpp.llama_cpp as llc

    target, _ = pairs["dense"]
    tokenizer = target.tokenizer
    vocab = llc.llama_model_get_vocab(target._model)
    for text in [*PROMPTS, "héllo  wörld\n\n\tx", "<|turn>user\nhi<turn|>\n"]:
        raw = text.encode()
        buffer = (llc.llama_token * 256)()
        n = llc.llama_tokenize(vocab, raw, len(raw), buffer, 256, True, True)
        assert tokenizer.encode(text) == list(buffer[:n]), text
        assert tokenizer.decode(tokenizer.encode(text, add_bos=False)) == text
    # Without transformers' gemma4 converter (older transformers), tandem's own fallback builds the same tokenizer.
    import transformers.integrations.gguf as hf_gguf

    def unknown_type(architecture, tokenizer_dict):
        raise ValueError(f"Cannot build a tokenizer from a GGUF file stating tokenizer {'gemma4'!r}")

    monkeypatch.setattr(hf_gguf, "convert_gguf_tokenizer", unknown_type)
    fallback = Tokenizer.from_gguf(target.path)
    for text in [*PROMPTS, "héllo  wörld\n\n\tx €", "<|turn>user\nhi<turn|>\n"]:
        assert fallback.encode(text) == tokenizer.encode(text) and fallback.decode(tokenizer.encode(text)) == (
            tokenizer.decode(tokenizer.encode(text))), text
    messages = [{"role": "user", "content": "hi there "}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<bos><|turn>user\nhi there<turn|>\n<|turn>model\nhello<turn|>\n<|turn>user\nagain<turn|>\n<|turn>model\n"
    )
    ids = tokenizer.encode_chat(messages[:1])
    assert ids[0] == tokenizer.bos_token_id == 2 and ids.count(2) == 1
    assert tokenizer.token_to_id("<turn|>") in tokenizer.eos_token_ids  # a turn's end stops generation
    # llama.cpp agrees on what ends generation.
    assert all(llc.llama_vocab_is_eog(vocab, i) for i in tokenizer.eos_token_ids)


def _greedy(target, prompt, draft=None, **kw):
    return tandem.generate(target, prompt=prompt, draft=draft, max_tokens=32, ignore_eos=True,
                           draft_policy="fixed", **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_speculative_equals_plain(pairs, layout):
    target, draft = pairs[layout]
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = _greedy(target, prompt)
        spec = _greedy(target, prompt, draft=draft, draft_max=4)
        assert spec.tokens == plain.tokens and spec.text == plain.text
        drafted += spec.stats.draft_tokens
        accepted += spec.stats.accepted_tokens
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    assert accepted < drafted  # rejections too: the rewind of sliding-window and shared KV layers is exercised
    # The target as its own draft: every draft is accepted, and the output is still the plain one.
    itself = _greedy(target, PROMPTS[0], draft=target, draft_max=4)
    assert itself.tokens == _greedy(target, PROMPTS[0]).tokens
    assert itself.stats.accepted_tokens == itself.stats.draft_tokens > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_batched_equals_alone(pairs, layout):
    target, draft = pairs[layout]
    expected = [_greedy(target, p).tokens for p in PROMPTS]
    engine = Engine(target, draft, slots=3, draft_max=3)
    results = engine.generate([Request(target.tokenizer.encode(p), max_tokens=32, ignore_eos=True,
                                       draft_policy="fixed") for p in PROMPTS])
    assert [r.tokens for r in results] == expected
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert 0 < accepted < drafted, (drafted, accepted)
    # A second turn reuses the first one's KV (sliding, full and, for e2b, shared layers) and equals a fresh run.
    first = engine.generate([Request(target.tokenizer.encode(PROMPTS[2]), max_tokens=20, ignore_eos=True)])[0]
    again = target.tokenizer.encode(" again", add_bos=False)
    turn2 = target.tokenizer.encode(PROMPTS[2]) + first.tokens + again
    second = engine.generate([Request(turn2, max_tokens=12, ignore_eos=True, draft_policy="fixed")])[0]
    assert second.stats.cached_tokens >= len(turn2) - len(again) - 1
    assert second.tokens == _greedy(target, turn2).tokens[:12]


def test_rewind_past_the_window_is_exact(tiny_model_path):
    # A 16-token batch makes llama.cpp's window-sized cache 256 cells: 600 tokens wrap it, and keys of positions the
    # window left behind are gone unless the sliding layers keep a full-size cache (swa_full), as tandem asks.
    target = tandem.load(gemma4_path(tiny_model_path, "dense"), backend="llama.cpp", n_ctx=1024, n_threads=1,
                         n_batch=16)
    try:
        ids = [(i * 37) % 400 + 9 for i in range(600)]
        reference = target.logits(ids[:310])
        seq = target.new_sequence()
        seq.forward(ids, logits="last")
        seq.rewind(300)  # e.g. the engine reusing a 300-token prefix of this sequence for the next request
        assert torch.equal(seq.forward(ids[300:310]), reference[300:310])
        seq.close()
    finally:
        target.close()


def test_compat_accepts_a_same_family_pair_and_refuses_another_vocabulary(pairs, tiny_model_path):
    dense, e2b = pairs["dense"][0], pairs["e2b"][1]  # a 31B-style target, an E2B-style draft
    check_compatible(dense, e2b)
    spec = _greedy(dense, PROMPTS[1], draft=e2b, draft_max=4)
    assert spec.tokens == _greedy(dense, PROMPTS[1]).tokens
    assert_speculated(spec.stats, accepted=False)  # the pair drafted (other weights: acceptance is beside it)
    qwen = tandem.load(tiny_model_path(qtype="Q8_0"), backend="llama.cpp", n_ctx=128, n_threads=1)
    try:
        with pytest.raises(VocabularyMismatchError, match="cannot draft for target"):
            check_compatible(dense, qwen)
    finally:
        qwen.close()


def test_torch_backend_refuses_gemma4_and_names_llamacpp(tiny_model_path):
    with pytest.raises(GGUFError, match=r"'gemma4' runs on the llama\.cpp backend only .*--backend llama\.cpp"):
        tandem.load(gemma4_path(tiny_model_path, "dense"), backend="torch")


def test_auto_backend_picks_llamacpp_for_gemma4_on_cuda(tiny_model_path):
    from tandem.api import pick_backend

    assert pick_backend(gemma4_path(tiny_model_path, "dense"), "cuda") == "llama.cpp"
    assert pick_backend(tiny_model_path(qtype="Q8_0"), "cuda") == "torch"

