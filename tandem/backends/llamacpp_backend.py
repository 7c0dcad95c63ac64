"""llama.cpp backend: GGUF models run by llama.cpp's kernels (CPU, Vulkan, Metal, CUDA) through llama-cpp-python.

We use only the low-level ctypes API (`llama_cpp.llama_cpp`), never the high-level `Llama` class: tandem owns the
loop, so all it needs is "decode these tokens at these positions, give me every row's logits" and "forget positions
>= n". One `llama_model` (the weights, mmapped once) serves any number of `llama_context`s; each `LlamaCppSequence`
owns one context with a single KV sequence (seq_id 0), and rewinding is `llama_memory_seq_rm(mem, 0, n, -1)`: it
marks cells free and copies nothing.

Threads. The draft and the target run one after the other in tandem's loop (draft k steps, then verify), never at
the same time, so both contexts may use every core. Built with OpenMP (llama.cpp's default), every context's graph
runs on the calling thread's one OpenMP team, so an idle context has no threads of its own that could spin and steal
cores from the busy one. (Paired-vs-standalone draft cost is not yet measured on a quiet machine: the doctor should.)

NUMERICS. By default a row's logits depend on the batch it was computed in: llama.cpp's CPU backend multiplies
repacked quantised weights in groups of 4 rows (GEMV for the rest), and from 8 rows on switches to its "tiled"
matmul, so one position gets other logits in a 1-token step than in a 4- or 9-token verify (Qwen2.5-Coder-1.5B
Q4_K_M: up to 0.6 apart, measured 2026-12-03), and greedy speculation could drift from plain decoding at near
ties. tandem therefore loads weights unrepacked and turns the tiled matmul off (GGML_CPU_TILED_MM=0, read once per
process): every row is then computed by the same per-row dot products whatever the batch, and logits of 1..17-row
batches are bit-identical to single steps (tests/test_llamacpp_backend.py). Attention needs one more step: with
an F16 KV cache, llama.cpp's CPU flash attention splits a single query's keys across threads once the padded KV
span reaches 512 (contexts past 256 tokens) but not a batch's, so logits drifted by up to 3.6 after 300 tokens; a
Q8_0 KV cache takes the same unsplit kernel for 1 and n queries (exact at 100, 300 and 520 tokens, same speed),
so the CPU default is a Q8_0 cache with flash attention. Measured cost on this 2-core CPU:
plain step 31-34 -> 35 ms, 9-token verify 194-198 -> 184 ms, 300-token prefill 4.0 -> 4.6 s (noisy machine). Set
GGML_CPU_TILED_MM=1 and repack=True for the faster prefill where exact greedy identity does not matter. GPU builds
(Vulkan, CUDA, Metal) pick matrix-vector kernels for small batches and are not batch-invariant: measure there.

Tokenization is tandem's own `Tokenizer` read from the GGUF metadata, never llama.cpp's, so this backend and the torch
backend turn text into the same ids; the `ModelConfig` comes from the same metadata (no weights are dequantised).
"""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import llama_cpp.llama_cpp as llc
import numpy as np
import torch

from tandem.backends.base import BatchedCache, Model, Sequence
from tandem.backends.devices import DeviceInfo, device_info, no_device_hint
from tandem.backends.llamacpp_runtime import init_llama, recent_errors
from tandem.loading.gguf import open_gguf
from tandem.loading.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tandem.config import ModelConfig

SEQ_ID = 0  # every context holds one sequence
DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512  # prefill chunk: the most tokens one llama_decode call takes
DRAFT_N_BATCH = 32  # enough for a draft's prefill chunks and any k + 1; smaller compute buffers
MAX_FREE_CONTEXTS = 4  # closed sequences' contexts kept per model for reuse
GPU_DEVICES = ("vulkan", "metal", "cuda", "rocm", "hip", "sycl", "gpu")
ALL_LAYERS = -1  # llama.cpp's n_gpu_layers for "offload every layer"
GGML_TYPE_Q8_0 = 8  # ggml_type of a Q8_0 KV cache (see NUMERICS)

