"""llama.cpp's side of the llama.cpp backend, without torch: weights, contexts, and forwards into numpy arrays (one
sequence's here, many sequences' in llamacpp_batched).

`llamacpp_backend` wraps these classes for tandem's interface in the same process (torch tensors over the numpy
rows); `llamacpp_worker` runs them in a process of their own, where torch must never be imported (a CUDA build of
llama.cpp and torch's CUDA libraries crash in one process: docs/backends.md). Nothing here imports torch or the
GGUF reader; the caller passes what it read from the file's metadata.

KERNELS. On the CPU llama.cpp repacks Q4_0/Q4_K/IQ4_NL weights (AVX2) into interleaved layouts whose matmul computes
a call's first n - n % 4 rows with a 4-row GEMM and the rest with a GEMV, and the two give a row different logits
(up to 0.7 apart on Qwen2.5-Coder-1.5B Q4_K_M). Each kernel alone is exact whatever the batch: a GEMM row is the
same in any call and any group of 4, a GEMV row the same in a call of 1, 2 or 3 rows (measured bit for bit,
2026-12-04). So a target's rows keep one kernel per kind of row:
- prompt rows (Sequence.forward(logits="last"), BatchedForward entries with last_only) go in calls of their own,
  n_batch rows a call (a multiple of 4): the GEMM for all but a prompt's last len % 4 rows, as llama-server does;
- every other row (plain steps, verifies, logits()) goes in calls of at most GEMV_ROWS rows: the GEMV, the kernel
  of a plain one-token step, so a verify gives each token the logits a plain step would.
A prompt chunk must then start at a multiple of 4 (PREFILL_ALIGN) and a reused prefix must end at one and lie in
the GEMM part of the prompt that computed it (BatchedForward.reusable), or the same prompt would see other KV.
The GEMV of repacked weights is what makes plain decoding as fast as llama-server's (1.19x the unrepacked
per-row kernel on this 2-core AVX2 CPU); without repacking (repack=False) every row takes one kernel anyway.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path

import llama_cpp.llama_cpp as llc
import numpy as np

from tandem.backends.devices import DeviceInfo, device_info, no_device_hint
from tandem.backends.llamacpp_runtime import captured_log, init_llama, recent_errors

MAX_FREE_CONTEXTS = 4  # closed sequences' contexts kept per model for reuse
GPU_DEVICES = ("vulkan", "metal", "cuda", "rocm", "hip", "sycl", "gpu")
ALL_LAYERS = -1  # llama.cpp's n_gpu_layers for "offload every layer"
GGML_TYPE_Q8_0 = 8  # ggml_type of a Q8_0 K cache (see NUMERICS in llamacpp_backend)
GEMV_ROWS = 3  # ggml's repacked matmul takes its GEMM from 4 rows a call on (see KERNELS)
PREFILL_ALIGN = 4  # ... in groups of 4 rows from the call's first
REPACKED_BUFFER = "CPU_REPACK model buffer size"  # what llama.cpp logs when it repacked some weights at load

# allocate(rows, vocab) -> a float32 array [rows, vocab] that forward fills (the worker's lives in shared memory)
Allocator = Callable[[int, int], np.ndarray]


def new_rows(rows: int, vocab: int) -> np.ndarray:
    return np.empty((rows, vocab), dtype=np.float32)


class ReusedRows:
    """An Allocator of one buffer, grown as needed: for rows read (their argmax) before the next forward. A
    BatchedForward of one llama_decode hands such a caller llama.cpp's own logits rows instead (Context.last_logits),
    which hold until the next forward as well: a Qwen row is 608 KB, and copying it cost a drafted token ~70 us in
    the loop on a CPU host."""

    def __init__(self) -> None:
        self._buffer = np.empty((0, 0), dtype=np.float32)

    def __call__(self, rows: int, vocab: int) -> np.ndarray:
        if self._buffer.shape[0] < rows or self._buffer.shape[1] != vocab:
            self._buffer = np.empty((rows, vocab), dtype=np.float32)
        return self._buffer[:rows]


def argmax_rows(rows: np.ndarray) -> np.ndarray:
    """Each row's argmax, int64 (numpy's: the first of equal maxima, as tandem.sampling.argmax)."""
    return np.asarray(rows.argmax(axis=-1), dtype=np.int64)


def top_probability(row: np.ndarray) -> float:
    """The largest softmax probability of one logits row [V]: a greedy draft's confidence in its token."""
    return float(1.0 / np.exp(row - row.max(), dtype=np.float64).sum())


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


def gpu_layers_for(device: str, n_gpu_layers: int, info: DeviceInfo | None) -> int:
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


