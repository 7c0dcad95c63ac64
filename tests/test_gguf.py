"""tandem.loading.gguf / weights / synthetic: config from metadata, dequantisation, and every error path."""

from __future__ import annotations

import math
import os
import re
import struct

import numpy as np
import pytest
import torch

import tandem.loading.gguf as gguf_module
from tandem.loading.gguf import GGUFError, open_gguf
from tandem.loading.weights import expected_tensors, load_weights
from tandem.synthetic.tiny_gguf import SUPPORTED_QTYPES

GGUF_PY_QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16")
# Worst-case absolute error of a round trip of N(0, 1) data, a little above each format's step.
ROUND_TRIP_TOLERANCE = {"F16": 2e-3, "BF16": 2e-2, "Q8_0": 3e-2, "Q5_1": 0.12, "Q5_0": 0.2, "Q4_1": 0.25, "Q4_0": 0.45}


def test_qwen2_config(tiny_model_path):
    config = open_gguf(tiny_model_path("qwen2")).config
    assert (config.architecture, config.n_layers, config.d_model, config.d_ffn) == ("qwen2", 2, 64, 128)
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.qkv_bias and not config.rope_interleaved and not config.tied_embeddings
    assert config.rope_base == 1e6 and config.context_length == 512
    assert config.vocab_size == open_gguf(tiny_model_path("qwen2")).tensor_shape("token_embd.weight")[0]
    assert config.eos_token_ids[0] == config.vocab_size - 1  # <|im_end|>, then <|endoftext|>
    assert config.bos_token_id in config.eos_token_ids


def test_llama_config(tiny_model_path):
    config = open_gguf(tiny_model_path("llama", tie_embeddings=True)).config
    assert config.rope_interleaved and not config.qkv_bias and config.tied_embeddings
    assert config.rope_base == 10000.0
    biased = open_gguf(tiny_model_path("llama", qkv_bias=True)).config
    assert biased.qkv_bias


def test_gemma3_config(tiny_model_path):
    config = open_gguf(tiny_model_path("gemma3", head_dim=32, tie_embeddings=True)).config
    assert config.head_dim == 32 and config.sliding_window == 8 and config.sliding_window_pattern == 6
    assert config.activation == "gelu_tanh" and config.qk_norm and config.sandwich_norm
    assert config.embed_scale == pytest.approx(math.sqrt(64)) and config.rope_base_local == 10000.0
    assert config.is_local_layer(0) and not config.is_local_layer(5)
    names = expected_tensors(config)
    assert names["blk.0.attn_q_norm.weight"] == (32,) and "output.weight" not in names
    assert names["blk.1.attn_q.weight"] == (4 * 32, 64)


def test_rope_scaling_and_metadata_overrides(tiny_model_path):
    path = tiny_model_path("llama", metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert open_gguf(path).config.rope_scale == 4.0


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES)
def test_load_every_qtype(tiny_model_path, qtype):
    gf = open_gguf(tiny_model_path("qwen2", qtype))
    assert gf.tensor_type("blk.0.ffn_up.weight") == qtype
    assert gf.tensor_type("blk.0.attn_norm.weight") == "F32"  # norms stay F32, as llama.cpp leaves them
    weights = load_weights(gf, progress=False)
    assert set(weights) == set(expected_tensors(gf.config))
    for name, shape in expected_tensors(gf.config).items():
        assert tuple(weights[name].shape) == shape and torch.isfinite(weights[name]).all(), name
    std = float(weights["blk.0.ffn_up.weight"].std())
    assert 0.01 < std < 0.2, f"{qtype}: random weights should be sane, std {std}"
    assert weights["blk.0.ffn_up.weight"].dtype == torch.float32
    assert gf.tensor("blk.0.ffn_up.weight", dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", GGUF_PY_QUANTIZABLE)
def test_dequantize_round_trip(tmp_path, qtype):
    """Data quantised by gguf-py, written, read back through GGUFFile: error within the format's step.

    gguf-py's decoding is the reference llama.cpp's C one is checked against (test_ggml_dequantise_is_gguf_py's),
    so this checks our writer and reader: the hand decodings below (Q8_0, Q6_K) are the independent references."""
    from tandem.synthetic.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "rt.gguf", qtype=qtype, seed=3)
    gf = open_gguf(path)
    got = gf.tensor("blk.0.attn_q.weight").numpy()
    # Rebuild the original float values with the same generator sequence is fragile; instead re-quantise what we
    # read: a dequantised tensor must be a fixed point of quantise -> dequantise (up to rounding).
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    again = gguf.quants.dequantize(gguf.quants.quantize(got, qt), qt)
    assert np.abs(again - got).max() <= ROUND_TRIP_TOLERANCE[qtype] * 0.1 + 1e-6
    # And a direct round trip of N(0, 1) data stays within the format's step.
    data = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    err = np.abs(gguf.quants.dequantize(gguf.quants.quantize(data, qt), qt) - data).max()
    assert err < ROUND_TRIP_TOLERANCE[qtype]