def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings counted once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
            )
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def _gpu_layers_for(device: str, n_gpu_layers: int, info: DeviceInfo | None) -> int:
    """Layers to offload; `info` is device_info(device), looked up once by the caller (it may open a Vulkan
    instance)."""
    kind = device.split(":")[0].lower()
    if kind == "cpu":
        return n_gpu_layers
    if kind not in GPU_DEVICES:
        raise ValueError(f"unknown device {device!r} for the llama.cpp backend: use 'cpu' or one of {GPU_DEVICES}")
    if kind != "gpu" and info is None:  # also catches "vulkan" on a CUDA build
        raise ValueError(f"device {device!r} asked for, but {no_device_hint(device)}")
    if not llc.llama_supports_gpu_offload():
        raise ValueError(f"device {device!r} asked for, but {no_device_hint(device)}")
    return n_gpu_layers if n_gpu_layers not in (0, 99) else ALL_LAYERS


class _Context:
    """One llama_context with its batch and numpy views onto the batch's arrays."""

    def __init__(self, model: LlamaCppModel, n_ctx: int, n_batch: int, n_threads: int, n_seq: int = 1) -> None:
        """n_seq > 1: that many sequences of n_ctx tokens each, each in a KV stream of its own (not unified: a
        sequence's keys then sit in position order as in a context of its own, and attention reads only its
        stream; see LlamaCppBatchedCache)."""
        params = llc.llama_context_default_params()
        params.n_ctx = n_ctx * n_seq
        params.n_batch = n_batch
        params.n_ubatch = n_batch  # one graph per llama_decode: a verify batch is never split
        params.n_seq_max = n_seq
        params.kv_unified = n_seq == 1
        # Sliding-window layers (gemma3/4) keep every position: a window-sized cache drops keys a rewind further
        # back than the window needs again (a reused prefix; tests/test_gemma4.py). llama.cpp's default today.
        params.swa_full = True
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.no_perf = True
        if model.kv_q8:
            params.type_k = params.type_v = GGML_TYPE_Q8_0
        if model.flash_attn is not None:
            params.flash_attn_type = (
                llc.LLAMA_FLASH_ATTN_TYPE_ENABLED if model.flash_attn else llc.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        ctx = llc.llama_init_from_model(model._model, params)
        if not ctx:
            raise RuntimeError(
                f"llama.cpp could not create a context (n_ctx={n_ctx}, n_batch={n_batch}) for {model.path!r}: "
                + " | ".join(recent_errors)
            )
        self.ctx = ctx
        self.key = (n_ctx, n_batch, n_threads)
        self.n_batch = n_batch
        self.memory = llc.llama_get_memory(ctx)
        self.batch = llc.llama_batch_init(n_batch, 0, 1)
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(n_batch,))  # int32
        self.positions = np.ctypeslib.as_array(self.batch.pos, shape=(n_batch,))  # int32
        self.wants_logits = np.ctypeslib.as_array(self.batch.logits, shape=(n_batch,))  # int8
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n_batch,))[:] = 1
        for i in range(n_batch):
            self.batch.seq_id[i][0] = SEQ_ID

    def clear(self) -> None:
        llc.llama_memory_clear(self.memory, True)

    def free(self) -> None:
        if self.ctx:
            llc.llama_batch_free(self.batch)
            llc.llama_free(self.ctx)
            self.ctx = None