class Context:
    """One llama_context with its batch and numpy views onto the batch's arrays."""

    def __init__(self, weights: LlamaCppWeights, n_ctx: int, n_batch: int, n_seq: int = 1,
                 unified: bool = False) -> None:
        """n_seq > 1: that many sequences of n_ctx tokens each, each in a KV stream of its own unless `unified`
        (see BatchedForward)."""
        params = llc.llama_context_default_params()
        params.n_ctx = n_ctx * n_seq
        params.n_batch = n_batch
        params.n_ubatch = n_batch  # one graph per llama_decode: a call's rows are never split (see KERNELS)
        params.n_seq_max = n_seq
        params.kv_unified = n_seq == 1 or unified
        # Sliding-window layers (gemma3/4) keep every position: a window-sized cache drops keys a rewind further
        # back than the window needs again (a reused prefix; tests/test_gemma4.py). llama.cpp's default today.
        params.swa_full = True
        params.n_threads = weights.n_threads
        params.n_threads_batch = weights.n_threads
        params.no_perf = True
        if weights.k_q8:  # V stays F16: its kernel is per row either way, and a Q8_0 V costs its dequantising
            params.type_k = GGML_TYPE_Q8_0
        if weights.flash_attn is not None:
            params.flash_attn_type = (
                llc.LLAMA_FLASH_ATTN_TYPE_ENABLED if weights.flash_attn else llc.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        ctx = llc.llama_init_from_model(weights.model, params)
        if not ctx:
            raise RuntimeError(
                f"llama.cpp could not create a context (n_ctx={n_ctx}, n_batch={n_batch}) for {weights.path!r}: "
                + " | ".join(recent_errors)
            )
        self.ctx = ctx
        self.weights = weights
        self.unified = bool(params.kv_unified)
        self.key = (n_ctx, n_batch)
        self.n_batch = n_batch
        self.memory = llc.llama_get_memory(ctx)
        self.batch = llc.llama_batch_init(n_batch, 0, 1)
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(n_batch,))  # int32
        self.positions = np.ctypeslib.as_array(self.batch.pos, shape=(n_batch,))  # int32
        self.wants_logits = np.ctypeslib.as_array(self.batch.logits, shape=(n_batch,))  # int8
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n_batch,))[:] = 1
        self._seq_ids = [0] * n_batch  # what batch.seq_id[i][0] holds, so a call writes only the ones that change
        for i in range(n_batch):
            self.batch.seq_id[i][0] = 0

    def decode(self, seq_ids: Seq[int], tokens: Seq[int], positions: Seq[int] | np.ndarray,
               wanted: Seq[bool] | np.ndarray, out: np.ndarray | None,
               before_read: Callable[[], None] | None = None) -> None:
        """One llama_decode of len(tokens) <= n_batch rows; the logits of the wanted rows (in order) into out
        [n_wanted, vocab] (None: left unread, and on a GPU maybe not yet computed). before_read runs between the two:
        llama_decode returns once the device has the work (the read waits for it), so work launched there runs on
        the device beside it. Raises RuntimeError when llama.cpp fails (the caller forgets the positions)."""
        n = len(tokens)
        self.tokens[:n] = tokens
        self.positions[:n] = positions
        self.wants_logits[:n] = wanted
        for i, seq in enumerate(seq_ids):
            if self._seq_ids[i] != seq:
                self.batch.seq_id[i][0] = self._seq_ids[i] = seq
        self.batch.n_tokens = n
        rc = llc.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with {rc} for {n} tokens at positions {positions[0]}.. "
                               f"({self.weights.path!r}): " + " | ".join(recent_errors))
        if before_read is not None:
            before_read()
        if out is not None and len(out):
            # [n_wanted, vocab], the flagged rows in batch order; one copy, straight into out
            ctypes.memmove(out.ctypes.data, llc.llama_get_logits(self.ctx), out.nbytes)

    def last_logits(self, rows: int) -> np.ndarray:
        """The last decode's wanted rows [rows, vocab] where llama.cpp keeps them (waiting for the device): valid
        until the next decode, which may overwrite or move them; read them before it, never hold them."""
        address = ctypes.cast(llc.llama_get_logits(self.ctx), ctypes.c_void_p).value
        vocab = self.weights.vocab_size
        return np.frombuffer((ctypes.c_float * (rows * vocab)).from_address(address), np.float32).reshape(rows, vocab)

    def clear(self) -> None:
        llc.llama_memory_clear(self.memory, True)

    def synchronize(self) -> None:
        """Wait for the work queued on the device (a decode whose rows were left unread)."""
        llc.llama_synchronize(self.ctx)

    def free(self) -> None:
        if self.ctx:
            llc.llama_batch_free(self.batch)
            llc.llama_free(self.ctx)
            self.ctx = None


