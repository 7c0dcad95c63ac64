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
ties. tandem therefore turns the tiled matmul off (GGML_CPU_TILED_MM=0, read once per process) and keeps the
repacked weights' two kernels apart: prompt rows take the 4-row GEMM, every other row the GEMV a one-token step
takes, in calls of at most 3 rows (KERNELS in llamacpp_core). A plain step, a 9-row verify and a batch of
sequences then give a token bit-identical logits (tests/test_llamacpp_backend.py). Attention needs one more step: with
an F16 KV cache, llama.cpp's CPU flash attention splits a single query's keys across threads once the padded KV
span reaches 512 (contexts past 256 tokens) but not a batch's, so logits drifted by up to 3.6 after 300 tokens; a
Q8_0 K cache takes the same unsplit kernel for 1 and n queries (exact at 100, 300 and 520 tokens, same speed),
so the CPU default is a Q8_0 K cache with flash attention. V stays F16: that kernel reads V per query row either
way, and a Q8_0 V costs its dequantising (docs/decisions/0007). Set GGML_CPU_TILED_MM=1 for a faster prefill
where exact greedy identity does not matter. GPU builds
(Vulkan, CUDA, Metal) pick matrix-vector kernels for small batches and are not batch-invariant: measure there.

Tokenization is tandem's own `Tokenizer` read from the GGUF metadata, never llama.cpp's, so this backend and the torch
backend turn text into the same ids; the `ModelConfig` comes from the same metadata (no weights are dequantised).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Literal

import torch

from tandem.backends.base import Alongside, BatchedCache, Model, Sequence
from tandem.backends.llamacpp_batched import BatchedForward
from tandem.backends.llamacpp_core import (
    LlamaCppWeights,
    ReusedRows,
    SequenceForward,
    argmax_rows,
    new_rows,
)
from tandem.backends.llamacpp_settings import (
    DEFAULT_N_BATCH,
    DEFAULT_N_CTX,
    DRAFT_N_BATCH,
    k_q8_ok,
    kv_bytes_per_token,
    launches_asynchronously,
    steady_shapes,
)
from tandem.loading.gguf import open_gguf
from tandem.loading.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tandem.config import ModelConfig

class LlamaCppSequence(Sequence):
    """One llama.cpp context = one KV cache of `capacity` tokens."""

    def __init__(self, model: LlamaCppModel, rows: SequenceForward) -> None:
        self.model = model
        self.capacity = rows.capacity
        self._rows: SequenceForward | None = rows

    @property
    def length(self) -> int:
        return self._live().length

    def forward(self, tokens: Seq[int] | torch.Tensor, logits: Literal["all", "last"] = "all") -> torch.Tensor:
        """Feed T tokens at positions length..length+T-1.

        Args:
            tokens: T token ids.
            logits: "all" returns [T, vocab]; "last" returns only the last row, [1, vocab]: a prompt (llama.cpp then
                computes the output layer for one row instead of T, long inputs go in chunks of n_batch, and
                repacked weights take their prompt kernel: KERNELS in llamacpp_core).
        Returns:
            float32 logits, a copy owned by the caller.
        """
        rows = self._live()
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        self._check_room(len(ids))
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        if not ids:
            return torch.empty((0, self.model.vocab_size), dtype=torch.float32)
        return torch.from_numpy(rows.forward(ids, last=logits == "last"))

    def rewind(self, length: int) -> None:
        rows = self._live()
        self._check_rewind(length)
        rows.rewind(length)

    def close(self) -> None:
        if self._rows is not None:
            self.model.weights.release(self._rows.context)
            self._rows = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the module globals may be gone
            pass

    def _live(self) -> SequenceForward:
        if self._rows is None:
            raise RuntimeError("this sequence is closed")
        return self._rows


