"""Many sequences in one llama.cpp context: the batched forward of the llama.cpp backend (and of its worker), without
torch. Its rows keep llama.cpp's kernels apart as llamacpp_core's KERNELS says; this module adds the slots, the
rewinds and prefix copies between them, the KV layout, and the hidden states a head draft reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Sequence as Seq

import llama_cpp.llama_cpp as llc
import numpy as np

from tandem.backends.llamacpp_core import (
    GEMV_ROWS,
    PREFILL_ALIGN,
    Allocator,
    Context,
    LlamaCppWeights,
    ReusedRows,
    argmax_rows,
    new_rows,
    top_probability,
)
from tandem.backends.llamacpp_runtime import output_hidden, read_hidden

HIDDEN_KEPT = 64  # a head's target: hidden states kept per sequence, the newest positions (BatchedForward.hidden)


def kv_streams(device: str) -> bool:
    """Whether a batched context keeps a KV stream per sequence (batch-invariant attention, but a call with
    unequal rows per sequence takes several passes over the weights: BatchedForward) rather than one unified
    cache: on the CPU, the one device whose kernels tandem keeps batch-invariant."""
    return device.split(":")[0].lower() == "cpu"


class BatchedForward:
    """`slots` sequences in one llama_context (n_seq_max = slots), every token tagged with its sequence id (= its
    slot). Rewinding is llama_memory_seq_rm on that sequence; a prefix is copied between sequences with
    llama_memory_seq_cp. Rows go in as few llama_decode calls as the kernels allow (see KERNELS): with repacked
    weights, a prompt entry's rows in calls of their own and the other rows GEMV_ROWS a call.

    KV layout (kv_streams): on the CPU each sequence has a KV stream of its own, its keys in position order as in a
    context of its own and attention reading only its stream, so that its logits do not depend on the batch. But
    llama.cpp splits a call over several streams into ubatches of equally many rows per sequence, each a pass over
    the weights (a verify of 3, 1, 3 and 2 rows takes four: docs/decisions/0007). GPU kernels are not batch-invariant
    anyway, so there the sequences share one unified cache (masked attention over every sequence's cells) and a call is
    one pass, as a lone sequence's is."""

    def __init__(self, weights: LlamaCppWeights, slots: int, capacity: int, n_batch: int, exact: bool) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.weights, self.slots, self.capacity = weights, slots, capacity
        self.context = Context(weights, capacity, n_batch, n_seq=slots, unified=not kv_streams(weights.device))
        self.split = exact and weights.repacked  # keep prompt rows and other rows on their own kernels
        self.prefill_align = PREFILL_ALIGN if self.split else 1
        self.lengths = [0] * slots
        # per slot: positions [0, n) computed as prompt rows by the GEMM (see reusable)
        self._gemm_end = [0] * slots
        self.hidden_width = 0  # > 0: the hidden state of each read row is kept (keep_hidden)
        # an EAGLE-3 drafter's take_in(seq_ids, positions, tokens), run after every decode (llamacpp_head)
        self.on_rows: Callable[[list[int], list[int], list[int]], None] | None = None
        self._hidden: list[dict[int, np.ndarray]] = [{} for _ in range(slots)]

    def keep_hidden(self, width: int) -> None:
        """From now on keep the hidden state (the target's post-norm one, `width` values) of every row a forward
        reads, by slot and position, for a head draft (llamacpp_head). Costs the last layer its rows' skipping: a
        prompt's every row goes through it."""

        output_hidden(self.context.ctx)
        self.hidden_width = width

    def hidden(self, slot: int, position: int) -> np.ndarray | None:
        """The hidden state [width] kept at that position of slot (None where its row was not read, or it is gone)."""
        return self._hidden[slot].get(position)

    def _keep_rows(self, seq_ids: list[int], positions: list[int], wanted: list[bool]) -> None:

        rows = read_hidden(self.context.ctx, len(seq_ids), self.hidden_width)
        for r, (slot, position, read) in enumerate(zip(seq_ids, positions, wanted, strict=True)):
            if read:
                kept = self._hidden[slot]
                kept[position] = rows[r].copy()
                kept.pop(position - HIDDEN_KEPT, None)

    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool],
                allocate: Allocator | None = new_rows, alongside: Callable[[], None] | None = None
                ) -> list[np.ndarray]:
        """Each entry's logits ([T, vocab], or [1, vocab] where last_only: a prompt chunk), in entry order; the
        caller checked the batch. One array from `allocate` holds them all; allocate=None reads none (and returns
        none): the rows are computed, and on a GPU maybe not yet when this returns. alongside runs once the last
        llama_decode is launched, before its rows are read (Context.decode's before_read)."""
        vocab, n_batch = self.weights.vocab_size, self.context.n_batch
        counts = [1 if last else len(tokens) for (_, tokens), last in zip(batch, last_only, strict=True)]
        offsets = [0, *itertools.accumulate(counts)]
        # calls: lists of (entry index, first token, end) row ranges; mixed rows go in together unless split
        calls: list[list[tuple[int, int, int]]] = []
        rows_per_call = GEMV_ROWS if self.split else n_batch
        pending, room = [], rows_per_call
        for i, ((_, tokens), last) in enumerate(zip(batch, last_only, strict=True)):
            if last and self.split:
                calls += [[(i, s, min(s + n_batch, len(tokens)))] for s in range(0, len(tokens), n_batch)]
                continue
            start = 0
            while start < len(tokens):
                take = min(room, len(tokens) - start)
                pending.append((i, start, start + take))
                start, room = start + take, room - take
                if room == 0:
                    calls.append(pending)
                    pending, room = [], rows_per_call
        if pending:
            calls.append(pending)
        # rows read before the next forward, all from one decode: read where llama.cpp put them (see ReusedRows)
        in_place = isinstance(allocate, ReusedRows) and len(calls) == 1
        out = allocate(offsets[-1], vocab) if allocate is not None and not in_place else None
        try:
            for call in calls:
                seq_ids, tokens, positions, wanted, targets = [], [], [], [], []
                for i, begin, end in call:
                    slot, entry = batch[i]
                    n, at = len(entry), self.lengths[slot]
                    seq_ids += [slot] * (end - begin)
                    tokens += entry[begin:end]
                    positions += range(at + begin, at + end)
                    if last_only[i]:
                        wanted += [False] * (end - begin - 1) + [end == n and allocate is not None]
                        targets += [offsets[i]] if end == n else []
                    else:
                        wanted += [True] * (end - begin)
                        targets += range(offsets[i] + begin, offsets[i] + end)
                rows = out[targets[0] : targets[-1] + 1] if targets and out is not None else None
                scratch = rows is not None and len(rows) != len(targets)  # rows not contiguous in out
                if scratch:
                    rows = new_rows(len(targets), vocab)
                self.context.decode(seq_ids, tokens, positions, wanted, rows,
                                    alongside if call is calls[-1] else None)
                if self.hidden_width:
                    self._keep_rows(seq_ids, positions, wanted)
                if self.on_rows is not None:
                    self.on_rows(seq_ids, positions, tokens)
                if scratch:
                    out[targets] = rows
            if in_place:
                out = self.context.last_logits(offsets[-1])
        except RuntimeError:
            for slot, _ in batch:  # forget whatever part of this forward went in
                llc.llama_memory_seq_rm(self.context.memory, slot, self.lengths[slot], -1)
            raise
        for (slot, tokens), last in zip(batch, last_only, strict=True):
            start = self.lengths[slot]
            if last and self.split and start == self._gemm_end[slot] and start % PREFILL_ALIGN == 0:
                self._gemm_end[slot] = start + len(tokens) - len(tokens) % PREFILL_ALIGN
            self.lengths[slot] += len(tokens)
        return [] if out is None else [out[offsets[i] : offsets[i + 1]] for i in range(len(batch))]

    def feed(self, batch: Seq[tuple[int, Seq[int]]]) -> None:
        """Take in each entry's tokens, reading nothing back: on a GPU this returns before the device has run it
        (a draft's last draft fed beside the target's verify: see BatchedCache.forward_picking's alongside). Every
        row is computed as a draft step's, the shape the draft's forwards keep."""
        self.forward(batch, [False] * len(batch), None)

    def synchronize(self) -> None:
        self.context.synchronize()

    def greedy_drafts(self, feeds: Seq[Seq[tuple[int, Seq[int]]]], counts: Seq[int], vocab_limit: int,
                      steady: bool, floors: Seq[float] | None = None) -> tuple[list[list[int]], int]:
        """A draft step's greedy drafts in one call, next to the model (Drafter.draft's loop, no logits leaving
        it): the forwards of `feeds` (a catch-up; each entry's last row read), then each slot of feeds[-1] fed its
        argmax over the first vocab_limit ids, a row a forward, until it has counts[i] drafts or the softmax gave
        its latest less than floors[i]. steady: slots done go on drafting, unread, while each has room, so every
        forward has one row per slot. Returns the drafts per entry of feeds[-1] and the forwards run; the caller
        checked the room."""
        reused = ReusedRows()  # each forward's rows are read before the next
        for feed in feeds[:-1]:
            self.forward(feed, [True] * len(feed), reused)
        slots = [slot for slot, _ in feeds[-1]]
        logits = self.forward(feeds[-1], [True] * len(slots), reused)
        drawn: list[list[int]] = [[] for _ in slots]
        active, forwards = list(range(len(slots))), len(feeds)
        unsure: set[int] = set()
        while True:
            for i, rows in zip(active, logits, strict=False):  # fed = active + done: its first rows are active's
                row = rows[-1, :vocab_limit]
                drawn[i].append(int(argmax_rows(row)))
                if floors and floors[i] > 0 and top_probability(row) < floors[i]:
                    unsure.add(i)
            active = [i for i in active if len(drawn[i]) < counts[i] and i not in unsure]
            if not active:
                return drawn, forwards
            done = [i for i in range(len(slots)) if i not in active]
            fed = active + done if steady and all(self.lengths[slots[i]] < self.capacity for i in done) else active
            logits = self.forward([(slots[i], drawn[i][-1:]) for i in fed], [True] * len(fed), reused)
            forwards += 1

    def reusable(self, slot: int, length: int) -> int:
        """How much of the first `length` positions of slot a new prompt may keep: all of them, or with repacked
        weights the aligned part of the prompt rows computed by the GEMM (a fresh prompt would compute them so)."""
        if not self.split:
            return length
        usable = min(length, self._gemm_end[slot])
        return usable - usable % PREFILL_ALIGN

    def settle(self, slot: int, tokens: Seq[int], rows: int) -> int:
        """Recompute up to `rows` (a multiple of PREFILL_ALIGN) of slot's positions past what a new prompt may keep
        as prompt rows, unread, so that a prompt sharing them keeps them: a finished reply's rows came from the
        GEMV, a fresh prompt computes them by the GEMM (KERNELS in llamacpp_core). tokens: the ids at positions 0..
        (the slot holds the first lengths[slot]; it is fed the rest too). Returns the positions of tokens still to
        recompute (0 when no whole group of PREFILL_ALIGN is left). A head's target (hidden states, on_rows) is left
        alone."""
        if not self.split or self.hidden_width or self.on_rows is not None:
            return 0
        start, n = self.reusable(slot, self.lengths[slot]), min(len(tokens), self.capacity)
        end = min(n, start + rows)
        if end - start < PREFILL_ALIGN:
            return 0
        self.rewind(slot, start)
        self.forward([(slot, list(tokens[start:end]))], [True], None)
        left = n - self.reusable(slot, end)
        return left if left >= PREFILL_ALIGN else 0

    def rewind(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot rewind slot {slot} to {length}: it holds {self.lengths[slot]} tokens")
        if length < self.lengths[slot]:
            if not llc.llama_memory_seq_rm(self.context.memory, slot, length, -1):
                raise RuntimeError(f"llama.cpp refused to remove positions >= {length} of sequence {slot}")
            self.lengths[slot] = length
            self._gemm_end[slot] = min(self._gemm_end[slot], length)
            for position in [p for p in self._hidden[slot] if p >= length]:
                del self._hidden[slot][position]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        if not 0 <= length <= self.lengths[src]:
            raise ValueError(f"cannot copy {length} positions: slot {src} holds {self.lengths[src]}")
        if src != dst:
            memory = self.context.memory
            # Between KV streams llama.cpp copies only a whole sequence; then the tail goes.
            llc.llama_memory_seq_rm(memory, dst, -1, -1)
            llc.llama_memory_seq_cp(memory, src, dst, -1, -1)
            llc.llama_memory_seq_rm(memory, dst, length, -1)
            self._gemm_end[dst] = min(self._gemm_end[src], length)
            self._hidden[dst] = {p: h for p, h in self._hidden[src].items() if p < length}
        self.lengths[dst] = length

    def close(self) -> None:
        self.context.free()
