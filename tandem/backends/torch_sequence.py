"""One sequence on the torch backend: its KV cache (of its own, or a row of a pool), forwards replayed as CUDA graphs
where captured, long prompts in compiled pieces."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tandem.backends.base import Model, Sequence
from tandem.backends.torch_graphs import GRAPH_ROWS, StepGraph
from tandem.cache import KVCache

PREFILL_CHUNK = 512  # bounds the [T, S] attention mask and activations of a long prompt
GRAPH_CHUNKS_MAX = 64  # forwards of up to this many tokens replay the graph in chunks; longer ones run eagerly
SLOT_ALIGN = 64  # cache slots are rounded up to this: aligned rows for the attention matmuls


def cache_slots(capacity: int, rows: int = GRAPH_ROWS) -> int:
    """Cache slots a sequence of `capacity` tokens takes: room for a padded forward's rows past its last real
    position, rounded for aligned attention matmuls."""
    return -(-(capacity + rows) // SLOT_ALIGN) * SLOT_ALIGN


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


class TorchSequence(Sequence):
    def __init__(self, model: Model, capacity: int, rows: int, graphs: bool = True,
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
