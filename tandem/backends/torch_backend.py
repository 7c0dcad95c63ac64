"""PyTorch backend: GGUF weights dequantized to one dtype, run by tandem.models.transformer on any torch device."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence as Seq

import torch

from tandem.backends.base import BatchedCache, Model, Sequence
from tandem.backends.torch_graphs import GRAPH_ROWS, PackedGraphs, StepGraph
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
GRAPH_CHUNKS_MAX = 64  # forwards of up to this many tokens replay the graph in chunks; longer ones run eagerly
SLOT_ALIGN = 64  # cache slots are rounded up to this: aligned rows for the attention matmuls
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

    def forward(self, tokens: Seq[int] | torch.Tensor, logits: str = "all", taps: Seq[int] = (),
                features: list[torch.Tensor] | None = None) -> torch.Tensor:
        """taps, features: a head draft's (TorchBatchedCache.tap): each chunk's inputs of the layers taps names,
        [n, len(taps) * d] side by side, appended to features."""
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
                    # Uploaded whole: chunks staged one by one through the pinned buffer would each wait for the
                    # copy before them, queued behind a replay (StepGraph.copied); unguarded, every chunk but the
                    # last read its successor's tokens (seen on an H200).
                    tokens = torch.tensor(tokens, dtype=torch.long, device=self.model.torch_device)
                self.graphs.tap(taps)
                rows = []
                for start in range(0, n, self.rows):
                    chunk = tokens[start : start + self.rows]
                    last = start + len(chunk) == n
                    out = self.graphs.run(chunk, self.cache.length, last_only=logits == "last")
                    if taps:
                        features.append(self.graphs.features[: len(chunk)].clone())
                    self.cache.length += len(chunk)
                    if logits == "all" or last:
                        rows.append(out if last else out.clone())
                return rows[-1] if logits == "last" or len(rows) == 1 else torch.cat(rows)
            tokens = torch.as_tensor(tokens, dtype=torch.long).to(self.model.torch_device, non_blocking=True)
            # A graphed sequence's long prompt: the compiled step (dynamic shapes, compiled with the model's first
            # sequence: compile_prompt_forward). Without graphs (model.logits, an eager reference): eager.
            forward = self.model.step if self.graphs is not None else self.model.transformer
            rows = []
            for start, stop in prefill_chunks(n):
                chunk = tokens[start:stop]
                begin, end = self.cache.length, self.cache.length + chunk.shape[0]
                positions = torch.arange(begin, end, device=self.model.torch_device)
                tapped = dict.fromkeys(taps) if taps else None
                rows.append(forward(chunk, positions, self.cache.k, self.cache.v, kv_len=end,
                                    last_only=logits == "last", tapped=tapped))
                if tapped is not None:
                    features.append(tapped_features(tapped, taps))
                self.cache.length = end
        return rows[-1] if logits == "last" else torch.cat(rows) if len(rows) > 1 else rows[0]

    def rewind(self, length: int) -> None:
        self.cache.rewind(length)

    def close(self) -> None:
        self.model.release(self)


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

    def __init__(self, model: TorchModel, slots: int, capacity: int) -> None:
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
        into a cache that holds nothing yet), once per kind of cache (a pool's row, a view, and a cache of its own
        are guarded apart), with the model's first sequence of that kind: else the first long prompt waits for it
        (tens of seconds on a GPU). Dynamic shapes: every longer prompt reuses it (docs/decisions/0007)."""
        n, kind = GRAPH_CHUNKS_MAX + 1, cache.k[0]._base is not None
        if self.compiled_caches is None or kind in self.compiled_caches or cache.k[0].shape[2] < n:
            return
        self.compiled_caches.add(kind)
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


def tapped_features(tapped: dict[int, torch.Tensor], taps: Seq[int]) -> torch.Tensor:
    """The tapped layers' inputs side by side in taps' order (a layer named twice, twice): [T, len(taps) * d]."""
    return torch.cat([tapped[layer] for layer in taps], dim=-1)


def prefill_chunks(n: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """[start, end) pieces of at most `chunk` tokens covering n, the last no shorter than the first compiled
    prompt (GRAPH_CHUNKS_MAX + 1, or n): a short tail would take the forward's decode branch, or specialise on one
    token, and compile the step anew (see _compile_step)."""
    bounds = list(range(0, n, chunk)) + [n]
    if len(bounds) > 2:
        bounds[-2] = min(bounds[-2], n - GRAPH_CHUNKS_MAX - 1)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def load_torch(path: str, device: str = "cpu", dtype: str = "float32", n_ctx: int | None = None,
               progress: bool = True, graphs: bool | None = None) -> Model:
    """A target (TorchModel), or a head draft (an eagle3 file: torch_head.TorchHeadModel) to attach to one."""
    if open_gguf(path).architecture == "eagle3":
        from tandem.backends.torch_head import TorchHeadModel

        return TorchHeadModel(path, device=parse_device(device), dtype=parse_dtype(dtype), n_ctx=n_ctx)
    return TorchModel.from_gguf(path, device=device, dtype=dtype, n_ctx=n_ctx, progress=progress, graphs=graphs)