class LlamaCppBatchedCache(BatchedCache):
    """`slots` sequences in one llama_context, one KV stream each (llamacpp_core.BatchedForward): a forward feeds
    every sequence's rows in as few llama_decode calls as keep each row on its kernel; a prefix is copied between
    sequences with llama_memory_seq_cp."""

    can_copy = True
    drafts_greedy = True

    def __init__(self, model: LlamaCppModel, slots: int, capacity: int, n_batch: int, exact: bool = True) -> None:
        self.model, self.slots, self.capacity = model, slots, capacity
        self._rows: BatchedForward | None = BatchedForward(model.weights, slots, capacity, n_batch, exact)
        self._picked = ReusedRows()  # the rows of a forward whose every entry is read as its argmax
        self.prefill_align = self._rows.prefill_align

    def length(self, slot: int) -> int:
        return self._rows.lengths[slot]

    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        return self.forward_picking(batch, last_only, [False] * len(batch))

    def forward_picking(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool], picks: Seq[bool],
                        alongside: Alongside | None = None) -> list[torch.Tensor]:
        self._check(batch)
        beside = None
        if alongside is not None:
            other, feed = alongside
            other._check(feed)
            if self.overlaps(other):
                beside = functools.partial(other._rows.feed, feed)
        every = all(picks)  # then every row is read here, before the next forward (ReusedRows)
        rows = self._rows.forward(batch, last_only, self._picked if every else new_rows, alongside=beside)
        if alongside is not None and beside is None:
            other.feed(feed)
        return [torch.from_numpy(argmax_rows(r) if pick else r) for r, pick in zip(rows, picks, strict=True)]

    def feed(self, batch: Seq[tuple[int, Seq[int]]]) -> None:
        self._check(batch)
        self._rows.feed(batch)

    def overlaps(self, other: BatchedCache) -> bool:
        return isinstance(other, LlamaCppBatchedCache) and launches_asynchronously(self.model.device) and \
            launches_asynchronously(other.model.device)

    def synchronize(self) -> None:
        self._rows.synchronize()

    def greedy_drafts(self, feeds: Seq[Seq[tuple[int, Seq[int]]]], counts: Seq[int], vocab_limit: int,
                      steady: bool, floors: Seq[float] | None = None) -> tuple[list[list[int]], int]:
        self._check_feeds(feeds)
        return self._rows.greedy_drafts(feeds, counts, vocab_limit, steady, floors)

    def rewind(self, slot: int, length: int) -> None:
        self._rows.rewind(slot, length)

    def reusable(self, slot: int, length: int) -> int:
        return self._rows.reusable(slot, length)

    def settle(self, slot: int, tokens: Seq[int], rows: int) -> int:
        return self._rows.settle(slot, tokens, rows)

    def copy_prefix(self, src: int, dst: int, length: int) -> bool:
        self._rows.copy_prefix(src, dst, length)
        return True

    def attach_head(self, head: Model) -> LlamaCppHeadCache:
        if not isinstance(head, LlamaCppModel):
            raise ValueError(f"a head draft on llama.cpp must be loaded by llama.cpp too, got {head!r}")
        return LlamaCppHeadCache(head, self)

    def close(self) -> None:
        if self._rows is not None:
            self._rows.close()
            self._rows = None


class LlamaCppHeadCache(BatchedCache):
    """A head draft over a target's batched cache (llamacpp_head.HeadDrafts): it holds no KV (it reads the
    target's), so its length is the target's and nothing rewinds; a forward drafts from each entry's last token only
    (the rest is in the target's KV)."""

    def __init__(self, head: LlamaCppModel, target: LlamaCppBatchedCache) -> None:
        from tandem.backends.llamacpp_head import drafts_for

        self.model, self.target = head, target
        self.slots, self.capacity = target.slots, target.capacity
        self._drafts = drafts_for(head.config, head.weights, target._rows)

    def length(self, slot: int) -> int:
        return self.target.length(slot)

    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        self._check(batch)
        logits = self._drafts.step([(slot, tokens[-1]) for slot, tokens in batch])
        return [torch.from_numpy(logits[i : i + 1]) for i in range(len(batch))]

    def rewind(self, slot: int, length: int) -> None:
        self._drafts.forget(slot, length)  # a new sequence in slot: the target rewinds itself

    def close(self) -> None:
        if self._drafts is not None:
            self._drafts.close()
            self._drafts = None


