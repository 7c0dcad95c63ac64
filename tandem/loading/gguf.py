"""Reading GGUF files: metadata, a `ModelConfig`, and tensors dequantised to torch.
More: docs/internals.md."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import math
import os
import struct
from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES

from tandem.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tandem.loading.gguf_header import GGUFError, TensorInfo, check_header, parse_header

# Per-architecture default rope base when the file leaves `{arch}.rope.freq_base` out.
DEFAULT_ROPE_BASE = {"llama": 10000.0, "qwen2": 1_000_000.0, "gemma3": 1_000_000.0, "gemma4": 1_000_000.0,
                     "gemma4-assistant": 1_000_000.0, "eagle3": 10000.0}
DEFAULT_RMS_EPS = 1e-6
log = logging.getLogger("tandem.loading")
GEMMA3_ROPE_BASE_LOCAL = 10000.0  # gemma3's sliding-window layers (not stored in GGUF; llama.cpp hard-codes it)
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # 5 local layers, then one global
DEQUANT_CHUNK_VALUES = 1 << 22  # values a dequantised slab holds (16 MB of float32) before its cast to `dtype`
GGML_BASE_LIBS = ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll")


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # stored as floats: numpy reads them (no C routine needed)

# Tokens that end a turn in chat models (ChatML, Gemma); their ids join eos_token_ids when the vocabulary has them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<turn|>")


class GGUFFile:
    """One opened GGUF file (memory-mapped; tensors are read and dequantised on demand)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        check_header(self.path)
        file_size = os.path.getsize(self.path)
        # A read-only memmap: the header is parsed from it and tensors are views into it (no copy until dequantised).
        self._data = np.memmap(self.path, mode="r", dtype=np.uint8)
        try:
            self.metadata, self._tensors = parse_header(memoryview(self._data), self.path, file_size)
        except struct.error as exc:
            raise GGUFError(f"{self.path}: truncated or corrupt GGUF header: {exc}") from exc
        except (UnicodeDecodeError, KeyError, OverflowError, MemoryError) as exc:
            raise GGUFError(f"{self.path}: corrupt GGUF header: {type(exc).__name__}: {exc}") from exc

    # --- metadata ---------------------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.metadata.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    # --- tensors ----------------------------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r} ({len(self._tensors)} tensors in file)") from None

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in torch order, e.g. (vocab, d_model) for token_embd.weight."""
        return self.tensor_info(name).shape

    def tensor_type(self, name: str) -> str:
        """The GGML storage type name, e.g. 'Q4_K' or 'F32'."""
        return self.tensor_info(name).qtype.name

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` as a uint8 view [*shape[:-1], bytes_per_row] into the memmap."""
        info = self.tensor_info(name)
        flat = self._data[info.offset : info.offset + info.nbytes]
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        return np.asarray(flat).reshape(*info.shape[:-1], info.nbytes // max(rows, 1))

    def tensor(self, name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
        """Tensor `name` dequantised to float32, then cast to `dtype` and moved to `device`.

        Matrices go in slabs of rows, each dequantised to float32 and cast into the output: peak memory is the
        output plus one slab, and every value is the float32 one cast once, as if the whole tensor were.
        """
        info = self.tensor_info(name)
        raw = self.raw(name)  # [*shape[:-1], row_bytes] uint8 view into the memmap
        rows = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw.reshape(1, -1)
        out = torch.empty(info.shape, dtype=dtype)
        flat = out.view(len(rows), -1)
        step = max(1, DEQUANT_CHUNK_VALUES // flat.shape[1])
        try:
            for start in range(0, len(rows), step):
                slab = torch.from_numpy(dequantize_rows(rows[start : start + step], info.qtype))
                flat[start : start + step] = slab.view(-1, flat.shape[1])
        except NotImplementedError:
            raise GGUFError(
                f"{self.path}: tensor {name!r} has quant type {info.qtype.name}, which gguf-py cannot dequantise"
            ) from None
        except Exception as exc:
            raise GGUFError(f"{self.path}: cannot dequantise tensor {name!r} ({info.qtype.name}): {exc}") from exc
        return out if torch.device(device).type == "cpu" else out.to(device)

    # --- config -----------------------------------------------------------------------------------------------

    @cached_property
    def config(self) -> ModelConfig:
        return config_from_gguf(self)

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, arch={self.get('general.architecture')!r}, tensors={len(self._tensors)})"


@functools.cache
def ggml_dequantizer(qtype_name: str) -> Callable[[int, int, int], None] | None:
    """llama.cpp's `dequantize_row_<type>(blocks, floats, count)` for a GGML type, or None where llama-cpp-python is
    not installed or has none for it. Only its libggml-base is loaded: CPU code with no GPU backend (a CUDA build's
    libllama must not share a process with CUDA torch: llamacpp_worker), and ctypes calls release the GIL, so the
    loader's threads dequantise in parallel."""
    lib = _libggml_base()
    symbol = "dequantize_row_" + qtype_name.lower().replace("_k", "_K")  # ggml's names: q4_0, q4_K, iq2_xxs
    function = getattr(lib, symbol, None) if lib is not None else None
    if function is None:
        return None
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return function


def dequantiser() -> str:
    """Which routines dequantise quantised tensors here, for the log."""
    return "llama.cpp's C routines" if _libggml_base() is not None else "gguf-py's numpy, ~19x llama-cpp-python's CPU"


@functools.cache
def _libggml_base() -> ctypes.CDLL | None:
    """llama-cpp-python's libggml-base, or the one TANDEM_GGML_BASE names (a llama.cpp build's, where llama-cpp-python
    is not installed: a GPU box given the library alone)."""
    named = os.environ.get("TANDEM_GGML_BASE")
    if named:
        try:
            return ctypes.CDLL(named)
        except OSError as error:
            log.warning("TANDEM_GGML_BASE=%s: %s; dequantising with gguf-py", named, error)
            return None
    spec = importlib.util.find_spec("llama_cpp")  # found, not imported: importing it loads libllama
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        for name in GGML_BASE_LIBS:
            path = os.path.join(root, "lib", name)
            if os.path.exists(path):
                try:
                    return ctypes.CDLL(path)
                except OSError:
                    return None
    return None


def dequantize_rows(rows: np.ndarray, qtype: Any) -> np.ndarray:
    """[n, row_bytes] uint8 rows of GGML type `qtype` as a C-contiguous float32 array of n rows (flattened per row);
    by llama.cpp's C routine where it is installed, else gguf-py's."""
    function = ggml_dequantizer(qtype.name) if qtype.name not in FLOAT_TYPES else None
    if function is None:
        from gguf.quants import dequantize

        values = np.ascontiguousarray(dequantize(rows, qtype), dtype=np.float32)
        return values if values.flags.writeable else values.copy()  # F32 comes back as a view of the memmap
    blocks = np.ascontiguousarray(rows)
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    out = np.empty((len(blocks), blocks.shape[-1] // block_bytes * block_values), dtype=np.float32)
    function(blocks.ctypes.data, out.ctypes.data, out.size)
    return out


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file; raises GGUFError on any problem."""
    return GGUFFile(path)


def eos_token_ids_from_metadata(metadata: dict[str, Any], architecture: str) -> tuple[int, ...]:
    """Every id that ends generation: eos, eot, eom, plus the chat end-of-turn tokens the vocabulary has."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    wanted = END_OF_TURN_TOKENS
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    found = {t: i for i, t in enumerate(tokens) if t in wanted}  # one pass, not a .index() per name
    for text in wanted:
        if text in found and found[text] not in ids:
            ids.append(found[text])
    return tuple(ids)


def _widest(value: Any) -> int:
    """A per-layer hparam as one number: the value, or the largest of a per-layer array."""
    return max(int(v) for v in value) if isinstance(value, list) else int(value)


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    """A ModelConfig from a file's metadata and tensor shapes (the name scheme: docs/internals.md)."""
    arch = gf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{gf.path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def key(name: str) -> str:
        return f"{arch}.{name}"

    n_layers = int(gf.require(key("block_count")))
    d_model = int(gf.require(key("embedding_length")))
    d_ffn = _widest(gf.require(key("feed_forward_length")))  # gemma4 may give one per layer
    n_heads = int(gf.require(key("attention.head_count")))
    n_kv_heads = _widest(gf.get(key("attention.head_count_kv"), n_heads))
    head_dim = int(gf.get(key("attention.key_length"), 0)) or d_model // n_heads
    context_length = int(gf.require(key("context_length")))
    rms_eps = float(gf.get(key("attention.layer_norm_rms_epsilon"), DEFAULT_RMS_EPS))
    rope_base = float(gf.get(key("rope.freq_base"), DEFAULT_ROPE_BASE[arch]))
    rope_scale = 1.0
    scaling_type = gf.get(key("rope.scaling.type"))
    scaling_factor = gf.get(key("rope.scaling.factor"))
    if scaling_factor is not None and scaling_type in (None, "linear") and float(scaling_factor) > 0:
        rope_scale = float(scaling_factor)
    elif scaling_type not in (None, "none", "linear"):
        raise GGUFError(f"{gf.path}: unsupported rope scaling type {scaling_type!r} (only 'linear')")

    if gf.has_tensor("token_embd.weight"):
        vocab_size = gf.tensor_shape("token_embd.weight")[0]
    elif arch == "eagle3" and gf.get("tokenizer.ggml.tokens"):  # an EAGLE-3 head may use its target's embedding
        vocab_size = len(gf.get("tokenizer.ggml.tokens"))
    else:
        raise GGUFError(f"{gf.path}: missing tensor 'token_embd.weight'")

    # Gemma 3 and 4: GeGLU, a scaled embedding, q/k norms and sandwich norms. llama.cpp's converter already folds
    # Gemma's (1 + w) RMSNorm into the stored weights, so every norm in the GGUF is a plain `x_normed * w`; the
    # model must NOT add 1 again.
    gemma = dict(activation="gelu_tanh", embed_scale=math.sqrt(d_model), qk_norm=True, sandwich_norm=True)
    common: dict[str, Any] = {}
    if arch == "qwen2":
        common = dict(qkv_bias=True, rope_interleaved=False)
    elif arch == "llama":
        # llama.cpp's converter permutes Q/K rows for `llama`, so the interleaved-pairs rope matches the weights.
        common = dict(qkv_bias=gf.has_tensor("blk.0.attn_q.bias"), rope_interleaved=True)
    elif arch == "gemma3":
        sliding = gf.get(key("attention.sliding_window"))
        common = dict(
            **gemma,
            rope_base_local=GEMMA3_ROPE_BASE_LOCAL,
            sliding_window=int(sliding) if sliding else None,
            sliding_window_pattern=GEMMA3_SLIDING_WINDOW_PATTERN,
            rope_interleaved=False,
        )
    elif arch in ("gemma4", "gemma4-assistant"):
        # Sliding-window layers have heads of key_length_swa, full layers of key_length (llama.cpp's loader).
        head_dim = int(gf.get(key("attention.key_length_swa"), head_dim))
        pattern = gf.get(key("attention.sliding_window_pattern"))
        sliding = gf.get(key("attention.sliding_window"))
        common = dict(
            **gemma,
            global_head_dim=int(gf.get(key("attention.key_length"), head_dim)),
            rope_base_local=float(gf.get(key("rope.freq_base_swa"), GEMMA3_ROPE_BASE_LOCAL)),
            sliding_window=int(sliding) if sliding else None,
            sliding_layers=tuple(bool(x) for x in pattern) if isinstance(pattern, list) else (),
        )
        if arch == "gemma4-assistant":  # its blocks read the target's KV; its input, the target's hidden state
            common["head_input_width"] = int(gf.require(key("embedding_length_out")))

    elif arch == "eagle3":  # one decoder block over [its token embedding, the fused target features]
        common = dict(head_input_width=int(gf.require(key("target_hidden_size"))),
                      head_target_layers=tuple(int(x) for x in gf.require(key("target_layers"))))

    bos = gf.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        n_layers=n_layers,
        d_model=d_model,
        d_ffn=d_ffn,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        context_length=context_length,
        rms_eps=rms_eps,
        rope_base=rope_base,
        rope_scale=rope_scale,
        tied_embeddings=not gf.has_tensor("output.weight"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_token_ids_from_metadata(gf.metadata, arch),
        name=str(gf.get("general.name", "") or ""),
        **common,
    )
