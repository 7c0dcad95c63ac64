"""CUDA graphs of the torch backend's forwards: a sequence's padded step (StepGraph) and a batch's packed forward
(PackedGraphs). Replaying a graph launches a step's hundreds of kernels at once, and one fixed shape per graph keeps
a token's logits independent of what else it was computed with, so speculation and batching stay bit-exact."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from tandem.cache import KVCache
from tandem.loading.progress import name_of, report
from tandem.models import fused_projections
from tandem.models.transformer import Transformer

# Every graphed forward runs as 9 rows: a target's verify of up to 8 drafts, and a draft's one-token steps, for
# which 9 rows cost 1.6% more than 1 on an H200 and let an idle draft catch up 9 tokens a replay (what makes
# turning drafting back on affordable, speculative/policy.py).
GRAPH_ROWS = 9
KV_BUCKET_MIN = 256  # a graph attends over 256, 512, 1024, ... cache slots, the fewest that hold every position
PACKED_ROWS_MIN = 16  # a batch's graphs hold 16, 32, 64, ... rows (the kernels' tile: fewer cost the same)
PACKED_ROUNDS = 8  # replays one batched forward takes at most (a 64-token prompt in 9-row pieces): pinned buffers


class GraphedModel(Protocol):
    """What the graphs use of a TorchModel."""

    path: str
    torch_device: torch.device
    transformer: Transformer
    use_graphs: bool
    step: Callable[..., torch.Tensor]  # Transformer.forward, compiled on CUDA: what a graph captures


def kv_bucket(keys: int, slots: int) -> int:
    """The span a graph attends over for `keys` keys: 256, 512, 1024, ... cache slots, at most `slots`."""
    span = KV_BUCKET_MIN
    while span < keys:
        span *= 2
    return min(span, slots)


def kv_spans(slots: int) -> list[int]:
    """Every span kv_bucket gives for a cache of `slots` slots: 256, 512, ... and `slots` itself."""
    spans = [min(KV_BUCKET_MIN, slots)]
    while spans[-1] < slots:
        spans.append(min(2 * spans[-1], slots))
    return spans


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

    def __init__(self, model: GraphedModel, cache: KVCache, rows: int) -> None:
        device = model.torch_device
        self.model, self.cache, self.rows = model, cache, rows
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.offsets = torch.arange(rows, device=device)
        # Host tokens go through pinned memory: a copy that needs no staging and never blocks the host. Before it is
        # written again, the last copy out of it must have run (`copied`): two forwards can follow each other with
        # no host sync between (an evidence read's catch-up, then its checked rows).
        self.host = torch.zeros(rows, dtype=torch.long, pin_memory=device.type == "cuda")
        self.host_view = self.host.numpy()
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.slots = cache.k[0].shape[2]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # kv_len -> graph, [rows, V] logits
        self.taps: tuple[int, ...] = ()  # layers whose inputs a forward copies to features (a head draft's: `tap`)
        self.features: torch.Tensor | None = None

    def _forward(self, kv_len: int) -> torch.Tensor:
        positions = self.start + self.offsets
        if not self.taps:
            return self.model.step(self.tokens, positions, self.cache.k, self.cache.v, kv_len)
        tapped = dict.fromkeys(self.taps)
        logits = self.model.step(self.tokens, positions, self.cache.k, self.cache.v, kv_len, tapped=tapped)
        torch.cat([tapped[layer] for layer in self.taps], dim=-1, out=self.features)
        return logits

    def tap(self, taps: Seq[int]) -> None:
        """From now on every forward leaves the inputs of the layers `taps` names in features, [rows, len(taps) *
        d] (a head draft's: TorchBatchedCache.attach_head); its graphs are captured again."""
        taps = tuple(taps)
        if taps == self.taps:
            return
        self.taps = taps
        d, t = self.model.transformer.config.d_model, self.model.transformer
        self.features = torch.empty(self.rows, len(taps) * d, dtype=t.dtype, device=t.device) if taps else None
        for span in list(self.graphs):
            self.graphs[span] = self._capture(span)

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
        spans = [span for span in kv_spans(self.slots) if span not in self.graphs]
        for i, span in enumerate(spans):
            if self.model.torch_device.type == "cuda":  # elsewhere nothing is captured
                report(f"capturing {name_of(self.model.path)}'s step graphs", i, len(spans))
            self.graphs[span] = self._capture(span)

    def kv_span(self, start: int) -> int:
        return kv_bucket(start + self.rows, self.slots)

    def run(self, tokens: Seq[int] | torch.Tensor, start: int, last_only: bool) -> torch.Tensor:
        n = len(tokens)
        if isinstance(tokens, torch.Tensor):
            self.tokens[:n].copy_(tokens, non_blocking=True)
        else:
            if self.copied is not None:
                self.copied.synchronize()  # at once where the step before was read back
            self.host_view[:n] = tokens
            self.tokens[:n].copy_(self.host[:n], non_blocking=True)
            if self.copied is not None:
                self.copied.record()
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


class PackedGraphs:
    """CUDA graphs of Transformer.forward_packed over a KV pool: several sequences' rows in one replay.

    One graph per bucket of total rows (16, 32, 64, ... up to every slot's rows_per_sequence) and span of cache
    slots attended over (as StepGraph's), all captured now, when the pool is made. Inputs are one static int64
    buffer (tokens, positions, cache rows, logits rows, per-sequence ranges), filled on the host and copied in one
    transfer; the logits land in a static buffer, so the graphs share one memory pool (nothing they allocate
    outlives a replay). Padding rows write no cache (cache row -1) and belong to no sequence; a sequence's rows
    are computed as they would be alone (Transformer.forward_packed), so which bucket serves a batch changes no bit.
    """

    def __init__(self, model: GraphedModel, pool: KVCache, slots: int) -> None:
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
        self.spans = kv_spans(self.cache_slots)
        self.taps: tuple[int, ...] = ()  # as StepGraph's: a head draft's layer inputs, [rows, len(taps) * d]
        self.features: torch.Tensor | None = None

    def padded_rows(self, rows: int) -> int:
        """The rows `rows` rows of one-piece entries run as: full replays of max_rows, then the least bucket that
        holds the rest (a forward of 65 rows costs a 128-row replay)."""
        full, rest = divmod(rows, self.max_rows)
        return full * self.max_rows + (next(b for b in self.buckets if b >= rest) if rest else 0)

    def _views(self, rows: int) -> tuple[torch.Tensor, ...]:
        R, m, n_seqs = self.max_rows, self.meta, min(self.slots, rows)
        return m[:rows], m[R : R + rows], m[2 * R : 2 * R + rows], m[4 * R : 4 * R + 4 * n_seqs].view(n_seqs, 4), \
            m[3 * R : 3 * R + rows]

    def _forward(self, rows: int, span: int) -> None:
        tokens, positions, cache_rows, seqs, out_rows = self._views(rows)
        tapped = dict.fromkeys(self.taps) if self.taps else None
        self.model.transformer.forward_packed(tokens, positions, cache_rows, seqs, span, out_rows, self.pool.k,
                                              self.pool.v, self.logits, tapped)
        if tapped is not None:
            torch.cat([tapped[layer] for layer in self.taps], dim=-1, out=self.features[:rows])

    def tap(self, taps: Seq[int]) -> None:
        """As StepGraph.tap: a run's rows' tapped layer inputs in features, in the order of its pieces' rows."""
        taps = tuple(taps)
        if taps == self.taps:
            return
        self.taps, t = taps, self.model.transformer
        self.features = torch.empty(self.max_rows, len(taps) * t.config.d_model, dtype=t.dtype, device=t.device) \
            if taps else None
        if self.graphs:
            self.graphs = {}
            self.capture_all()

    def capture_all(self) -> None:
        """Every (rows, span) graph, now: from a buffer of padding alone, which writes no cache slot."""
        if not self.use_graphs:
            return
        self.meta.zero_()
        self.meta[2 * self.max_rows : 3 * self.max_rows] = -1
        stream = torch.cuda.Stream(self.model.torch_device)
        what, total = f"capturing {name_of(self.model.path)}'s batch graphs", len(self.buckets) * len(self.spans)
        for rows in self.buckets:
            for span in self.spans:
                report(what, len(self.graphs), total)
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
