"""Many sequences on the torch backend: one KV pool, batches as packed CUDA graphs or one ragged forward."""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq

import torch

from tandem.backends.base import BatchedCache, Model
from tandem.backends.torch_graphs import GRAPH_ROWS, PackedGraphs
from tandem.backends.torch_sequence import GRAPH_CHUNKS_MAX, TorchSequence, cache_slots, prefill_chunks, tapped_features


class TorchBatchedCache(BatchedCache):
    """One pool of KV memory, [slots, H_kv, S, D] a layer, each slot a sequence with a static cache of its own.

    On CUDA, for Llama/Qwen-like models (Transformer.packed), every batch, of one sequence or many, replays one of
    PackedGraphs' graphs: tandem's kernels, batch-invariant, so a sequence's output alone and in a batch are the
    same bits. A sequence's rows go in pieces of at most rows_per_sequence() (a 64-token prompt: 8 replays);
    longer prompts run the compiled step on their cache row, one PREFILL_CHUNK at a time. Elsewhere a batch of one
    sequence runs that slot's TorchSequence; several run as one ragged forward (Transformer.forward_ragged). Either
    way the weights are read once for every sequence in the batch. TANDEM_PACKED=0 turns the packed path off.
    TANDEM_BATCH_INVARIANT=0 runs a batch of one sequence as its TorchSequence's StepGraph (compiled, cuBLAS's
    logits) instead: a little faster, but a sequence alone and in a batch may then differ in the last bits of its
    logits (docs/decisions/0007). A cache of one slot (`tandem.generate`'s engine) always runs that way.
    Per-slot static caches rather than paged blocks: positions stay absolute (rewind moves a length, graphs keep
    their shapes), at the price of reserving a whole context a slot (docs/batching.md).
    """

    can_copy = True

    def __init__(self, model: Model, slots: int, capacity: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.model, self.slots, self.capacity = model, slots, capacity
        self.pool = model.transformer.new_cache(cache_slots(capacity), sequences=slots)
        self.packed = None
        self.sequences = []
        self.head = None  # a head draft's drafts over this cache (attach_head): told of every forward's rows
        self.taps: tuple[int, ...] = ()  # the layers whose inputs it reads
        self._tapped: list = []  # a forward's pieces with their tapped features, for the head
        # One slot has no batch to be invariant to: it runs the batch-1 path (StepGraph, cuBLAS), as
        # TANDEM_BATCH_INVARIANT=0 does, and captures no packed graphs.
        if model.transformer.packed and slots > 1 and os.environ.get("TANDEM_PACKED", "1") != "0":
            self.lengths = [0] * slots
            self.packed = PackedGraphs(model, self.pool, slots)
            self.packed.capture_all()
            if os.environ.get("TANDEM_BATCH_INVARIANT", "1") == "0":  # a batch of one: the batch-1 path
                self.sequences = [TorchSequence(model, capacity, GRAPH_ROWS, graphs=model.use_graphs,
                                                cache=self.pool.row(b)) for b in range(slots)]
            elif model.use_graphs:
                model.compile_prompt_forward(self.pool.row(0))
        else:
            self.sequences = [TorchSequence(model, capacity, GRAPH_ROWS, graphs=model.use_graphs,
                                            cache=self.pool.row(b)) for b in range(slots)]

    def length(self, slot: int) -> int:
        return self.lengths[slot] if self.packed is not None else self.sequences[slot].cache.length

    def padded_rows(self, rows: int) -> int:
        return self.packed.padded_rows(rows) if self.packed is not None else rows

    def _forward_packed(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        """Pieces of at most seq_rows rows, in rounds aligned to end together: one-piece entries (decode steps)
        and every entry's last piece run in the last replay, whose logits need no copy. A round of more rows than
        the largest graph holds runs as several replays."""
        packed, results = self.packed, [None] * len(batch)
        short = []
        for i, ((slot, tokens), last) in enumerate(zip(batch, last_only, strict=True)):
            if len(tokens) > GRAPH_CHUNKS_MAX:  # a long prompt: the compiled step on its cache row
                results[i] = self._prefill(slot, tokens, last)
            else:
                short.append(i)
        pieces = {i: -(-len(batch[i][1]) // packed.seq_rows) for i in short}
        rounds = max(pieces.values(), default=0)
        parts: dict[int, list[torch.Tensor]] = {i: [] for i in short}
        replays = []  # per replay: (entries, the batch index of each entry that wants logits)
        for r in range(rounds):
            entries, owners, n_rows = [], [], 0
            for i in short:
                p = r - (rounds - pieces[i])  # this entry's piece in round r
                if p < 0:
                    continue
                slot, tokens = batch[i]
                chunk = tokens[p * packed.seq_rows : (p + 1) * packed.seq_rows]
                if n_rows + len(chunk) > packed.max_rows:
                    replays.append((entries, owners))
                    entries, owners, n_rows = [], [], 0
                want = not last_only[i] or p == pieces[i] - 1
                entries.append((slot, chunk, self.lengths[slot], want))
                n_rows += len(chunk)
                if want:
                    owners.append(i)
                self.lengths[slot] += len(chunk)
            replays.append((entries, owners))
        for n, (entries, owners) in enumerate(replays):
            logits = packed.run(entries, n)
            if self.taps:
                self._tapped_pieces(entries, packed.features)
            for i, rows in zip(owners, logits, strict=True):
                if last_only[i]:
                    rows = rows[-1:]
                parts[i].append(rows if n == len(replays) - 1 else rows.clone())
        for i in short:
            results[i] = parts[i][0] if len(parts[i]) == 1 else torch.cat(parts[i])
        return results

    def _tapped_pieces(self, entries: Seq[tuple[int, Seq[int], int, bool]], features: torch.Tensor) -> None:
        """A packed replay's pieces (slot, tokens, first position, _) and its rows' tapped features, for the head."""
        at = 0
        for slot, tokens, start, _ in entries:
            self._tapped.append((slot, start, tokens, features[at : at + len(tokens)].clone()))
            at += len(tokens)

    def _prefill(self, slot: int, tokens: Seq[int], last_only: bool) -> torch.Tensor:
        device, row = self.model.torch_device, self.pool.row(slot)
        tokens = torch.as_tensor(tokens, dtype=torch.long).to(device, non_blocking=True)
        forward = self.model.step if self.model.use_graphs else self.model.transformer
        rows = []
        for start, stop in prefill_chunks(tokens.shape[0]):
            chunk = tokens[start:stop]
            begin = self.lengths[slot]
            end = begin + chunk.shape[0]
            tapped = dict.fromkeys(self.taps) if self.taps else None
            rows.append(forward(chunk, torch.arange(begin, end, device=device), row.k, row.v, kv_len=end,
                                last_only=last_only, tapped=tapped))
            if tapped is not None:
                self._tapped.append((slot, begin, chunk, tapped_features(tapped, self.taps)))
            self.lengths[slot] = end
        return rows[-1] if last_only else torch.cat(rows)

    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        self._check(batch)
        if self.head is None:
            return self._forward(batch, last_only)
        self._tapped = []  # (slot, first position, tokens, features) of every piece the forward ran
        logits = self._forward(batch, last_only)
        self.head.take_in(self._tapped)
        return logits

    def _sequence_forward(self, slot: int, tokens: Seq[int] | torch.Tensor, last_only: bool) -> torch.Tensor:
        """A batch of one through the slot's TorchSequence (its length is the cache's), tapped for a head."""
        seq = self.sequences[slot]
        if self.packed is not None:  # TANDEM_BATCH_INVARIANT=0: the slot's length is kept here
            seq.cache.length = self.lengths[slot]
        start, features = seq.cache.length, []
        logits = seq.forward(tokens, logits="last" if last_only else "all", taps=self.taps, features=features)
        if self.taps:
            self._tapped.append((slot, start, tokens, torch.cat(features) if len(features) > 1 else features[0]))
        if self.packed is not None:
            self.lengths[slot] = seq.cache.length
        return logits

    def _forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        if self.packed is not None and (len(batch) > 1 or not self.sequences):
            with torch.inference_mode():
                return self._forward_packed(batch, last_only)
        if len(batch) == 1:  # (packed: TANDEM_BATCH_INVARIANT=0) one sequence through its TorchSequence
            (slot, tokens), last = batch[0], last_only[0]
            return [self._sequence_forward(slot, tokens, last)]
        device = self.model.torch_device
        tokens, positions, rows, spans, out_rows, counts = [], [], [], [], [], []
        for (slot, ids), last in zip(batch, last_only, strict=True):
            begin, start, n = len(tokens), self.length(slot), len(ids)
            tokens.extend(int(t) for t in ids)
            positions.extend(range(start, start + n))
            rows.extend([slot] * n)
            spans.append((begin, begin + n, slot, start + n))
            out_rows.extend([begin + n - 1] if last else range(begin, begin + n))
            counts.append(1 if last else n)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long).to(device, non_blocking=True)
        tapped = dict.fromkeys(self.taps) if self.taps else None
        with torch.inference_mode():
            logits = self.model.transformer.forward_ragged(as_tensor(tokens), as_tensor(positions), as_tensor(rows),
                                                           spans, self.pool.k, self.pool.v, as_tensor(out_rows),
                                                           tapped)
        if tapped is not None:
            features = tapped_features(tapped, self.taps)
            for (slot, ids), (begin, end, _, _) in zip(batch, spans, strict=True):
                self._tapped.append((slot, self.length(slot), ids, features[begin:end]))
        for (slot, ids) in batch:
            self.sequences[slot].cache.length += len(ids)
        return list(logits.split(counts))

    @property
    def steps_on_device(self) -> bool:
        return bool(self.sequences)  # a slot's own TorchSequence (not the packed graphs) takes a device token

    def step_on_device(self, slot: int, tokens: torch.Tensor, last_only: bool = True) -> torch.Tensor:
        self._tapped = []
        logits = self._sequence_forward(slot, tokens, last_only)
        if self.head is not None:
            self.head.take_in(self._tapped)
        return logits

    def rewind(self, slot: int, length: int) -> None:
        if self.packed is None:
            self.sequences[slot].rewind(length)
        elif not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot rewind slot {slot} to {length}: it holds {self.lengths[slot]} tokens")
        else:
            self.lengths[slot] = length

    def copy_prefix(self, src: int, dst: int, length: int) -> bool:
        if not 0 <= length <= self.length(src):
            raise ValueError(f"cannot copy {length} positions: slot {src} holds {self.length(src)}")
        if src != dst:
            for t in self.pool.k + self.pool.v:  # [B, H_kv, S, D]
                t[dst, :, :length].copy_(t[src, :, :length])
        if self.packed is not None:
            self.lengths[dst] = length
        else:
            self.sequences[dst].cache.length = length
        if self.head is not None:
            self.head.copy_prefix(src, dst, length)
        return True

    def attach_head(self, head: Model) -> BatchedCache:
        from tandem.backends.torch_head import TorchHeadCache, TorchHeadModel

        if not isinstance(head, TorchHeadModel):
            raise ValueError(f"a head draft on the torch backend must be loaded by it too, got {head!r}")
        return TorchHeadCache(head, self)

    def tap(self, taps: Seq[int], head) -> None:
        """Hand every forward's rows, with the inputs of the layers `taps` names, to head.take_in (a head draft's
        hook: TorchHeadCache); no taps and no head turn it off. The plain path taps nothing."""
        self.taps, self.head = tuple(taps), head
        for seq in self.sequences:
            if seq.graphs is not None:
                seq.graphs.tap(self.taps)
        if self.packed is not None:
            self.packed.tap(self.taps)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def close(self) -> None:
        self.sequences, self.pool, self.packed = [], None, None
