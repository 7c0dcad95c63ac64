"""The interface every backend implements; `tandem.speculative` talks to models only through it.

A `Model` is loaded weights plus a tokenizer. A `Sequence` is one KV cache over that model: the decode loop owns
one per model per request, feeds it tokens and rewinds it. Rewinding is O(1) (the cache is static and indexed by
absolute position), so speculation can throw away rejected draft tokens without copying anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tandem.config import ModelConfig
    from tandem.loading.tokenizer import Tokenizer


# Another cache and a batch for it, fed beside a forward (BatchedCache.forward_picking)
Alongside = tuple["BatchedCache", Seq[tuple[int, Seq[int]]]]


class ContextOverflowError(ValueError):
    """More tokens than a sequence's KV cache can hold."""


class Sequence(ABC):
    """One KV cache. Positions 0..length-1 hold the tokens fed so far."""

    capacity: int  # most tokens this cache can hold

    @property
    @abstractmethod
    def length(self) -> int: ...

    @abstractmethod
    def forward(self, tokens: Seq[int] | torch.Tensor, logits: str = "all") -> torch.Tensor:
        """Feed T tokens at positions length..length+T-1 and return their logits.

        logits="all" gives [T, vocab] (a verify needs every row); "last" gives [1, vocab] (a prefill needs only the
        next-token row, and skipping the rest saves T-1 output projections). Float32, on the model's device.
        Raises ContextOverflowError (and changes nothing) when length + T > capacity.
        """

    @abstractmethod
    def rewind(self, length: int) -> None:
        """Forget every position >= length (0 <= length <= self.length)."""

    def close(self) -> None:
        """Free what this sequence holds (a llama.cpp context, a cache slot)."""

    def _check_room(self, n_new: int) -> None:
        if self.length + n_new > self.capacity:
            raise ContextOverflowError(
                f"{self.length} tokens in the cache + {n_new} new = {self.length + n_new} exceeds the "
                f"context of {self.capacity} tokens by {self.length + n_new - self.capacity}"
            )

    def _check_rewind(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length}: the cache holds {self.length} tokens")