class LlamaCppSequence(Sequence):
    """One llama.cpp context = one KV cache of `capacity` tokens."""

    def __init__(self, model: LlamaCppModel, context: _Context, capacity: int) -> None:
        self.model = model
        self.capacity = capacity
        self._context: _Context | None = context
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def forward(self, tokens: Seq[int] | torch.Tensor, logits: Literal["all", "last"] = "all") -> torch.Tensor:
        """Feed T tokens at positions length..length+T-1.

        Args:
            tokens: T token ids.
            logits: "all" returns [T, vocab]; "last" returns only the last row, [1, vocab] (prefill: llama.cpp then
                computes the output layer for one row instead of T, and long inputs go in chunks of n_batch).
        Returns:
            float32 logits, a copy owned by the caller.
        """
        context = self._live_context()
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        n_tokens = len(ids)
        self._check_room(n_tokens)
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        vocab = self.model.vocab_size
        if n_tokens == 0:
            return torch.empty((0, vocab), dtype=torch.float32)
        out = np.empty((n_tokens if logits == "all" else 1, vocab), dtype=np.float32)
        start_length = self._length
        for start in range(0, n_tokens, context.n_batch):
            chunk = ids[start : start + context.n_batch]
            n = len(chunk)
            last_chunk = start + n == n_tokens
            context.tokens[:n] = chunk
            context.positions[:n] = np.arange(self._length, self._length + n, dtype=np.int32)
            if logits == "all":
                context.wants_logits[:n] = 1
            else:
                context.wants_logits[:n] = 0
                context.wants_logits[n - 1] = 1 if last_chunk else 0
            context.batch.n_tokens = n
            rc = llc.llama_decode(context.ctx, context.batch)
            if rc != 0:
                self._length = start_length
                llc.llama_memory_seq_rm(context.memory, SEQ_ID, start_length, -1)
                raise RuntimeError(
                    f"llama_decode failed with {rc} for {n} tokens at position {start_length + start} "
                    f"({self.model.path!r}): " + " | ".join(recent_errors)
                )
            self._length += n
            if logits == "all":
                rows = llc.llama_get_logits(context.ctx)  # [n, vocab], in batch order
                out[start : start + n] = np.ctypeslib.as_array(rows, shape=(n, vocab))
            elif last_chunk:
                out[0] = np.ctypeslib.as_array(llc.llama_get_logits_ith(context.ctx, n - 1), shape=(vocab,))
        return torch.from_numpy(out)

    def rewind(self, length: int) -> None:
        context = self._live_context()
        self._check_rewind(length)
        if length == self._length:
            return
        if not llc.llama_memory_seq_rm(context.memory, SEQ_ID, length, -1):
            raise RuntimeError(f"llama.cpp refused to remove positions >= {length} from {self.model.path!r}")
        self._length = length

    def close(self) -> None:
        if self._context is not None:
            self.model._release_context(self._context)
            self._context = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the module globals may be gone
            pass

    def _live_context(self) -> _Context:
        if self._context is None:
            raise RuntimeError("this sequence is closed")
        return self._context


class LlamaCppBatchedCache(BatchedCache):
    """`slots` sequences in one llama_context (n_seq_max = slots, one KV stream each): one llama_decode a step
    feeds every sequence's rows, each token tagged with its sequence id (= its slot). Rewinding is
    llama_memory_seq_rm on that sequence; a prefix is copied between sequences with llama_memory_seq_cp.
    Batches larger than n_batch go in several decodes, whole rows in order: on the CPU a row's logits do not depend
    on its batch (see NUMERICS), so the split changes nothing."""

    can_copy = True

    def __init__(self, model: LlamaCppModel, slots: int, capacity: int, n_batch: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.model, self.slots, self.capacity = model, slots, capacity
        self._context = _Context(model, capacity, n_batch, model.n_threads, n_seq=slots)
        self._lengths = [0] * slots

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        self._check(batch)
        context, vocab = self._context, self.model.vocab_size
        rows = []  # (slot, token, position, wants logits) in batch order
        for (slot, tokens), last in zip(batch, last_only, strict=True):
            start, n = self._lengths[slot], len(tokens)
            rows += [(slot, int(t), start + i, not last or i == n - 1) for i, t in enumerate(tokens)]
        outputs = np.empty((sum(r[3] for r in rows), vocab), dtype=np.float32)
        written = 0
        for begin in range(0, len(rows), context.n_batch):
            chunk = rows[begin : begin + context.n_batch]
            n = len(chunk)
            slots, tokens, positions, wanted = (np.array(column) for column in zip(*chunk, strict=True))
            context.tokens[:n] = tokens
            context.positions[:n] = positions
            context.wants_logits[:n] = wanted
            for i, slot in enumerate(slots.tolist()):
                context.batch.seq_id[i][0] = slot
            context.batch.n_tokens = n
            rc = llc.llama_decode(context.ctx, context.batch)
            if rc != 0:
                for slot, _ in batch:  # forget whatever part of this forward went in
                    llc.llama_memory_seq_rm(context.memory, slot, self._lengths[slot], -1)
                raise RuntimeError(f"llama_decode failed with {rc} for a batch of {n} tokens "
                                   f"({self.model.path!r}): " + " | ".join(recent_errors))
            n_out = int(wanted.sum())
            if n_out:
                logits = llc.llama_get_logits(context.ctx)  # [n_out, vocab]: the flagged rows, in batch order
                outputs[written : written + n_out] = np.ctypeslib.as_array(logits, shape=(n_out, vocab))
                written += n_out
        for slot, tokens in batch:
            self._lengths[slot] += len(tokens)
        out, at = [], 0
        for (_, tokens), last in zip(batch, last_only, strict=True):
            count = 1 if last else len(tokens)
            out.append(torch.from_numpy(outputs[at : at + count]))
            at += count
        return out

    def rewind(self, slot: int, length: int) -> None:
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"cannot rewind slot {slot} to {length}: it holds {self._lengths[slot]} tokens")
        if length < self._lengths[slot]:
            if not llc.llama_memory_seq_rm(self._context.memory, slot, length, -1):
                raise RuntimeError(f"llama.cpp refused to remove positions >= {length} of sequence {slot}")
            self._lengths[slot] = length

    def copy_prefix(self, src: int, dst: int, length: int) -> bool:
        if not 0 <= length <= self._lengths[src]:
            raise ValueError(f"cannot copy {length} positions: slot {src} holds {self._lengths[src]}")
        if src != dst:
            memory = self._context.memory
            # Between KV streams llama.cpp copies only a whole sequence; then the tail goes.
            llc.llama_memory_seq_rm(memory, dst, -1, -1)
            llc.llama_memory_seq_cp(memory, src, dst, -1, -1)
            llc.llama_memory_seq_rm(memory, dst, length, -1)
        self._lengths[dst] = length
        return True

    def close(self) -> None:
        if self._context is not None:
            self._context.free()
            self._context = None


