"""PyTorch backend: GGUF weights dequantized to one dtype, run by tandem.models.transformer on any torch device."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence as Seq

import torch

from tandem.backends.base import Model
from tandem.backends.torch_batched import TorchBatchedCache
from tandem.backends.torch_graphs import GRAPH_ROWS
from tandem.backends.torch_sequence import GRAPH_CHUNKS_MAX, SLOT_ALIGN, TorchSequence
from tandem.cache import KVCache
from tandem.config import ModelConfig
from tandem.loading.gguf import open_gguf
from tandem.loading.progress import name_of, report
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


class TorchModel(Model):
    backend = "torch"

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer, path: str = "",
                 n_ctx: int | None = None, graphs: bool | None = None) -> None:
        """graphs: run forwards of up to a sequence's rows as padded static-shape steps (None: on CUDA, where they
        are captured and replayed as CUDA graphs; True elsewhere runs the same steps without capture, for tests)."""
        self.path = str(path)
        self.config = config
        self.tokenizer = tokenizer
        any_weight = weights["token_embd.weight"]
        self.torch_device, self.dtype = any_weight.device, any_weight.dtype
        self.device = str(self.torch_device)
        self.n_ctx = n_ctx if n_ctx is not None else min(DEFAULT_CTX, config.context_length)
        # Positions run past n_ctx by a padded forward's rows (see StepGraph) and the alignment of cache slots.
        self.transformer = Transformer(config, weights, max_positions=self.n_ctx + GRAPH_ROWS + SLOT_ALIGN)
        self.load_seconds = 0.0
        on_cuda = self.torch_device.type == "cuda"
        if on_cuda:
            # cuDNN's attention builds a plan per new (rows, keys) shape, paid by every conversation turn (each a new
            # length); the other SDPA kernels take any shape at no cost (docs/decisions/0003-first-token.md).
            # Process-wide: torch offers no per-call switch that compiled code keeps.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.use_graphs = graphs if graphs is not None else on_cuda and os.environ.get("TANDEM_CUDA_GRAPHS", "1") != "0"
        self.step = self.transformer.forward  # what graphs capture; compiled on CUDA (see _compile_step)
        self.compiled_caches: set[bool] | None = None  # kinds of cache (is a view) compiled for; None: eager
        if on_cuda and self.use_graphs and os.environ.get("TANDEM_COMPILE", "1") != "0":
            self.step = _compile_step(self.transformer)
            self.compiled_caches = set()
        self._free: dict[int, list[TorchSequence]] = {}  # capacity -> closed sequences ready for reuse

    @classmethod
    def from_gguf(cls, path: str, device: str = "cpu", dtype: str = "float32", n_ctx: int | None = None,
                  progress: bool = True, graphs: bool | None = None) -> TorchModel:
        started = time.perf_counter()
        torch_device, torch_dtype = parse_device(device), parse_dtype(dtype)
        name = name_of(path)
        report(f"reading {name}'s header and vocabulary")
        gguf = open_gguf(path)
        tokenizer = Tokenizer.from_gguf(gguf)
        weights = load_weights(gguf, torch_dtype, torch_device, progress=progress)
        report(f"building {name}'s layers")
        model = cls(gguf.config, weights, tokenizer, path=path, n_ctx=n_ctx, graphs=graphs)
        model.load_seconds = time.perf_counter() - started
        return model

    def new_sequence(self, n_ctx: int | None = None, drafting: bool = False) -> TorchSequence:
        # drafting changes nothing here: a draft's sequence graphs the same GRAPH_ROWS rows as a target's.
        capacity = n_ctx or self.n_ctx
        if capacity > self.n_ctx:
            raise ValueError(f"a sequence of {capacity} tokens exceeds this model's n_ctx={self.n_ctx}; load with a "
                             f"larger n_ctx")
        free = self._free.get(capacity)
        if free:
            seq = free.pop()
            seq.cache.length = 0
            return seq
        return TorchSequence(self, capacity, GRAPH_ROWS)

    def new_batched_cache(self, slots: int, n_ctx: int | None = None, drafting: bool = False) -> TorchBatchedCache:
        capacity = n_ctx or self.n_ctx
        if capacity > self.n_ctx:
            raise ValueError(f"sequences of {capacity} tokens exceed this model's n_ctx={self.n_ctx}")
        return TorchBatchedCache(self, slots, capacity)

    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.n_layers * c.n_kv_heads * c.head_dim * self.dtype.itemsize

    def logits(self, ids: Seq[int]) -> torch.Tensor:
        # Eager, in a cache of its own: a graph's output buffer would be overwritten by the next replay.
        seq = TorchSequence(self, max(len(ids), 1), rows=1, graphs=False)
        return seq.forward(list(ids), logits="all")

    def compile_prompt_forward(self, cache: KVCache) -> None:
        """Compile the step for prompts longer than the graphs replay (one forward of GRAPH_CHUNKS_MAX + 1 tokens
        into a cache that holds nothing yet), once per kind of cache (a pool's row, a view, and a cache of its own
        are guarded apart), with the model's first sequence of that kind: else the first long prompt waits for it
        (tens of seconds on a GPU). Dynamic shapes: every longer prompt reuses it (docs/decisions/0007)."""
        n, kind = GRAPH_CHUNKS_MAX + 1, cache.k[0]._base is not None
        if self.compiled_caches is None or kind in self.compiled_caches or cache.k[0].shape[2] < n:
            return
        self.compiled_caches.add(kind)
        report(f"compiling {name_of(self.path)}'s prompt step")
        with torch.inference_mode():
            self.step(torch.zeros(n, dtype=torch.long, device=self.torch_device),
                      torch.arange(n, device=self.torch_device), cache.k, cache.v, kv_len=n, last_only=True)

    def release(self, seq: TorchSequence) -> None:
        """Keep a closed sequence for reuse when it holds a captured graph (capturing costs ~10 ms a size)."""
        free = self._free.setdefault(seq.capacity, [])
        if seq.graphs is not None and len(free) < SEQUENCE_POOL and all(s is not seq for s in free):
            free.append(seq)

    def synchronize(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)


def _compile_step(transformer: Transformer):
    """The forward with its layers as Inductor compiles them: rms_norm, rope, residual adds and the softmax fuse
    into a few kernels, a third of the launches an eager step makes. Falls back to the eager forward when Triton is
    missing or compilation fails.

    One compiled layer serves every layer (their weights are its inputs): compiling the whole forward took minutes
    on a GPU (docs/decisions/0003). It compiles once a model and kind of call, never for a new length: the
    last_only choice stays outside (a bool would be a guard), shapes are dynamic without duck sizing (a prompt of
    exactly head_dim or n_kv_heads tokens would otherwise specialise on it) and no prompt piece is shorter than the
    first compiled one (see prefill_chunks). Its variants, all compiled at start and shared by the target and the
    draft: a pool's row or a cache of its own x prompt pieces or StepGraph's rows (x local and global layers, where
    a model has both). Past dynamo's recompile limit (raised to 16 for them) a step would fall back to eager with a
    warning."""
    try:
        import triton  # noqa: F401  (Inductor's GPU code generator)
    except ImportError:
        return transformer.forward
    import torch.fx.experimental._config as shapes_config

    from tandem.loading.registry import tandem_home

    # Compiled kernels kept beside tandem's other state, so a restart reuses them (Inductor and Triton key their
    # caches by source, shapes, device and versions); a user's own setting wins.
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        os.environ.setdefault(var, os.path.join(tandem_home(), "compiled", sub))
    shapes_config.use_duck_shape = False  # read when a compilation starts; tandem's compilations are all dynamic
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)  # see the docstring
    layer = torch.compile(transformer.layer, dynamic=True)

    def step(tokens, positions, cache_k, cache_v, kv_len=None, last_only=False, tapped=None):
        nonlocal layer
        try:
            x = transformer.hidden(tokens, positions, cache_k, cache_v, kv_len, layer=layer, tapped=tapped)
        except Exception as error:  # a compiler bug must cost speed, never a request
            if layer == transformer.layer:
                raise
            warnings.warn(f"torch.compile failed ({type(error).__name__}: {error}); running the step eagerly",
                          stacklevel=2)
            layer = transformer.layer
            x = transformer.hidden(tokens, positions, cache_k, cache_v, kv_len, tapped=tapped)
        return transformer.project(x[-1:] if last_only else x)

    return step


def load_torch(path: str, device: str = "cpu", dtype: str = "float32", n_ctx: int | None = None,
               progress: bool = True, graphs: bool | None = None) -> Model:
    """A target (TorchModel), or a head draft (an eagle3 file: torch_head.TorchHeadModel) to attach to one."""
    if open_gguf(path).architecture == "eagle3":
        from tandem.backends.torch_head import TorchHeadModel

        return TorchHeadModel(path, device=parse_device(device), dtype=parse_dtype(dtype), n_ctx=n_ctx)
    return TorchModel.from_gguf(path, device=device, dtype=dtype, n_ctx=n_ctx, progress=progress, graphs=graphs)
