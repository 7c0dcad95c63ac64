"""PyTorch backend: GGUF weights dequantized to one dtype, run by tandem.models.transformer on any torch device."""

from __future__ import annotations

import os
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
GRAPH_MAX_TOKENS = 17  # forwards of up to this many tokens (a verify of k_max + 1 = 17) replay CUDA graphs
SEQUENCE_POOL = 4  # closed sequences kept per capacity: their caches and captured graphs are reused


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


class StepGraphs:
    """CUDA graphs of forwards of n = 1..GRAPH_MAX_TOKENS tokens over one cache, each captured on first use.

    A small model's decode step is hundreds of kernel launches that each take less time to run than to launch;
    replaying a graph launches them all at once. Inputs are static buffers: tokens are copied in, and positions
    come from one device scalar, so a replay creates no tensor and waits for nothing on the host.
    """

    def __init__(self, model: TorchModel, cache: KVCache) -> None:
        device = model.torch_device
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(GRAPH_MAX_TOKENS, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.offsets = torch.arange(GRAPH_MAX_TOKENS, device=device)
        # Host tokens go through pinned memory: a copy that needs no staging and never blocks the host. Reusing it
        # is safe because the decode loop synchronises once per iteration, after every copy out of it has run.
        self.host = torch.zeros(GRAPH_MAX_TOKENS, dtype=torch.long, pin_memory=True)
        self.host_view = self.host.numpy()
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, n: int, last_only: bool) -> torch.Tensor:
        positions = self.start + self.offsets[:n]
        # kv_len=None: attend over the whole static cache under the causal mask, so shapes never change.
        return self.model.transformer(self.tokens[:n], positions, self.cache, kv_len=None, last_only=last_only)

    def _capture(self, n: int, last_only: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream(self.model.torch_device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: cuBLAS handles, workspace, autotuning
            self._forward(n, last_only)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.model.graph_pool):
            logits = self._forward(n, last_only)
        return graph, logits

    def run(self, tokens: Seq[int] | torch.Tensor, start: int, last_only: bool) -> torch.Tensor:
        n = len(tokens)
        if isinstance(tokens, torch.Tensor):
            self.tokens[:n].copy_(tokens, non_blocking=True)
        else:
            self.host_view[:n] = tokens
            self.tokens[:n].copy_(self.host[:n], non_blocking=True)
        self.start.fill_(start)
        key = (n, last_only)
        if key not in self.graphs:
            self.graphs[key] = self._capture(n, last_only)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits  # a static buffer: valid until this sequence's next forward of the same size


class TorchSequence(Sequence):
    def __init__(self, model: TorchModel, capacity: int, graphs: bool = True) -> None:
        self.model = model
        self.capacity = capacity
        self.cache: KVCache = model.transformer.new_cache(capacity)
        self.graphs = StepGraphs(model, self.cache) if model.use_graphs and graphs else None

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(self, tokens: Seq[int] | torch.Tensor, logits: str = "all") -> torch.Tensor:
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        self._check_room(n)
        with torch.inference_mode():
            if self.graphs is not None and n <= GRAPH_MAX_TOKENS:
                out = self.graphs.run(tokens, self.cache.length, last_only=logits == "last")
                self.cache.length += n
                return out
            tokens = torch.as_tensor(tokens, dtype=torch.long).to(self.model.torch_device, non_blocking=True)
            rows = []
            for start in range(0, n, PREFILL_CHUNK):
                chunk = tokens[start : start + PREFILL_CHUNK]
                begin, end = self.cache.length, self.cache.length + chunk.shape[0]
                positions = torch.arange(begin, end, device=self.model.torch_device)
                rows.append(self.model.transformer(chunk, positions, self.cache, kv_len=end, last_only=logits == "last"))
                self.cache.length = end
        return rows[-1] if logits == "last" else torch.cat(rows) if len(rows) > 1 else rows[0]

    def rewind(self, length: int) -> None:
        self.cache.rewind(length)

    def close(self) -> None:
        self.model.release(self)


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
        self.use_graphs = self.torch_device.type == "cuda" and os.environ.get("TANDEM_CUDA_GRAPHS", "1") != "0"
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._free: dict[int, list[TorchSequence]] = {}  # capacity -> closed sequences ready for reuse

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
        free = self._free.get(capacity)
        if free:
            seq = free.pop()
            seq.cache.length = 0
            return seq
        return TorchSequence(self, capacity)

    def logits(self, ids: Seq[int]) -> torch.Tensor:
        # Eager, in a cache of its own: a graph's output buffer would be overwritten by the next replay.
        seq = TorchSequence(self, max(len(ids), 1), graphs=False)
        return seq.forward(list(ids), logits="all")

    def release(self, seq: TorchSequence) -> None:
        """Keep a closed sequence for reuse when it holds captured graphs (capturing costs ~10 ms a size)."""
        free = self._free.setdefault(seq.capacity, [])
        if seq.graphs is not None and len(free) < SEQUENCE_POOL and all(s is not seq for s in free):
            free.append(seq)

    def synchronize(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)


def load_torch(path: str, device: str = "cpu", dtype: str = "float32", n_ctx: int | None = None,
               progress: bool = True) -> TorchModel:
    return TorchModel.from_gguf(path, device=device, dtype=dtype, n_ctx=n_ctx, progress=progress)
