"""A head draft on llama.cpp (the Gemma 4 assistant), without torch: its context over the target's, and the
hidden-state hand-off (docs/decisions/0004-head-drafts.md).

llama.cpp's MTP driver (`common_speculative_impl_draft_mtp` in common/speculative.cpp) does this inside
llama-server; here tandem's own loop drives the same calls, so verification, batching and the policy stay tandem's:
- the target's context outputs its post-norm hidden state for every row it computes (`llama_set_embeddings_nextn`
  unmasked), read after each llama_decode (`llama_get_embeddings_nextn`, dense, in batch order);
- the head's context is of type MTP with `ctx_other` = the target's context: it has no KV of its own and attends
  over the target's cells (its sliding blocks over the target's last sliding layer, its full blocks over the last
  layer), so it needs no catch-up and no rewinding;
- a draft step feeds each sequence's newest token with a hidden state (the target's at the position before it, or
  the head's own from the step before) as the token's embedding row (`llama_batch_ext_set_embd_token`; in
  llama.cpp 0.3.36 `llama_batch_ext_set_embd_state` is a stub that returns false), at the token's position: every
  draft of a round at the same position, as llama.cpp's driver feeds the Gemma 4 assistant.
The staging functions (src/llama-ext.h) are C++ symbols that llama-cpp-python does not bind; libllama exports them,
and they are bound here by their mangled names.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence as Seq

import llama_cpp.llama_cpp as llc
import numpy as np

from tandem.backends.llamacpp_batched import HIDDEN_KEPT, BatchedForward
from tandem.backends.llamacpp_core import Allocator, LlamaCppWeights, new_rows
from tandem.backends.llamacpp_runtime import recent_errors, staging


class HeadForward:
    """The head's llama_context over a target context: one step feeds a row per sequence, (token, position, hidden
    state), and returns each row's logits and next hidden state."""

    def __init__(self, head_model, target_ctx, n_ctx: int, n_seq: int, unified: bool, n_threads: int,
                 vocab_size: int, hidden_width: int, path: str) -> None:
        """head_model: the head's llama_model; target_ctx: the context whose KV it reads (its n_ctx per sequence,
        n_seq sequences and KV layout, as the head's context must mirror them)."""
        params = llc.llama_context_default_params()
        params.n_ctx = n_ctx * n_seq
        params.n_batch = params.n_ubatch = max(n_seq, 8)
        params.n_seq_max = n_seq
        params.kv_unified = unified
        params.swa_full = True  # as the target's (llamacpp_core.Context)
        params.n_threads = params.n_threads_batch = n_threads
        params.no_perf = True
        params.ctx_type = llc.LLAMA_CONTEXT_TYPE_MTP
        params.ctx_other = target_ctx
        ctx = llc.llama_init_from_model(head_model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create the head's context for {path!r}: "
                               + " | ".join(recent_errors))
        self.ctx, self.path = ctx, path
        self.vocab_size, self.hidden_width, self.n_batch = vocab_size, hidden_width, params.n_batch
        staging("set_embeddings_nextn")(ctx, True, True)  # its next hidden state, for the rows it outputs
        self._get_hidden_ith = staging("get_embeddings_nextn_ith")
        self.batch = llc.llama_batch_ext_init(ctx)
        self._position = (ctypes.c_int32 * 1)()

    def step(self, rows: Seq[tuple[int, int, int, np.ndarray]], allocate: Allocator = new_rows
             ) -> tuple[np.ndarray, np.ndarray]:
        """rows: (sequence id, token, position, hidden state [hidden_width] float32), at most n_batch. Returns the
        logits [n, vocab] (from allocate) and the next hidden states [n, hidden_width] (a copy)."""
        llc.llama_batch_ext_clear(self.batch)
        keep = []  # the hidden rows must outlive the call
        for seq, token, position, hidden in rows:
            idx = llc.llama_batch_ext_add_token(self.batch, seq, token)
            if idx < 0:
                raise RuntimeError(f"the head's batch refused token {token} of sequence {seq} ({idx})")
            self._position[0] = position
            llc.llama_batch_ext_set_pos(self.batch, idx, self._position)
            state = np.ascontiguousarray(hidden, dtype=np.float32)
            keep.append(state)
            embd = llc.llama_embd(state.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.hidden_width)
            if not llc.llama_batch_ext_set_embd_token(self.batch, idx, embd):
                raise RuntimeError(f"llama.cpp refused a hidden state of {self.hidden_width} values for the head "
                                   f"{self.path!r}")
            llc.llama_batch_ext_set_output_logits(self.batch, idx, True)
        rc = llc.llama_process(self.ctx, llc.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        if rc != 0:
            raise RuntimeError(f"the head's decode failed with {rc} ({self.path!r}): " + " | ".join(recent_errors))
        n = len(rows)
        logits = allocate(n, self.vocab_size)
        ctypes.memmove(logits.ctypes.data, llc.llama_get_logits(self.ctx), logits.nbytes)
        hidden = np.empty((n, self.hidden_width), dtype=np.float32)
        for i in range(n):
            ctypes.memmove(hidden[i].ctypes.data, self._get_hidden_ith(self.ctx, i), hidden[i].nbytes)
        return logits, hidden

    def free(self) -> None:
        if self.ctx:
            llc.llama_batch_ext_free(self.batch)
            llc.llama_free(self.ctx)
            self.ctx = None


class HeadDrafts:
    """A head draft over a target's BatchedForward: a draft step per call, for the engine's draft loop (the
    backend's head cache in this process, or the worker's). The head holds no KV, so a step feeds each slot's
    newest token at the target's next position: the round's first with the target's hidden state at the position
    before, the next ones with the head's own from the step before (a round is known by the target's length, which
    grows between two)."""

    def __init__(self, head: LlamaCppWeights, target: BatchedForward, width: int) -> None:
        """head: the head's weights; width: the target hidden width it reads (its embedding_length_out)."""
        target.keep_hidden(width)
        self.target, self.width = target, width
        self.head = HeadForward(head.model, target.context.ctx, target.capacity, target.slots, target.context.unified,
                                head.n_threads, head.vocab_size, width, head.path)
        self._round: dict[int, tuple[int, np.ndarray]] = {}  # slot -> (target length, the head's hidden state)

    def step(self, entries: Seq[tuple[int, int]], allocate: Allocator = new_rows) -> np.ndarray:
        """entries: (slot, its newest token). The logits [n, vocab] of each entry's next token."""
        rows = []
        for slot, token in entries:
            position = self.target.lengths[slot]
            kept = self._round.get(slot)
            if kept is not None and kept[0] == position:
                hidden = kept[1]
            else:  # a round's first draft; a zero state where the target's row was never read (a copied prefix)
                hidden = self.target.hidden(slot, position - 1)
                hidden = hidden if hidden is not None else np.zeros(self.width, dtype=np.float32)
            rows.append((slot, int(token), position, hidden))
        logits, hidden = self.head.step(rows, allocate)
        for i, (slot, _, position, _) in enumerate(rows):
            self._round[slot] = (position, hidden[i])
        return logits

    def forget(self, slot: int, length: int) -> None:
        """A new round for slot whatever the target's length (a new sequence in it)."""
        self._round.pop(slot, None)

    def close(self) -> None:
        self.head.free()


def _view(pointer, rows: int, width: int) -> np.ndarray:
    address = ctypes.cast(pointer, ctypes.c_void_p).value
    return np.frombuffer((ctypes.c_float * (rows * width)).from_address(address), np.float32).reshape(rows, width)


class Eagle3Drafts:
    """An EAGLE-3 drafter (llama.cpp's `eagle3`, driven as `common_speculative_impl_draft_eagle3` does) over a
    target's BatchedForward. Unlike the Gemma 4 assistant it keeps a KV of its own, a position P holding the pair
    (token P + 1, g P), where g is its encoder's fusion of three target layers' inputs at P. So after every target
    decode (the target's `on_rows` hook) it encodes the new rows' features and writes every pair whose next token
    that decode knew; the last row's pair waits for the next token (the pending one, fed by a draft round's first
    step, or the next decode's first row). A draft step then feeds (token, state) at the next position: the first
    with g at the position before the pending token, the next ones with its own pre-norm output."""

    def __init__(self, head: LlamaCppWeights, target: BatchedForward, layers: Seq[int], target_width: int,
                 width: int) -> None:
        self.target, self.layers, self.target_width, self.width = target, list(layers), target_width, width
        set_layer = staging("set_embeddings_layer_inp")
        for layer in self.layers:
            set_layer(target.context.ctx, layer, True)
        params = llc.llama_context_default_params()
        params.n_ctx = target.capacity * target.slots
        params.n_batch = params.n_ubatch = target.context.n_batch
        params.n_seq_max = target.slots
        params.kv_unified = target.context.unified
        params.n_threads = params.n_threads_batch = head.n_threads
        params.no_perf = True
        params.ctx_other = target.context.ctx
        self.ctx = llc.llama_init_from_model(head.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create the EAGLE-3 context for {head.path!r}: "
                               + " | ".join(recent_errors))
        self.path, self.vocab_size, self.n_batch = head.path, head.vocab_size, params.n_batch
        staging("set_embeddings_nextn")(self.ctx, True, True)  # g from the encoder, the pre-norm state from decodes
        self._get_state = staging("get_embeddings_nextn")
        self._get_state_ith = staging("get_embeddings_nextn_ith")
        self._get_layer = staging("get_embeddings_layer_inp")
        self.memory = llc.llama_get_memory(self.ctx)
        self.batch = llc.llama_batch_ext_init(self.ctx)
        self._position = (ctypes.c_int32 * 1)()
        self._g: list[dict[int, np.ndarray]] = [{} for _ in range(target.slots)]  # slot -> position -> g
        self._round: dict[int, tuple[int, int, np.ndarray]] = {}  # slot -> (target length, next position, state)
        target.on_rows = self.take_in

    def _add(self, seq: int, token: int | None, position: int, row: np.ndarray, output: bool, keep: list) -> None:
        row = np.ascontiguousarray(row, dtype=np.float32)
        keep.append(row)
        embd = llc.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[-1])
        if token is None:
            idx = llc.llama_batch_ext_add_embd(self.batch, seq, embd)
        else:
            idx = llc.llama_batch_ext_add_token(self.batch, seq, token)
            if idx >= 0 and not llc.llama_batch_ext_set_embd_token(self.batch, idx, embd):
                raise RuntimeError(f"llama.cpp refused a state of {row.shape[-1]} values ({self.path!r})")
        if idx < 0:
            raise RuntimeError(f"the EAGLE-3 batch refused a row of sequence {seq} ({idx})")
        self._position[0] = position
        llc.llama_batch_ext_set_pos(self.batch, idx, self._position)
        llc.llama_batch_ext_set_output_logits(self.batch, idx, output)

    def _process(self, kind: int, what: str) -> None:
        rc = llc.llama_process(self.ctx, kind, self.batch)
        if rc != 0:
            raise RuntimeError(f"EAGLE-3 {what} failed with {rc} ({self.path!r}): " + " | ".join(recent_errors))

    def take_in(self, seq_ids: Seq[int], positions: Seq[int], tokens: Seq[int]) -> None:
        """After a target decode of these rows: their g, and the pairs whose next token they hold."""
        n, ctx = len(seq_ids), self.target.context.ctx
        features = np.concatenate([_view(self._get_layer(ctx, layer), n, self.target_width)
                                   for layer in self.layers], axis=1)  # [n, 3 * target width]
        g = np.empty((n, self.width), dtype=np.float32)
        for start in range(0, n, self.n_batch):  # the encoder ignores positions: placeholders past sequence 0's
            llc.llama_batch_ext_clear(self.batch)
            keep: list = []
            after = llc.llama_memory_seq_pos_max(self.memory, 0) + 1
            for i in range(start, min(n, start + self.n_batch)):
                self._add(0, None, after + i - start, features[i], True, keep)
            self._process(llc.LLAMA_PROCESS_TYPE_ENCODE, "encoding")
            rows = min(n, start + self.n_batch) - start
            g[start : start + rows] = _view(self._get_state(self.ctx), rows, self.width)
        pairs: dict[int, list[tuple[int, int, np.ndarray]]] = {}
        for i, (slot, position, token) in enumerate(zip(seq_ids, positions, tokens, strict=True)):
            self._g[slot][position] = g[i].copy()
            self._g[slot].pop(position - HIDDEN_KEPT, None)
            before = self._g[slot].get(position - 1)
            if before is not None:  # the pair (this token, g before it) at the position before
                pairs.setdefault(slot, []).append((token, position - 1, before))
        llc.llama_batch_ext_clear(self.batch)
        keep = []
        for slot, rows in pairs.items():
            llc.llama_memory_seq_rm(self.memory, slot, rows[0][1], -1)  # rejected drafts' pairs, a round's rows
            if llc.llama_memory_seq_pos_max(self.memory, slot) + 1 != rows[0][1]:
                continue  # a gap (a copied prefix): this sequence's drafts go without the pairs before
            for token, position, state in rows:
                self._add(slot, int(token), position, state, False, keep)
        if keep:
            self._process(llc.LLAMA_PROCESS_TYPE_DECODE, "catching up")

    def step(self, entries: Seq[tuple[int, int]], allocate: Allocator = new_rows) -> np.ndarray:
        """entries: (slot, its newest token). The logits [n, vocab] of each entry's next token."""
        llc.llama_batch_ext_clear(self.batch)
        keep, rows = [], []
        for slot, token in entries:
            length = self.target.lengths[slot]
            kept = self._round.get(slot)
            if kept is not None and kept[0] == length:
                _, position, state = kept
            else:  # a round's first: the pending token's pair, at the position before it
                position = max(0, length - 1)
                llc.llama_memory_seq_rm(self.memory, slot, position, -1)
                state = self._g[slot].get(position)
                state = state if state is not None else np.zeros(self.width, dtype=np.float32)
                # pairs missing before it (a copied prefix): llama.cpp takes a sequence's rows only next to its last
                position = min(position, llc.llama_memory_seq_pos_max(self.memory, slot) + 1)
            self._add(slot, int(token), position, state, True, keep)
            rows.append((slot, length, position))
        self._process(llc.LLAMA_PROCESS_TYPE_DECODE, "drafting")
        logits = allocate(len(rows), self.vocab_size)
        ctypes.memmove(logits.ctypes.data, llc.llama_get_logits(self.ctx), logits.nbytes)
        for i, (slot, length, position) in enumerate(rows):
            state = _view(self._get_state_ith(self.ctx, i), 1, self.width)[0].copy()
            self._round[slot] = (length, position + 1, state)
        return logits

    def forget(self, slot: int, length: int) -> None:
        """A new sequence in slot keeps the target's first `length` positions: the pairs before them stay."""
        self._round.pop(slot, None)
        llc.llama_memory_seq_rm(self.memory, slot, max(0, length - 1), -1)
        for position in [p for p in self._g[slot] if p >= length]:
            del self._g[slot][position]

    def close(self) -> None:
        if self.ctx:
            self.target.on_rows = None
            llc.llama_batch_ext_free(self.batch)
            llc.llama_free(self.ctx)
            self.ctx = None


def drafts_for(config, head: LlamaCppWeights, target: BatchedForward) -> HeadDrafts | Eagle3Drafts:
    """The head's drafting over target by its architecture (config: its ModelConfig)."""
    if config.architecture == "eagle3":
        return Eagle3Drafts(head, target, config.head_target_layers, config.head_input_width, config.d_model)
    return HeadDrafts(head, target, config.head_input_width)

