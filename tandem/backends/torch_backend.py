"""PyTorch backend: GGUF weights dequantized to one dtype, run by tandem.models.transformer on any torch device."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence as Seq

import torch

from tandem.backends.base import BatchedCache, Model, Sequence
from tandem.cache import KVCache
from tandem.config import ModelConfig
from tandem.loading.gguf import open_gguf
from tandem.loading.tokenizer import Tokenizer
from tandem.loading.weights import load_weights
from tandem.models import fused_projections
from tandem.models.transformer import Transformer

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEFAULT_CTX = 4096
PREFILL_CHUNK = 512  # bounds the [T, S] attention mask and activations of a long prompt
# Every graphed forward runs as 9 rows: a target's verify of up to 8 drafts, and a draft's one-token steps, for
# which 9 rows cost 1.6% more than 1 on an H200 and let an idle draft catch up 9 tokens a replay (what makes
# turning drafting back on affordable, speculative/policy.py).
GRAPH_ROWS = 9
GRAPH_CHUNKS_MAX = 64  # forwards of up to this many tokens replay the graph in chunks; longer ones run eagerly
SLOT_ALIGN = 64  # cache slots are rounded up to this: aligned rows for the attention matmuls
KV_BUCKET_MIN = 256  # a graph attends over 256, 512, 1024, ... cache slots, the fewest that hold every position
SEQUENCE_POOL = 4  # closed sequences kept per capacity: their caches and captured graphs are reused
PACKED_ROWS_MIN = 16  # a batch's graphs hold 16, 32, 64, ... rows (the kernels' tile: fewer cost the same)
PACKED_ROUNDS = 8  # replays one batched forward takes at most (a 64-token prompt in 9-row pieces): pinned buffers


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


class StepGraph:
    """CUDA graphs of a forward over a fixed number of rows; forwards of 1..rows tokens all replay one of them.

    A small model's decode step is hundreds of kernel launches that each take less time to run than to launch;
    replaying a graph launches them all at once. Padding every forward to the same row count also makes a token's
    logits independent of how many tokens were verified with it: a GEMM's rounding depends on its shape (cuBLAS
    picks other kernels for 1 row and for 9), so a 1-token plain step and a 9-token verify could argmax
    differently in bf16. With one shape, greedy speculative output equals plain output bit for bit, for the
    price of a few idle rows that a memory-bound step streams no extra weights for. Padded rows sit at positions
    past the real ones: they write cache slots that no real query reads before a real token overwrites them.
    Inputs are static buffers (tokens copied in, positions from one device scalar), so a replay creates no tensor
    and waits for nothing on the host. One graph per power-of-two span of cache slots attended over: attention
    reads only the slots a position can see, rounded up, instead of the whole context every step.
    """

    def __init__(self, model: TorchModel, cache: KVCache, rows: int) -> None:
        device = model.torch_device
        self.model, self.cache, self.rows = model, cache, rows
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.offsets = torch.arange(rows, device=device)
        # Host tokens go through pinned memory: a copy that needs no staging and never blocks the host. Reusing it
        # is safe because the decode loop synchronises once per iteration, after every copy out of it has run.
        self.host = torch.zeros(rows, dtype=torch.long, pin_memory=device.type == "cuda")
        self.host_view = self.host.numpy()
        self.slots = cache.k[0].shape[2]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # kv_len -> graph, [rows, V] logits

    def _forward(self, kv_len: int) -> torch.Tensor:
        positions = self.start + self.offsets
        return self.model.step(self.tokens, positions, self.cache.k, self.cache.v, kv_len)

    def _capture(self, kv_len: int) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]:
        if self.model.torch_device.type != "cuda":
            return None, None  # elsewhere the same padded step runs uncaptured (see TorchModel's `graphs`)
        stream = torch.cuda.Stream(self.model.torch_device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: compilation, cuBLAS handles, autotuning
            for _ in range(2):
                self._forward(kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._forward(kv_len)
        return graph, logits

    def capture_all(self) -> None:
        """Capture the graph of every span now: a first capture mid-generation stalls that request for a
        compilation (seen on an H200: +3 ms a token over a 128-token reply that crossed into a new span). The
        forwards write slots 0..rows-1 of a cache that holds nothing yet."""
        span = KV_BUCKET_MIN
        while True:
            span = min(span, self.slots)
            if span not in self.graphs:
                self.graphs[span] = self._capture(span)
            if span == self.slots:
                return
            span *= 2

    def kv_span(self, start: int) -> int:
        span = KV_BUCKET_MIN
        while span < start + self.rows:
            span *= 2
        return min(span, self.slots)

    def run(self, tokens: Seq[int] | torch.Tensor, start: int, last_only: bool) -> torch.Tensor:
        n = len(tokens)
        if isinstance(tokens, torch.Tensor):
            self.tokens[:n].copy_(tokens, non_blocking=True)
        else:
            self.host_view[:n] = tokens
            self.tokens[:n].copy_(self.host[:n], non_blocking=True)
        self.start.fill_(start)
        kv_len = self.kv_span(start)
        if kv_len not in self.graphs:
            self.graphs[kv_len] = self._capture(kv_len)
        graph, logits = self.graphs[kv_len]
        if graph is None:
            logits = self._forward(kv_len)
        else:
            graph.replay()
        # Views of the static output: valid until this sequence's next forward.
        return logits[n - 1 : n] if last_only else logits[:n]


def cache_slots(capacity: int, rows: int = GRAPH_ROWS) -> int:
    """Cache slots a sequence of `capacity` tokens takes: room for a padded forward's rows past its last real
    position, rounded for aligned attention matmuls."""
    return -(-(capacity + rows) // SLOT_ALIGN) * SLOT_ALIGN


class TorchSequence(Sequence):
    def __init__(self, model: TorchModel, capacity: int, rows: int, graphs: bool = True,
                 cache: KVCache | None = None) -> None:
        """cache: a row of a pool (TorchBatchedCache) to use instead of a cache of its own."""
        self.model = model
        self.capacity = capacity
        self.rows = rows
        self.cache: KVCache = cache if cache is not None else model.transformer.new_cache(cache_slots(capacity, rows))
        self.graphs = StepGraph(model, self.cache, rows) if model.use_graphs and graphs else None
        if self.graphs is not None:
            self.graphs.capture_all()
            model.compile_prompt_forward(self.cache)

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
            if self.graphs is not None and n <= max(self.rows, GRAPH_CHUNKS_MAX):
                # A draft catching up after plain steps, a short prompt: a few replays beat an eager forward's
                # thousands of launches. Earlier chunks' rows are copied out before the next replay overwrites them.
                if n > self.rows and not isinstance(tokens, torch.Tensor):
                    # Uploaded whole, and waited for: chunks staged one by one through the pinned buffer would
                    # overwrite it while an earlier chunk's copy still waits behind a replay (seen on an H200:
                    # every chunk but the last read its successor's tokens).
                    tokens = torch.tensor(tokens, dtype=torch.long, device=self.model.torch_device)
                rows = []
                for start in range(0, n, self.rows):
                    chunk = tokens[start : start + self.rows]
                    last = start + len(chunk) == n
                    out = self.graphs.run(chunk, self.cache.length, last_only=logits == "last")
                    self.cache.length += len(chunk)
                    if logits == "all" or last:
                        rows.append(out if last else out.clone())
                return rows[-1] if logits == "last" or len(rows) == 1 else torch.cat(rows)
            tokens = torch.as_tensor(tokens, dtype=torch.long).to(self.model.torch_device, non_blocking=True)
            # A graphed sequence's long prompt: the compiled step (dynamic shapes, compiled with the model's first
            # sequence: compile_prompt_forward). Without graphs (model.logits, an eager reference): eager.
            forward = self.model.step if self.graphs is not None else self.model.transformer
            rows = []
            for start in range(0, n, PREFILL_CHUNK):
                chunk = tokens[start : start + PREFILL_CHUNK]
                begin, end = self.cache.length, self.cache.length + chunk.shape[0]
                positions = torch.arange(begin, end, device=self.model.torch_device)
                rows.append(forward(chunk, positions, self.cache.k, self.cache.v, kv_len=end,
                                    last_only=logits == "last"))
                self.cache.length = end
        return rows[-1] if logits == "last" else torch.cat(rows) if len(rows) > 1 else rows[0]

    def rewind(self, length: int) -> None:
        self.cache.rewind(length)

    def close(self) -> None:
        self.model.release(self)


def kv_bucket(keys: int, slots: int) -> int:
    """The span a graph attends over for `keys` keys: 256, 512, 1024, ... cache slots, at most `slots`."""
    span = KV_BUCKET_MIN
    while span < keys:
        span *= 2
    return min(span, slots)


class PackedGraphs:
    """CUDA graphs of Transformer.forward_packed over a KV pool: several sequences' rows in one replay.

    One graph per bucket of total rows (16, 32, 64, ... up to every slot's rows_per_sequence) and span of cache
    slots attended over (as StepGraph's), all captured now, when the pool is made. Inputs are one static int64
    buffer (tokens, positions, cache rows, logits rows, per-sequence ranges), filled on the host and copied in one
    transfer; the logits land in a static buffer, so the graphs share one memory pool (nothing they allocate
    outlives a replay). Padding rows write no cache (cache row -1) and belong to no sequence; a sequence's rows
    are computed as they would be alone (Transformer.forward_packed), so which bucket serves a batch changes no bit.
    """

    def __init__(self, model: TorchModel, pool: KVCache, slots: int) -> None:
        transformer, device = model.transformer, model.torch_device
        self.model, self.pool, self.slots = model, pool, slots
        self.seq_rows = min(GRAPH_ROWS, transformer.rows_per_sequence())  # rows of one sequence a replay takes
        self.buckets = [PACKED_ROWS_MIN]  # up to the kernels' limit: more rows go in several replays
        while self.buckets[-1] < min(slots * self.seq_rows, fused_projections.MAX_ROWS):
            self.buckets.append(2 * self.buckets[-1])
        self.max_rows = R = self.buckets[-1]
        # [tokens R | positions R | cache rows R | logits rows R | (first row, rows, cache row, keys) per slot]
        size = 4 * R + 4 * slots
        self.meta = torch.zeros(size, dtype=torch.long, device=device)
        on_cuda = device.type == "cuda"
        # One pinned buffer a round of a forward, each reused once the copy out of it has run (its event)
        self.hosts = [torch.zeros(size, dtype=torch.long, pin_memory=on_cuda) for _ in range(PACKED_ROUNDS)]
        self.copied = [torch.cuda.Event() if on_cuda else None for _ in range(PACKED_ROUNDS)]
        self.logits = torch.empty(R, transformer.output.shape[0], dtype=torch.float32, device=device)
        self.cache_slots = pool.k[0].shape[2]
        self.use_graphs = on_cuda and model.use_graphs
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.spans = sorted({kv_bucket(KV_BUCKET_MIN << i, self.cache_slots) for i in range(32)
                             if KV_BUCKET_MIN << i < 2 * self.cache_slots})

    def _views(self, rows: int) -> tuple[torch.Tensor, ...]:
        R, m, n_seqs = self.max_rows, self.meta, min(self.slots, rows)
        return m[:rows], m[R : R + rows], m[2 * R : 2 * R + rows], m[4 * R : 4 * R + 4 * n_seqs].view(n_seqs, 4), \
            m[3 * R : 3 * R + rows]

    def _forward(self, rows: int, span: int) -> None:
        tokens, positions, cache_rows, seqs, out_rows = self._views(rows)
        self.model.transformer.forward_packed(tokens, positions, cache_rows, seqs, span, out_rows, self.pool.k,
                                              self.pool.v, self.logits)

    def capture_all(self) -> None:
        """Every (rows, span) graph, now: from a buffer of padding alone, which writes no cache slot."""
        if not self.use_graphs:
            return
        self.meta.zero_()
        self.meta[2 * self.max_rows : 3 * self.max_rows] = -1
        stream = torch.cuda.Stream(self.model.torch_device)
        for rows in self.buckets:
            for span in self.spans:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up outside the graph: Triton's compilation
                    self._forward(rows, span)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.graph_pool):
                    self._forward(rows, span)
                self.graphs[rows, span] = graph
        torch.cuda.synchronize(self.model.torch_device)

    def run(self, pieces: Seq[tuple[int, Seq[int] | torch.Tensor, int, bool]], round_: int = 0) -> list[torch.Tensor]:
        """One replay: per piece (cache row, tokens (at most seq_rows), first position, logits of all its rows or
        none); returns the logits of each piece that wants them, [T, V] views of the static buffer, valid until
        the next run."""
        n = sum(len(tokens) for _, tokens, _, _ in pieces)
        rows = next(b for b in self.buckets if b >= n)
        R, ring = self.max_rows, round_ % PACKED_ROUNDS
        host, event = self.hosts[ring], self.copied[ring]
        if event is not None:
            event.synchronize()  # the last copy out of this buffer has run
        h = host.numpy()
        h[: 4 * R + 4 * min(self.slots, rows)] = 0
        h[2 * R : 2 * R + rows] = -1
        at, out, counts, keys = 0, 0, [], 0
        for i, (slot, tokens, start, want) in enumerate(pieces):
            k = len(tokens)
            h[at : at + k] = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
            h[R + at : R + at + k] = range(start, start + k)
            h[2 * R + at : 2 * R + at + k] = slot
            h[4 * R + 4 * i : 4 * R + 4 * i + 4] = (at, k, slot, start + k)
            if want:
                h[3 * R + out : 3 * R + out + k] = range(at, at + k)
                counts.append((out, k))
                out += k
            at, keys = at + k, max(keys, start + k)
        self.meta.copy_(host, non_blocking=True)
        if event is not None:
            event.record()
        span = kv_bucket(keys, self.cache_slots)
        graph = self.graphs.get((rows, span))
        if graph is not None:
            graph.replay()
        else:
            self._forward(rows, span)
        return [self.logits[o : o + k] for o, k in counts]


class TorchBatchedCache(BatchedCache):
    """One pool of KV memory, [slots, H_kv, S, D] a layer, each slot a sequence with a static cache of its own.

    On CUDA, for Llama/Qwen-like models (Transformer.packed), every batch, of one sequence or many, replays one of
    PackedGraphs' graphs: tandem's kernels, batch-invariant, so a sequence's output alone and in a batch are the
    same bits. A sequence's rows go in pieces of at most rows_per_sequence() (a 64-token prompt: 8 replays);
    longer prompts run the compiled step on their cache row, one PREFILL_CHUNK at a time. Elsewhere a batch of one
    sequence runs that slot's TorchSequence; several run as one ragged forward (Transformer.forward_ragged). Either
    way the weights are read once for every sequence in the batch. TANDEM_PACKED=0 turns the packed path off.
    TANDEM_BATCH_INVARIANT=0 runs a batch of one sequence as its TorchSequence's StepGraph (compiled, cuBLAS's
    logits) instead: 1.41 ms a step for a 1.5B model on an H200 against 1.59 packed, but a sequence alone and in a
    batch may then differ in the last bits of its logits (bench/results/h200-2026-12-04f-batching).
    Per-slot static caches rather than paged blocks: positions stay absolute (rewind moves a length, graphs keep
    their shapes), at the price of reserving a whole context a slot (docs/batching.md).
    """

    can_copy = True

    def __init__(self, model: TorchModel, slots: int, capacity: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.model, self.slots, self.capacity = model, slots, capacity
        self.pool = model.transformer.new_cache(cache_slots(capacity), sequences=slots)
        self.packed = None
        self.sequences = []
        if model.transformer.packed and os.environ.get("TANDEM_PACKED", "1") != "0":
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
            for i, rows in zip(owners, logits, strict=True):
                if last_only[i]:
                    rows = rows[-1:]
                parts[i].append(rows if n == len(replays) - 1 else rows.clone())
        for i in short:
            results[i] = parts[i][0] if len(parts[i]) == 1 else torch.cat(parts[i])
        return results

    def _prefill(self, slot: int, tokens: Seq[int], last_only: bool) -> torch.Tensor:
        device, row = self.model.torch_device, self.pool.row(slot)
        tokens = torch.as_tensor(tokens, dtype=torch.long).to(device, non_blocking=True)
        forward = self.model.step if self.model.use_graphs else self.model.transformer
        rows = []
        for start in range(0, tokens.shape[0], PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            begin = self.lengths[slot]
            end = begin + chunk.shape[0]
            rows.append(forward(chunk, torch.arange(begin, end, device=device), row.k, row.v, kv_len=end,
                                last_only=last_only))
            self.lengths[slot] = end
        return rows[-1] if last_only else torch.cat(rows)

    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        self._check(batch)
        if self.packed is not None and (len(batch) > 1 or not self.sequences):
            with torch.inference_mode():
                return self._forward_packed(batch, last_only)
        if self.packed is not None:  # TANDEM_BATCH_INVARIANT=0: one sequence through its TorchSequence
            (slot, tokens), seq = batch[0], self.sequences[batch[0][0]]
            seq.cache.length = self.lengths[slot]
            logits = seq.forward(tokens, logits="last" if last_only[0] else "all")
            self.lengths[slot] = seq.cache.length
            return [logits]
        if len(batch) == 1:
            (slot, tokens), last = batch[0], last_only[0]
            return [self.sequences[slot].forward(tokens, logits="last" if last else "all")]
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
        with torch.inference_mode():
            logits = self.model.transformer.forward_ragged(as_tensor(tokens), as_tensor(positions), as_tensor(rows),
                                                           spans, self.pool.k, self.pool.v, as_tensor(out_rows))
        for (slot, ids) in batch:
            self.sequences[slot].cache.length += len(ids)
        return list(logits.split(counts))

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
        return True

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def close(self) -> None:
        self.sequences, self.pool, self.packed = [], None, None


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
        self.use_graphs = graphs if graphs is not None else on_cuda and os.environ.get("TANDEM_CUDA_GRAPHS", "1") != "0"
        self.step = self.transformer.forward  # what graphs capture; compiled on CUDA (see _compile_step)
        self.prompt_forward_compiled = True  # nothing to compile where the step is not compiled
        if on_cuda and self.use_graphs and os.environ.get("TANDEM_COMPILE", "1") != "0":
            self.step = _compile_step(self.transformer)
            self.prompt_forward_compiled = False
        self._free: dict[int, list[TorchSequence]] = {}  # capacity -> closed sequences ready for reuse

    @classmethod
    def from_gguf(cls, path: str, device: str = "cpu", dtype: str = "float32", n_ctx: int | None = None,
                  progress: bool = True, graphs: bool | None = None) -> TorchModel:
        started = time.perf_counter()
        torch_device, torch_dtype = parse_device(device), parse_dtype(dtype)
        gguf = open_gguf(path)
        tokenizer = Tokenizer.from_gguf(gguf)
        weights = load_weights(gguf, torch_dtype, torch_device, progress=progress)
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
        into a cache that holds nothing yet), once a model, with its first sequence: else the first long prompt
        waits for it (46 s on an H200). Dynamic shapes: every longer prompt reuses it (H200, 1.5B: 9-11 ms for
        65-448 tokens, against 26-31 ms eager and 69 ms of graph replays at 448; bench/gpu_prefill.py)."""
        n = GRAPH_CHUNKS_MAX + 1
        if self.prompt_forward_compiled or cache.k[0].shape[2] < n:
            return
        self.prompt_forward_compiled = True
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
    """The forward as Inductor compiles it: rms_norm, rope, residual adds and the softmax fuse into a few kernels,
    a third of the launches an eager step makes. Falls back to the eager forward when Triton is missing or
    compilation fails."""
    try:
        import triton  # noqa: F401  (Inductor's GPU code generator)
    except ImportError:
        return transformer.forward
    # dynamic=True: one compilation serves every row count and attention span (a static one costs ~40 s each).
    compiled = torch.compile(transformer.forward, dynamic=True)

    def step(*args, **kwargs):
        nonlocal compiled
        try:
            return compiled(*args, **kwargs)
        except Exception as error:  # a compiler bug must cost speed, never a request
            if compiled is transformer.forward:
                raise
            warnings.warn(f"torch.compile failed ({type(error).__name__}: {error}); running the step eagerly",
                          stacklevel=2)
            compiled = transformer.forward
            return compiled(*args, **kwargs)

    return step


def load_torch(path: str, device: str = "cpu", dtype: str = "float32", n_ctx: int | None = None,
               progress: bool = True, graphs: bool | None = None) -> TorchModel:
    return TorchModel.from_gguf(path, device=device, dtype=dtype, n_ctx=n_ctx, progress=progress, graphs=graphs)