def test_q8_0_matches_manual_decode(tiny_model_path):
    """Q8_0 stores exact int8 * fp16 scale: check our reader's bytes->values against decoding the block by hand."""
    gf = open_gguf(tiny_model_path("qwen2", "Q8_0"))
    raw = gf.raw("blk.0.attn_k.weight")  # [rows, row_bytes]
    blocks = raw.reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    manual = (scale * blocks[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(
        gf.tensor_shape("blk.0.attn_k.weight")
    )
    assert np.array_equal(manual, gf.tensor("blk.0.attn_k.weight").numpy())


def dequantize_q6_k_by_hand(raw: np.ndarray) -> np.ndarray:
    """Q6_K per GGML's block layout (ggml-common.h block_q6_K; dequantize_row_q6_K in ggml-quants.c): 256 values a
    block of 210 bytes = ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, one per 16 values), d (f16).
    Each half of 128 values: y[l + 32 j] = d * scales[l // 16 + 2 j] * (q - 32), for j = 0..3 and l = 0..31, with
    q's low bits from ql[l] (j = 0, 2: low/high nibble) or ql[l + 32] (j = 1, 3), high bits from qh[l] >> 2 j."""
    blocks = raw.reshape(-1, 210)
    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    for b, block in enumerate(blocks):
        ql, qh = block[:128].astype(np.int32), block[128:192].astype(np.int32)
        scales = block[192:208].view(np.int8).astype(np.float32)
        d = np.float32(block[208:210].view(np.float16)[0])
        for half in range(2):
            low, high, sc = ql[64 * half : 64 * half + 64], qh[32 * half : 32 * half + 32], scales[8 * half :]
            for i in range(32):
                q = [(low[i] & 0xF) | ((high[i] >> 0) & 3) << 4, (low[i + 32] & 0xF) | ((high[i] >> 2) & 3) << 4,
                     (low[i] >> 4) | ((high[i] >> 4) & 3) << 4, (low[i + 32] >> 4) | ((high[i] >> 6) & 3) << 4]
                for j in range(4):
                    out[b, 128 * half + i + 32 * j] = d * sc[i // 16 + 2 * j] * np.float32(q[j] - 32)
    return out


def test_q6_k_matches_manual_decode(tiny_model_path):
    """The tiny K-quant files hold random Q6_K blocks: decoded by hand, value for value, as llama.cpp decodes them."""
    gf = open_gguf(tiny_model_path("qwen2", "Q6_K"))
    name = "blk.0.attn_k.weight"
    assert gf.tensor_type(name) == "Q6_K"
    manual = dequantize_q6_k_by_hand(gf.raw(name)).reshape(gf.tensor_shape(name))
    got = gf.tensor(name).numpy()
    assert np.isfinite(manual).all() and np.abs(manual).max() > 0
    np.testing.assert_allclose(got, manual, rtol=1e-6, atol=0)


# --- errors ---------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        open_gguf(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 4)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        open_gguf(bad)


@pytest.mark.parametrize("fraction", [0.5, 0.05, 0.001])
def test_truncated(tmp_path, tiny_model_path, fraction):
    data = open(tiny_model_path("qwen2"), "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(int(len(data) * fraction), 10)])
    with pytest.raises(GGUFError, match="truncated"):
        open_gguf(cut)


def test_unsupported_architecture(tiny_model_path):
    gf = open_gguf(tiny_model_path("mamba"))
    with pytest.raises(GGUFError, match="unsupported architecture 'mamba'.*qwen2, llama, gemma3"):
        _ = gf.config


def test_unsupported_quant_type(tiny_model_path):
    gf = open_gguf(tiny_model_path("qwen2", tensor_qtypes={"blk.0.ffn_up.weight": "F64"}))
    with pytest.raises(GGUFError, match="blk.0.ffn_up.weight.*F64"):
        load_weights(gf, progress=False)


def test_missing_tensor(tiny_model_path):
    gf = open_gguf(tiny_model_path("qwen2", skip_tensors=["blk.1.ffn_down.weight"]))
    with pytest.raises(GGUFError, match="missing tensor 'blk.1.ffn_down.weight'"):
        load_weights(gf, progress=False)
    with pytest.raises(GGUFError, match="missing tensor 'nope'"):
        gf.tensor("nope")


def test_wrong_shape(tiny_model_path):
    gf = open_gguf(tiny_model_path("qwen2", shape_overrides={"blk.0.attn_k.weight": (64, 64)}))
    with pytest.raises(GGUFError, match=r"'blk.0.attn_k.weight' has shape \[64, 64\], expected \[32, 64\]"):
        load_weights(gf, progress=False)


def test_missing_metadata_key(tiny_model_path):
    gf = open_gguf(tiny_model_path("qwen2", metadata={"qwen2.block_count": None}))
    with pytest.raises(GGUFError, match="missing metadata key 'qwen2.block_count'"):
        _ = gf.config


def test_metadata_decoding(tiny_model_path):
    gf = open_gguf(tiny_model_path("qwen2"))
    meta = gf.metadata
    assert meta["general.architecture"] == "qwen2" and isinstance(meta["tokenizer.ggml.tokens"], list)
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.ggml.tokens"][-1] == "<|im_end|>" and meta["tokenizer.ggml.token_type"][-1] == 3
    assert os.path.basename(gf.path).endswith(".gguf") and "blk.0.attn_q.bias" in gf.tensor_names


# --- a data section that does not match the header (both backends refuse it before use) -------------------------


def _tensor_info_fields(data: bytes) -> dict[str, int]:
    """Byte position of each tensor info's offset field, by tensor name (infos in file order)."""
    from tandem.loading.gguf_header import _HeaderParser

    p = _HeaderParser(memoryview(data), "test")
    p.pos = 8
    n_tensors, n_kv = p._unpack("<Q"), p._unpack("<Q")
    for _ in range(n_kv):
        p.string()
        p.value(p._unpack("<I"))
    fields = {}
    for _ in range(n_tensors):
        name = p.string()
        p.pos += 4 + 8 * p._unpack("<I") + 4  # n_dims, dims, type
        fields[name] = p.pos
        p.pos += 8
    assert list(fields)[-1] == "output.weight"
    return fields


def _corrupt(data: bytes, kind: str) -> bytes:
    """`data` (a valid tiny GGUF with output.weight last) broken the way `kind` says."""
    out = bytearray(data)
    n_tensors = struct.unpack_from("<Q", data, 8)[0]
    fields = _tensor_info_fields(data)
    if kind == "under-count":  # the case: output.weight last, the count one short
        struct.pack_into("<Q", out, 8, n_tensors - 1)
    elif kind == "over-count":
        struct.pack_into("<Q", out, 8, n_tensors + 1)
    elif kind == "overlap":
        q_offset = struct.unpack_from("<Q", data, fields["blk.0.attn_q.weight"])[0]
        struct.pack_into("<Q", out, fields["blk.0.attn_k.weight"], q_offset)
    elif kind == "misaligned":
        k_offset = struct.unpack_from("<Q", data, fields["blk.0.attn_k.weight"])[0]
        struct.pack_into("<Q", out, fields["blk.0.attn_k.weight"], k_offset + 4)
    elif kind == "truncated":
        del out[-100:]
    elif kind == "trailing":
        out += bytes(64)
    return bytes(out)


MALFORMED = {
    "under-count": r"bytes after the last tensor .* belong to no tensor: the header counts \d+ tensors, but another, "
    r"'output.weight' \[\d+, 64\], follows them: the count is short",
    "over-count": r"the header counts \d+ tensors, but tensor info \d+ .* is not a valid tensor description",
    "overlap": r"tensors 'blk.0.attn_q.weight' \(bytes \d+-\d+\) and 'blk.0.attn_k.weight' .* overlap",
    "misaligned": r"'blk.0.attn_k.weight' starts at data offset \d+, which is not a multiple of the alignment 32",
    "truncated": r"truncated: tensor 'output.weight' ends at byte \d+ but the file has \d+",
    "trailing": r"64 bytes after the last tensor .* belong to no tensor",
}


@pytest.fixture(scope="module")
def malformed(tiny_model_path, tmp_path_factory):
    """kind -> path of a tiny qwen2 GGUF broken that way."""
    data = open(tiny_model_path("qwen2"), "rb").read()
    root = tmp_path_factory.mktemp("malformed")
    paths = {}
    for kind in MALFORMED:
        paths[kind] = str(root / f"{kind}.gguf")
        with open(paths[kind], "wb") as f:
            f.write(_corrupt(data, kind))
    return paths


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_data_section_is_refused(malformed, kind):
    with pytest.raises(GGUFError, match=MALFORMED[kind]) as info:
        open_gguf(malformed[kind])
    assert str(info.value).startswith(malformed[kind] + ": ")


def test_every_tiny_file_passes_the_check(tiny_model_path):
    for kw in (dict(), dict(qtype="Q4_K"), dict(arch="gemma3", tie_embeddings=True, head_dim=32)):
        assert open_gguf(tiny_model_path(**kw)).has_tensor("token_embd.weight")


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
@pytest.mark.parametrize("kind", ["under-count", "over-count", "overlap", "truncated"])
def test_both_backends_refuse_with_one_line_and_exit_2(malformed, kind, backend, capsys, monkeypatch):
    """`tandem generate` on a malformed file: exit 2, one line naming the file and the mismatch. llama.cpp is never
    handed the file: the same check runs first."""
    from tandem.cli import main

    if backend == "llama.cpp":
        llamacpp_core = pytest.importorskip("tandem.backends.llamacpp_core")

        def refuse(*args):
            raise AssertionError("llama.cpp was handed a malformed file")

        monkeypatch.setattr(llamacpp_core.llc, "llama_model_load_from_file", refuse)
    code = main(["generate", "--model", malformed[kind], "--no-draft", "--backend", backend, "--prompt", "hi",
                 "--max-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tandem: error: {malformed[kind]}: "), err
    assert re.search(MALFORMED[kind], lines[0]), lines[0]


def _every_tensor(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gf = open_gguf(path)
    return {name: gf.tensor(name, dtype=dtype) for name in gf.tensor_names}


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
                                        and torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


needs_ggml = pytest.mark.skipif(gguf_module.ggml_dequantizer("Q4_K") is None,
                                reason="llama-cpp-python's libggml-base is not installed")


@needs_ggml
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES)
def test_ggml_dequantise_is_gguf_py(tiny_model_path, monkeypatch, qtype, dtype):
    """llama.cpp's C routines give every tensor the bits gguf-py's numpy gives it, in slabs of rows as small as
    one row (the slab loop's edges) and whole."""
    path = tiny_model_path("qwen2", qtype)
    assert qtype in gguf_module.FLOAT_TYPES or gguf_module.ggml_dequantizer(qtype) is not None  # C, not numpy twice
    fast = _every_tensor(path, dtype)
    monkeypatch.setattr(gguf_module, "DEQUANT_CHUNK_VALUES", 1)  # one row a slab
    sliced = _every_tensor(path, dtype)
    monkeypatch.setattr(gguf_module, "ggml_dequantizer", lambda name: None)  # gguf-py's numpy
    reference = _every_tensor(path, dtype)
    assert _same_bits(fast, reference) and _same_bits(sliced, reference)


@needs_ggml
def test_ggml_dequantise_check_catches_a_wrong_routine(tiny_model_path, monkeypatch):
    """The control: IQ4_NL's routine decoding Q4_0's rows (the same 18-byte blocks, a non-linear code) breaks the
    bits."""
    path = tiny_model_path("qwen2", "Q4_0")
    reference = _every_tensor(path, torch.float32)
    wrong = gguf_module.ggml_dequantizer("IQ4_NL")
    assert wrong is not None
    monkeypatch.setattr(gguf_module, "ggml_dequantizer", lambda name: wrong if name == "Q4_0" else None)
    assert not _same_bits(_every_tensor(path, torch.float32), reference)


@needs_ggml
def test_a_named_libggml_base_is_used_and_a_bad_one_falls_back(monkeypatch, tmp_path):
    """TANDEM_GGML_BASE names the library where llama-cpp-python is not installed (a GPU box given the file alone):
    that library's routines are used; a path that does not load falls back to gguf-py's, never an error."""
    import shutil

    found = gguf_module._libggml_base()
    copy = tmp_path / "libggml-base.so"
    shutil.copy(found._name, copy)
    for name, loads in ((str(copy), True), (str(tmp_path / "missing.so"), False)):
        monkeypatch.setenv("TANDEM_GGML_BASE", name)
        gguf_module._libggml_base.cache_clear()
        gguf_module.ggml_dequantizer.cache_clear()
        try:
            lib = gguf_module._libggml_base()
            assert (lib is not None and lib._name == name) == loads
            assert (gguf_module.ggml_dequantizer("Q4_0") is not None) == loads
        finally:
            gguf_module._libggml_base.cache_clear()
            gguf_module.ggml_dequantizer.cache_clear()
