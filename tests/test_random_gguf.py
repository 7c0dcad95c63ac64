"""Random-weight GGUFs of named shapes (tandem.synthetic.random_gguf): llama-quantize's type choices, the copied
tokenizer, the same bytes whatever the number of writing processes, and a file llama.cpp loads and decodes."""

import hashlib

import numpy as np
import pytest
import torch

from tandem.synthetic.random_blocks import random_rows
from tandem.synthetic.random_gguf import (
    extract_tokenizer,
    plan_tensors,
    tensor_qtype,
    tokenizer_metadata,
    write_random_gguf,
)
from tandem.synthetic.shapes import get_shape, parse_shape
from tandem.synthetic.tiny_gguf import write_tiny_gguf

# A shape small enough for milliseconds, with 256-wide rows so the K-quant mixes need no fallback.
SMALL = "tiny:d_model=256,d_ffn=512,n_heads=4,n_kv_heads=2,n_layers=2,vocab_size=600"


def digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_parse_shape_overrides():
    config = parse_shape("qwen2.5-0.5b:n_layers=4,vocab_size=152064")
    assert (config.n_layers, config.vocab_size, config.d_model) == (4, 152064, 896)
    assert parse_shape("qwen2.5-0.5b") == get_shape("qwen2.5-0.5b")
    assert parse_shape("tiny:d_model=256,n_heads=4").head_dim == 64
    with pytest.raises(ValueError, match="bad shape override"):
        parse_shape("tiny:rope_base=3")


def test_types_follow_llama_quantize():
    # Q4_K_M on 64 layers: attn_v and ffn_down in Q6_K on the first and last eighth and every third layer between.
    n = 64
    more = [i for i in range(n) if tensor_qtype("Q4_K_M", f"blk.{i}.ffn_down.weight", 27648, n, False) == "Q6_K"]
    assert more[:10] == [0, 1, 2, 3, 4, 5, 6, 7, 10, 13] and more[-8:] == list(range(56, 64))
    assert tensor_qtype("Q4_K_M", "blk.10.attn_v.weight", 5120, n, False) == "Q6_K"
    assert tensor_qtype("Q4_K_M", "blk.11.attn_q.weight", 5120, n, False) == "Q4_K"
    assert tensor_qtype("Q4_0", "output.weight", 5120, n, False) == "Q6_K"
    assert tensor_qtype("Q4_0", "token_embd.weight", 5120, n, False) == "Q4_0"
    # The 0.5B's 896-wide rows: no whole 256-blocks, so llama-quantize's fallbacks (its real Q4_K_M file has them)
    assert tensor_qtype("Q4_K_M", "blk.0.attn_q.weight", 896, 24, True) == "Q5_0"
    assert tensor_qtype("Q4_K_M", "token_embd.weight", 896, 24, True) == "Q8_0"  # tied: the output's type
    sizes = {p.name: p.nbytes for p in plan_tensors(get_shape("qwen2.5-32b"), "Q4_0")}
    assert 17.5e9 < sum(sizes.values()) < 19e9  # a real Qwen2.5-32B Q4_0 file is ~18.6 GB


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_0"])
def test_random_rows_have_the_asked_spread(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(random_rows(32, 512, qtype, 0.02, np.random.default_rng(0)), GGMLQuantizationType[qtype])
    assert values.shape == (32, 512) and np.isfinite(values).all()
    assert abs(values.mean()) < 0.002 and 0.018 < values.std() < 0.022


@pytest.mark.parametrize("mix", ["Q4_0", "Q4_K_M"])
def test_written_file_loads_and_decodes(tmp_path, mix):
    import tandem

    source = write_tiny_gguf(tmp_path / "source.gguf")  # its tokenizer, copied and padded to 600 rows
    one = write_random_gguf(tmp_path / "a.gguf", SMALL, mix, tokenizer_from=source, seed=3, workers=1)
    two = write_random_gguf(tmp_path / "b.gguf", SMALL, mix, tokenizer_from=source, seed=3, workers=2)
    assert digest(one.path) == digest(two.path), "the bytes depend on the number of writing processes"
    copied = tokenizer_metadata(one.path)
    original = tokenizer_metadata(source)
    assert copied["tokenizer.chat_template"].value == original["tokenizer.chat_template"].value
    assert copied["tokenizer.ggml.merges"].value == original["tokenizer.ggml.merges"].value
    n = len(original["tokenizer.ggml.tokens"].value)
    assert len(copied["tokenizer.ggml.tokens"].value) == 600 and copied["tokenizer.ggml.tokens"].value[n] == f"[PAD{n}]"
    if mix == "Q4_K_M":
        assert one.tensor_types == {"Q4_K": 13, "Q6_K": 3, "F32": 11}  # Q6_K: output, layer 1 attn_v, ffn_down

    model = tandem.load(one.path, backend="llama.cpp", device="cpu")
    try:
        assert model.vocab_size == 600
        reference = tandem.load(source, backend="llama.cpp", device="cpu")
        text = "def add(a, b):\n    return a + b"
        assert model.tokenizer.encode(text) == reference.tokenizer.encode(text)
        reference.close()
        seq = model.new_sequence(64)
        logits = seq.forward(model.tokenizer.encode(text), logits="all")
        assert logits.shape[-1] == 600 and torch.isfinite(logits).all()
        assert 0.1 < logits.std().item() < 100  # neither collapsed nor blown up
        seq.close()
    finally:
        model.close()


@pytest.mark.real
def test_real_tokenizer_carried(real_pair, tmp_path):
    """A random model with the real Qwen vocabulary (extracted to a tensor-less file first) passes the vocabulary
    check against the real draft, as the 32B/1.5B pairs on the GPU box must."""
    import tandem
    from tandem.speculative.compat import check_compatible

    _, real_draft = real_pair
    tokenizer = extract_tokenizer(real_draft, tmp_path / "tokenizer.gguf")
    shape = "qwen2.5-0.5b:n_layers=1,d_model=128,d_ffn=256,n_heads=2,n_kv_heads=1,vocab_size=152064"
    path = write_random_gguf(tmp_path / "t.gguf", shape, "Q4_0", tokenizer_from=tokenizer, workers=1).path
    model = tandem.load(path, backend="llama.cpp", device="cpu")
    draft = tandem.load(real_draft, backend="llama.cpp", device="cpu")
    try:
        check_compatible(model, draft)
        assert model.vocab_size == 152064 and draft.vocab_size == 151936
    finally:
        model.close()
        draft.close()