class SequenceForward:
    """One context = one KV cache of `capacity` tokens (seq_id 0), fed as tandem's Sequence describes."""

    def __init__(self, weights: LlamaCppWeights, context: Context, capacity: int, exact: bool) -> None:
        self.weights, self.capacity, self.context = weights, capacity, context
        # rows a call of non-prompt rows takes: GEMV_ROWS where that keeps repacked weights on one kernel
        self.row_call = min(GEMV_ROWS, context.n_batch) if exact and weights.repacked else context.n_batch
        self.length = 0

    def forward(self, ids: Seq[int], last: bool, allocate: Allocator = new_rows) -> np.ndarray:
        """Feed ids at positions length.. and return their logits [len(ids), vocab], or [1, vocab] if last (a
        prompt: calls of n_batch rows, logits of the last row only). The caller checked the room."""
        context, vocab, n_tokens = self.context, self.weights.vocab_size, len(ids)
        out = allocate(1 if last else n_tokens, vocab)
        step = context.n_batch if last else self.row_call
        start_length = self.length
        try:
            for start in range(0, n_tokens, step):
                chunk = ids[start : start + step]
                n = len(chunk)
                positions = np.arange(self.length, self.length + n, dtype=np.int32)
                if last:
                    final = start + n == n_tokens
                    wanted = np.zeros(n, dtype=np.int8)
                    wanted[-1] = final
                    context.decode([0] * n, chunk, positions, wanted, out if final else None)
                else:
                    context.decode([0] * n, chunk, positions, np.ones(n, dtype=np.int8), out[start : start + n])
                self.length += n
        except RuntimeError:
            self.length = start_length
            llc.llama_memory_seq_rm(context.memory, 0, start_length, -1)
            raise
        return out

    def rewind(self, length: int) -> None:
        if length != self.length:
            if not llc.llama_memory_seq_rm(self.context.memory, 0, length, -1):
                raise RuntimeError(f"llama.cpp refused to remove positions >= {length} from {self.weights.path!r}")
            self.length = length


class LlamaCppWeights:
    """A GGUF file's weights loaded by llama.cpp (mmapped once), the settings its contexts share, and a few closed
    sequences' contexts kept for reuse."""

    def __init__(self, path: str, vocab_size: int, n_threads: int | None = None, n_gpu_layers: int = 0,
                 device: str = "cpu", flash_attn: bool | None = None, k_q8_ok: bool = True,
                 use_mmap: bool = True, repack: bool = True) -> None:
        """vocab_size: the GGUF metadata's (every logits row must have that many entries). k_q8_ok: the model's
        heads allow a Q8_0 K cache (32-value blocks divide every head width). Other arguments as load_llamacpp."""
        self.path, self.vocab_size, self.device = path, vocab_size, device
        self.n_threads = n_threads or physical_cores()
        kind = device.split(":")[0].lower()
        init_llama()
        info = device_info(device) if kind in GPU_DEVICES and kind != "gpu" else None
        self.n_gpu_layers = gpu_layers_for(device, n_gpu_layers, info)
        self.device_description = info.summary() if info is not None else None
        self.flash_attn = flash_attn
        # On the CPU, a Q8_0 K cache (which needs flash attention) keeps attention batch-invariant (NUMERICS).
        self.k_q8 = device.lower() == "cpu" and flash_attn is not False and k_q8_ok
        if self.k_q8:
            self.flash_attn = True
        if flash_attn is None and info is not None and info.vulkan_device_type == "cpu":
            # Mesa 22.3's lavapipe (Debian bookworm) crashes in its worker threads running ggml's Vulkan flash
            # attention shader: 5 of 6 runs of a tiny Q8_0 model segfaulted with it, 0 of 6 without.
            self.flash_attn = False
        self._free_contexts: list[Context] = []
        params = llc.llama_model_default_params()
        params.n_gpu_layers = self.n_gpu_layers
        params.use_mmap = use_mmap
        params.use_extra_bufts = repack
        recent_errors.clear()
        with captured_log() as lines:
            model = llc.llama_model_load_from_file(path.encode(), params)
        if not model:
            raise ValueError(f"llama.cpp could not load {path!r}: " + (" | ".join(recent_errors) or "no reason given"))
        self.model = model
        # Whether some weights live in the repacked layout, as llama.cpp reports when it allocates them.
        self.repacked = any(REPACKED_BUFFER in line for line in lines)
        n_vocab = llc.llama_vocab_n_tokens(llc.llama_model_get_vocab(model))
        if n_vocab != vocab_size:
            raise ValueError(f"{path!r}: llama.cpp sees {n_vocab} tokens, the GGUF metadata {vocab_size}")

    def context(self, capacity: int, n_batch: int) -> Context:
        """An empty context of `capacity` tokens, from the closed ones where one fits."""
        if self.model is None:
            raise RuntimeError(f"model {self.path!r} is closed")
        for i, context in enumerate(self._free_contexts):
            if context.key == (capacity, n_batch):
                del self._free_contexts[i]
                return context
        return Context(self, capacity, n_batch)

    def release(self, context: Context) -> None:
        if self.model is None or len(self._free_contexts) >= MAX_FREE_CONTEXTS:
            context.free()
            return
        context.clear()
        self._free_contexts.append(context)

    def close(self) -> None:
        """Free the cached contexts and the weights; sequences still open must be closed first."""
        for context in self._free_contexts:
            context.free()
        self._free_contexts.clear()
        if self.model is not None:
            llc.llama_model_free(self.model)
            self.model = None