class LlamaCppModel(Model):
    """A GGUF file loaded by llama.cpp: weights once, one context per sequence."""

    backend = "llama.cpp"
    isolation = "none"  # llama.cpp runs in this process (a draft given by path loads here too)

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
        repack: bool = True,
    ) -> None:
        """Args:
        path: the GGUF file.
        n_ctx: default capacity of new sequences.
        n_threads: threads per decode (default: every physical core; a draft may be given its own count).
        n_gpu_layers: layers to offload to a GPU build's device (-1 or 99 = all); device="vulkan"/"metal"/"cuda"
            offloads all of them.
        n_batch: most tokens per llama_decode call (also the prefill chunk); DRAFT_N_BATCH suits a draft.
        flash_attn: None lets llama.cpp decide.
        repack: let llama.cpp's CPU backend repack quantised weights into its interleaved layouts (faster GEMV
            and GEMM; exact all the same: KERNELS in llamacpp_core).
        """
        self.path = os.fspath(path)
        # Before llama.cpp sees the path: a GGUFError (a ValueError) names it when the file is missing or bad, and
        # when its data section does not match its header (llama.cpp itself loads a file whose tensor count is
        # short, every tensor read from the wrong bytes).
        gguf = open_gguf(self.path)
        self.config: ModelConfig = gguf.config
        self.tokenizer: Tokenizer = Tokenizer.from_gguf(gguf)
        self.device = device
        self.steady_shapes = steady_shapes(device)
        # None (what tandem.load passes when no context is asked for) means the default, as in the torch backend.
        self.n_ctx = n_ctx if n_ctx is not None else min(DEFAULT_N_CTX, self.config.context_length)
        self.n_batch = n_batch
        self.weights = LlamaCppWeights(self.path, self.config.vocab_size, n_threads, n_gpu_layers, device, flash_attn,
                                       k_q8_ok(self.config), use_mmap, repack)

    @property
    def n_threads(self) -> int:
        return self.weights.n_threads

    @property
    def n_gpu_layers(self) -> int:  # what llama.cpp offloads: -1 = every layer
        return self.weights.n_gpu_layers

    @property
    def k_q8(self) -> bool:
        return self.weights.k_q8

    @k_q8.setter
    def k_q8(self, value: bool) -> None:  # tests: the cache llama.cpp would pick itself
        self.weights.k_q8 = value

    @property
    def device_description(self) -> str | None:
        """llama.cpp's line for the GPU device the layers went to (None on the CPU)."""
        return self.weights.device_description

    @property
    def _model(self):
        return self.weights.model

    def new_sequence(self, n_ctx: int | None = None, drafting: bool = False,
                     n_batch: int | None = None) -> LlamaCppSequence:
        """Open an empty KV cache of n_ctx tokens (default self.n_ctx). n_batch defaults to the model's, or to
        DRAFT_N_BATCH for a draft's sequence: its compute buffers are sized for k-token steps, not prompts."""
        capacity = n_ctx or self.n_ctx
        n_batch = min(n_batch or (DRAFT_N_BATCH if drafting else self.n_batch), capacity)
        rows = SequenceForward(self.weights, self.weights.context(capacity, n_batch), capacity, exact=not drafting)
        return LlamaCppSequence(self, rows)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.config, self.k_q8)

    def new_batched_cache(self, slots: int, n_ctx: int | None = None, drafting: bool = False) -> LlamaCppBatchedCache:
        if self.weights.model is None:
            raise RuntimeError(f"model {self.path!r} is closed")
        return LlamaCppBatchedCache(self, slots, n_ctx or self.n_ctx, self.n_batch, exact=not drafting)

    def close(self) -> None:
        """Free the cached contexts and the weights; sequences still open must be closed first."""
        self.weights.close()

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
    repack: bool = True,
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
        repack: llama.cpp's repacked CPU weight layouts (see LlamaCppModel).
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
