"""PyTorch backend: GGUF weights dequantized to one dtype, run by tandem.models.transformer on any torch device."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch

from tandem.backends.base import Model, Sequence
from tandem.cache import KVCache
from tandem.config import ModelConfig
from tandem.loading.gguf import open_gguf
from tandem.loading.tokenizer import Tokenizer
from tandem.loading.weights import load_weights
from tandem.models.transformer import Transformer

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEFAULT_CTX = 4096
PREFILL_CHUNK = 512  # bounds the [T, S] attention mask and activations of a long prompt


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    name = aliases.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but torch sees no CUDA device")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} requested but MPS is not available")
    return dev


class TorchSequence(Sequence):
    def __init__(self, model: TorchModel, capacity: int) -> None:
        self.model = model
        self.capacity = capacity
        self.cache: KVCache = model.transformer.new_cache(capacity)

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(self, tokens: Seq[int] | torch.Tensor, logits: str = "all") -> torch.Tensor:
        tokens = torch.as_tensor(tokens, dtype=torch.long).to(self.model.torch_device, non_blocking=True).view(-1)
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("forward needs at least one token")
        self._check_room(n)
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        rows = []
        with torch.inference_mode():
            for start in range(0, n, PREFILL_CHUNK):
                chunk = tokens[start : start + PREFILL_CHUNK]
                begin, end = self.cache.length, self.cache.length + chunk.shape[0]
                positions = torch.arange(begin, end, device=self.model.torch_device)
                rows.append(self.model.transformer(chunk, positions, self.cache, kv_len=end, last_only=logits == "last"))
                self.cache.length = end
        return rows[-1] if logits == "last" else torch.cat(rows) if len(rows) > 1 else rows[0]

    def rewind(self, length: int) -> None:
        self.cache.rewind(length)


class TorchModel(Model):
    backend = "torch"

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer, path: str = "",
                 n_ctx: int | None = None) -> None:
        self.path = str(path)
        self.config = config
        self.tokenizer = tokenizer
        any_weight = weights["token_embd.weight"]
        self.torch_device, self.dtype = any_weight.device, any_weight.dtype
        self.device = str(self.torch_device)
        self.n_ctx = n_ctx if n_ctx is not None else min(DEFAULT_CTX, config.context_length)
        self.transformer = Transformer(config, weights, max_positions=max(self.n_ctx, 1))
        self.load_seconds = 0.0

    @classmethod
    def from_gguf(cls, path: str, device: str = "cpu", dtype: str = "float32", n_ctx: int | None = None,
                  progress: bool = True) -> TorchModel:
        started = time.perf_counter()
        torch_device, torch_dtype = parse_device(device), parse_dtype(dtype)
        gguf = open_gguf(path)
        tokenizer = Tokenizer.from_gguf(gguf)
        weights = load_weights(gguf, torch_dtype, torch_device, progress=progress)
        model = cls(gguf.config, weights, tokenizer, path=path, n_ctx=n_ctx)
        model.load_seconds = time.perf_counter() - started
        return model

    def new_sequence(self, n_ctx: int | None = None) -> TorchSequence:
        capacity = n_ctx or self.n_ctx
        if capacity > self.n_ctx:
            raise ValueError(f"a sequence of {capacity} tokens exceeds this model's n_ctx={self.n_ctx}; load with a "
                             f"larger n_ctx")
        return TorchSequence(self, capacity)

    def synchronize(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)


def load_torch(path: str, device: str = "cpu", dtype: str = "float32", n_ctx: int | None = None,
               progress: bool = True) -> TorchModel:
    return TorchModel.from_gguf(path, device=device, dtype=dtype, n_ctx=n_ctx, progress=progress)