class LlamaCppModel(Model):
    """A GGUF file loaded by llama.cpp: weights once, one context per sequence."""

    backend = "llama.cpp"

    def __init__(
        self,
        path: str | os.PathLike,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        device: str = "cpu",
        n_batch: int = DEFAULT_N_BATCH,
        flash_attn: bool | None = None,
        use_mmap: bool = True,
        repack: bool = False,
    ) -> None:
        """Args:
        path: the GGUF file.
        n_ctx: default capacity of new sequences.
        n_threads: threads per decode (default: every physical core; a draft may be given its own count).
        n_gpu_layers: layers to offload to a GPU build's device (-1 or 99 = all); device="vulkan"/"metal"/"cuda"
            offloads all of them.
        n_batch: most tokens per llama_decode call (also the prefill chunk); DRAFT_N_BATCH suits a draft.
        flash_attn: None lets llama.cpp decide.
        repack: let llama.cpp's CPU backend repack quantised weights into its interleaved layouts (faster
            prefill GEMM, but logits then depend on the batch: see NUMERICS above).
        """
        self.path = os.fspath(path)
        # Before llama.cpp sees the path: a GGUFError (a ValueError) names it when the file is missing or bad, and
        # when its data section does not match its header (llama.cpp itself loads a file whose tensor count is
        # short, every tensor read from the wrong bytes).
        gguf = open_gguf(self.path)
        self.config: ModelConfig = gguf.config
        self.tokenizer: Tokenizer = Tokenizer.from_gguf(gguf)
        self.device = device
        # None (what tandem.load passes when no context is asked for) means the default, as in the torch backend.
        self.n_ctx = n_ctx if n_ctx is not None else min(DEFAULT_N_CTX, self.config.context_length)
        self.n_batch = n_batch
        self.n_threads = n_threads or physical_cores()
        kind = device.split(":")[0].lower()
        info = device_info(device) if kind in GPU_DEVICES and kind != "gpu" else None
        self.n_gpu_layers = _gpu_layers_for(device, n_gpu_layers, info)
        self.flash_attn = flash_attn
        # On the CPU, a Q8_0 KV cache (which needs flash attention) keeps attention batch-invariant (see NUMERICS);
        # its 32-value blocks must divide a head (gemma4: both head widths).
        head_dims = (self.config.head_dim, self.config.global_head_dim or self.config.head_dim)
        self.kv_q8 = device.lower() == "cpu" and flash_attn is not False and all(d % 32 == 0 for d in head_dims)
        if self.kv_q8:
            self.flash_attn = True
        if flash_attn is None and info is not None and info.vulkan_device_type == "cpu":
            # Mesa 22.3's lavapipe (Debian bookworm) crashes in its worker threads running ggml's Vulkan flash
            # attention shader: 5 of 6 runs of a tiny Q8_0 model segfaulted with it, 0 of 6 without.
            self.flash_attn = False
        self._free_contexts: list[_Context] = []

        init_llama()
        params = llc.llama_model_default_params()
        params.n_gpu_layers = self.n_gpu_layers
        params.use_mmap = use_mmap
        params.use_extra_bufts = repack
        recent_errors.clear()
        model = llc.llama_model_load_from_file(self.path.encode(), params)
        if not model:
            raise ValueError(
                f"llama.cpp could not load {self.path!r}: " + (" | ".join(recent_errors) or "no reason given")
            )
        self._model = model
        n_vocab = llc.llama_vocab_n_tokens(llc.llama_model_get_vocab(model))
        if n_vocab != self.config.vocab_size:
            # llama.cpp's logits rows have n_vocab entries; every tensor we return must match config.vocab_size.
            raise ValueError(
                f"{self.path!r}: llama.cpp sees {n_vocab} tokens, the GGUF metadata {self.config.vocab_size}"
            )

    def new_sequence(self, n_ctx: int | None = None, drafting: bool = False,
                     n_batch: int | None = None) -> LlamaCppSequence:
        """Open an empty KV cache of n_ctx tokens (default self.n_ctx). n_batch defaults to the model's, or to
        DRAFT_N_BATCH for a draft's sequence: its compute buffers are sized for k-token steps, not prompts."""
        if self._model is None:
            raise RuntimeError(f"model {self.path!r} is closed")
        capacity = n_ctx or self.n_ctx
        n_batch = min(n_batch or (DRAFT_N_BATCH if drafting else self.n_batch), capacity)
        key = (capacity, n_batch, self.n_threads)
        for i, context in enumerate(self._free_contexts):
            if context.key == key:
                del self._free_contexts[i]
                return LlamaCppSequence(self, context, capacity)
        return LlamaCppSequence(self, _Context(self, capacity, n_batch, self.n_threads), capacity)

    def kv_bytes_per_token(self) -> int:
        c = self.config  # gemma4: an upper bound (its widest heads and most KV heads on every layer)
        values = 2 * c.n_layers * c.n_kv_heads * max(c.head_dim, c.global_head_dim or 0)
        return values * 34 // 32 if self.kv_q8 else values * 2  # Q8_0: 34 bytes a block of 32; else F16

    def new_batched_cache(self, slots: int, n_ctx: int | None = None, drafting: bool = False) -> LlamaCppBatchedCache:
        if self._model is None:
            raise RuntimeError(f"model {self.path!r} is closed")
        capacity = n_ctx or self.n_ctx
        return LlamaCppBatchedCache(self, slots, capacity, self.n_batch)

    def _release_context(self, context: _Context) -> None:
        if self._model is None or len(self._free_contexts) >= MAX_FREE_CONTEXTS:
            context.free()
            return
        context.clear()
        self._free_contexts.append(context)

    def close(self) -> None:
        """Free the cached contexts and the weights; sequences still open must be closed first."""
        for context in self._free_contexts:
            context.free()
        self._free_contexts.clear()
        if self._model is not None:
            llc.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def load_llamacpp(
    path: str | os.PathLike,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    n_gpu_layers: int = 0,
    device: str = "cpu",
    n_batch: int = DEFAULT_N_BATCH,
    flash_attn: bool | None = None,
    repack: bool = False,
) -> LlamaCppModel:
    """Load a GGUF file with llama.cpp.

    Args:
        path: GGUF file.
        n_ctx: default capacity of the model's sequences.
        n_threads: threads per decode; default every physical core.
        n_gpu_layers: layers to offload on a GPU build (-1 = all).
        device: "cpu", or "vulkan"/"metal"/"cuda" to offload every layer.
        n_batch: most tokens per llama_decode (prefill chunk size); a draft model is fine with DRAFT_N_BATCH.
        flash_attn: force flash attention on/off; None lets llama.cpp choose.
    Returns:
        The loaded model.
    Raises:
        ValueError: the file is missing, not GGUF, or llama.cpp cannot load it.
    """
    return LlamaCppModel(
        path,
        n_ctx=n_ctx,
        n_threads=n_threads,
        n_gpu_layers=n_gpu_layers,
        device=device,
        n_batch=n_batch,
        flash_attn=flash_attn,
        repack=repack,
    )