class BatchedCache(ABC):
    """KV memory for up to `slots` sequences of one model, one per slot; one forward serves any subset of them.

    The batched engine owns one per model (target, draft). Each slot is a sequence as `Sequence` describes it:
    positions 0..length(slot)-1 hold its tokens, rewinding is O(1). Backends that cannot put several sequences in
    one forward yet run them one after another (`SequentialCache`); the engine's results are the same.
    """

    slots: int  # sequences it holds at most
    capacity: int  # tokens a sequence may hold
    can_copy: bool = False  # whether copy_prefix can copy KV between slots
    # A prompt chunk that does not end its prompt must be a multiple of this many tokens (llama.cpp's repacked CPU
    # weights compute prompt rows in groups of 4: KERNELS in llamacpp_core)
    prefill_align: int = 1

    def padded_rows(self, rows: int) -> int:
        """The rows a forward of `rows` rows in all computes: more where the backend pads to fixed shapes (the torch
        backend's packed graphs). A forward's cost is a function of these, so the planner prices rows by them."""
        return rows

    @abstractmethod
    def length(self, slot: int) -> int: ...

    @abstractmethod
    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        """Feed each (slot, tokens) of batch at that slot's next positions, every slot at most once, in one forward
        where the backend can. Returns per entry its logits: [T, vocab], or [1, vocab] where last_only[i]; entries
        with last_only are prompt chunks (a backend may compute them with its prompt kernel), the others decode
        and verify rows.
        Raises ContextOverflowError (and changes nothing) when a slot would pass its capacity."""

    def forward_picking(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool], picks: Seq[bool],
                        alongside: Alongside | None = None) -> list[torch.Tensor]:
        """forward, but each entry with picks[i] comes back as its rows' argmax, [T] int64 (tandem.sampling.argmax's:
        all a greedy sequence's verify reads), which a backend may take where its logits are (llama.cpp's worker
        process: none of those rows copied back). alongside: (another cache, a batch of it) fed beside this forward
        (feed), on the device at once where this cache overlaps that one (overlaps), else after it."""
        from tandem.sampling import argmax

        rows = self.forward(batch, last_only)
        if alongside is not None:
            alongside[0].feed(alongside[1])
        return [argmax(r) if pick else r for r, pick in zip(rows, picks, strict=True)]

    def feed(self, batch: Seq[tuple[int, Seq[int]]]) -> None:
        """Take in each (slot, tokens) as forward does, reading nothing back (a device may still be running it when
        this returns: synchronize waits for it)."""
        self.forward(batch, [False] * len(batch))

    def overlaps(self, other: BatchedCache) -> bool:
        """Whether forward_picking runs a feed of `other` alongside on the device beside its own forward (llama.cpp
        on a GPU: both contexts' work is queued before either is read), rather than after it."""
        return False

    def synchronize(self) -> None:
        """Wait for the work a feed left running on the device."""

    @abstractmethod
    def rewind(self, slot: int, length: int) -> None:
        """Forget every position >= length of that slot."""

    def reusable(self, slot: int, length: int) -> int:
        """How many of the first `length` positions of slot a new prompt sharing them may keep: the rest it
        recomputes, so that it sees the KV a fresh prompt would."""
        return length

    def settle(self, slot: int, tokens: Seq[int], rows: int) -> int:
        """Recompute up to `rows` of slot's positions past reusable() as a prompt computes them, so that a prompt
        sharing them keeps them (tokens: the ids of positions 0.., past the slot's length too); returns the positions
        still to recompute. Backends whose every position is reusable have nothing to do."""
        return 0

    def copy_prefix(self, src: int, dst: int, length: int) -> bool:
        """Make dst hold src's first `length` positions (dst's length becomes `length`); False where the backend
        cannot copy KV between sequences (the caller then recomputes them)."""
        return False

    @property
    def nbytes(self) -> int:
        """KV memory this cache holds, in bytes (0 where unknown)."""
        return 0

    # Whether step_on_device can run a forward from tokens still on the device (the engine then queues a lone
    # sequence's plain steps, and its verify after drafts, ahead of reading them back)
    steps_on_device: bool = False

    def step_on_device(self, slot: int, tokens: torch.Tensor, last_only: bool = True) -> torch.Tensor:
        """Feed tokens, [n] on the model's device (n at most a draft's k + 1), at that slot's next positions; the
        logits after the last [1, vocab] (or after each, [n, vocab]), with no host synchronisation. Only where
        steps_on_device."""
        raise NotImplementedError(f"{type(self).__name__} takes its tokens from the host")

    # Whether greedy_drafts runs a step's greedy drafting where the model runs, in one call (llama.cpp: no logits
    # rows copied back and no round trip to a worker process a draft token)
    drafts_greedy: bool = False

    def greedy_drafts(self, feeds: Seq[Seq[tuple[int, Seq[int]]]], counts: Seq[int], vocab_limit: int,
                      steady: bool, floors: Seq[float] | None = None) -> tuple[list[list[int]], int]:
        """The forwards of `feeds` (each a batch; each entry's last row read), then for each entry of feeds[-1] its
        argmax over the first vocab_limit ids fed back one row a forward, until it has counts[i] drafts or its
        latest's softmax probability is below floors[i] (steady: slots done go on drafting, unread, while each has
        room). Returns the drafts per entry and the forwards run: what Drafter.draft's loop does for greedy
        sequences. Only where drafts_greedy."""
        raise NotImplementedError(f"{type(self).__name__} drafts through forward")

    def attach_head(self, head: Model) -> BatchedCache:
        """A head draft's cache over this one (docs/decisions/0004-head-drafts.md): length(slot) is this cache's, a
        forward of one token per slot drafts from the hidden state this cache computed before it (or the head's
        own, within a draft round). Only where the backend hands hidden states to a head."""
        raise ValueError(f"{type(self).__name__} runs no head drafts: the llama.cpp backend does (in this process "
                         "or its worker), not the torch backend")

    def close(self) -> None:
        """Free the memory."""

    def _check_feeds(self, feeds: Seq[Seq[tuple[int, Seq[int]]]]) -> None:
        """_check for forwards run one after another: each alone, and the room for every slot's tokens in all."""
        total: dict[int, list] = {}
        for feed in feeds:
            self._check(feed)
            for slot, tokens in feed:
                total.setdefault(slot, []).extend(tokens)
        self._check(list(total.items()))

    def _check(self, batch: Seq[tuple[int, Seq[int]]]) -> None:
        slots = [slot for slot, _ in batch]
        if len(set(slots)) != len(slots) or not all(0 <= s < self.slots for s in slots):
            raise ValueError(f"a batch names each slot in [0, {self.slots}) at most once, got {slots}")
        for slot, tokens in batch:
            if not len(tokens):
                raise ValueError(f"slot {slot}: a forward needs at least one token")
            if self.length(slot) + len(tokens) > self.capacity:
                raise ContextOverflowError(
                    f"slot {slot}: {self.length(slot)} tokens in the cache + {len(tokens)} new exceeds the context "
                    f"of {self.capacity} tokens by {self.length(slot) + len(tokens) - self.capacity}")


class SequentialCache(BatchedCache):
    """A slot per `Sequence` of the model, run one after another: the batched engine on any backend."""

    def __init__(self, model: Model, slots: int, capacity: int, drafting: bool = False) -> None:
        self.slots, self.capacity = slots, capacity
        self.sequences = [model.new_sequence(capacity, drafting=drafting) for _ in range(slots)]

    def length(self, slot: int) -> int:
        return self.sequences[slot].length

    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        self._check(batch)
        return [self.sequences[slot].forward(tokens, logits="last" if last else "all")
                for (slot, tokens), last in zip(batch, last_only, strict=True)]

    def rewind(self, slot: int, length: int) -> None:
        self.sequences[slot].rewind(length)

    def close(self) -> None:
        for seq in self.sequences:
            seq.close()
        self.sequences = []


class Model(ABC):
    """Loaded weights, their tokenizer and the means to open KV caches over them."""

    path: str
    config: ModelConfig
    tokenizer: Tokenizer
    backend: str  # "torch" | "llama.cpp"
    device: str  # e.g. "cpu", "cuda:0", "vulkan:0"
    n_ctx: int  # default capacity of a new sequence
    # Whether a step runs fastest when consecutive forwards keep one shape: llama.cpp on a GPU reuses a context's
    # graph (CUDA: replays it captured) only while its shape stays, and rebuilds a changed one at about a draft step's
    # cost. A draft then feeds one row per sequence a forward (tandem.speculative.proposer, the engine's Drafter).
    steady_shapes: bool = False

    @abstractmethod
    def new_sequence(self, n_ctx: int | None = None, drafting: bool = False) -> Sequence:
        """Open an empty KV cache holding up to n_ctx tokens (default self.n_ctx).

        drafting=True sizes it for a draft model: one-token steps and short catch-ups, whose numerics need match
        nothing (a target's forwards must give a token the same logits however many tokens share the forward).
        """

    def new_batched_cache(self, slots: int, n_ctx: int | None = None, drafting: bool = False) -> BatchedCache:
        """KV memory for `slots` sequences of up to n_ctx tokens each (default self.n_ctx), for the batched engine."""
        return SequentialCache(self, slots, n_ctx or self.n_ctx, drafting)

    def kv_bytes_per_token(self) -> int:
        """KV memory one token of one sequence takes (keys and values of every layer); sizes the engine's pool."""
        c = self.config
        return 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4

    def logits(self, ids: Seq[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] for ids from position 0, in a fresh cache: no side effects on any other."""
        seq = self.new_sequence(max(len(ids), 1))
        try:
            return seq.forward(list(ids), logits="all")
        finally:
            seq.close()

    def synchronize(self) -> None:
        """Wait for queued device work (for honest timings); a no-op on synchronous backends."""

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.config.architecture} {self.path!r} on {self.device} ({self.backend})>"
