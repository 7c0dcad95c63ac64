"""Which KV slot a request gets, how much of its prompt is already there, and how many slots the KV memory holds.

Each slot of the engine's caches (target and draft alike) keeps what its last sequence left in it after that
sequence ends: the next request whose prompt starts the same way (the next turn of a conversation, a shared system
prompt) feeds only the rest. A new request takes the free slot holding the longest common prefix, ties to the least
recently used; where a busy or other slot holds a longer one and the backend can copy KV, that prefix is copied
over. Least recently used contents are what gets overwritten first.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tandem.backends.base import BatchedCache, Model
from tandem.engine.generation import Generation

log = logging.getLogger("tandem.engine")

SETTLE_ROWS = 16  # positions a piece of idle settling recomputes: ~0.25 s of the 1.5B target on 2 CPU cores


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Placement:
    slot: int
    reuse: int  # leading prompt tokens whose KV the slot holds (after any copy)
    copy_from: int | None  # slot to copy those positions from first, or None
    own: int  # leading prompt tokens the slot itself holds (before any copy)


class SlotTable:
    """Owner of the slot -> contents bookkeeping. `contents(slot)` gives the tokens whose KV the slot holds."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.free: set[int] = set(range(slots))
        self._contents: list[list[int]] = [[] for _ in range(slots)]
        self._busy: dict[int, Seq[int]] = {}  # slot -> the running sequence's tokens (a live list)
        self._clock = itertools.count()
        self._used = [0] * slots  # last use, for LRU

    def contents(self, slot: int) -> Seq[int]:
        return self._busy.get(slot, self._contents[slot])

    def place(self, prompt: Seq[int], can_copy: bool) -> Placement | None:
        """Pick a free slot for prompt (None if none is free). At least one prompt token is always left to feed:
        the forward over it gives the first token's logits."""
        if not self.free:
            return None
        limit = len(prompt) - 1
        ranked = sorted(self.free, key=lambda s: (-min(common_prefix(self.contents(s), prompt), limit), self._used[s]))
        slot = ranked[0]
        own = reuse = min(common_prefix(self.contents(slot), prompt), limit)
        copy_from = None
        if can_copy:
            for other in range(self.slots):
                shared = min(common_prefix(self.contents(other), prompt), limit)
                if other != slot and shared > reuse:
                    reuse, copy_from = shared, other
        return Placement(slot, reuse, copy_from, own)

    def occupy(self, slot: int, tokens: Seq[int]) -> None:
        self.free.discard(slot)
        self._busy[slot] = tokens
        self._used[slot] = next(self._clock)

    def release(self, slot: int, valid: int) -> None:
        """The sequence in slot ended; its first `valid` tokens' KV stays for reuse."""
        tokens = self._busy.pop(slot)
        self._contents[slot] = list(tokens[:valid])
        self._used[slot] = next(self._clock)
        self.free.add(slot)

    def by_age(self) -> list[int]:
        """The free slots, least recently used first."""
        return sorted(self.free, key=self._used.__getitem__)

    def refill(self, slot: int, tokens: Seq[int]) -> None:
        """A free slot now holds these tokens' KV (Settler: a reply's pending token taken in)."""
        self._contents[slot] = list(tokens)

    def forget(self, slot: int, keep: int) -> None:
        """Only the first `keep` tokens of a free slot's contents are still valid (its cache was rewound)."""
        self._contents[slot] = self._contents[slot][:keep]


class Settler:
    """Free slots whose KV a new prompt could not keep in full (BatchedCache.reusable: on llama.cpp's repacked CPU
    weights a reply's rows came from another kernel than a prompt's), recomputed a piece at a time while the server
    is idle (BatchedCache.settle), so that the next turn of a conversation feeds only its new tokens."""

    def __init__(self, table: SlotTable, kv: BatchedCache, rows: int = SETTLE_ROWS) -> None:
        self.table, self.kv, self.rows = table, kv, rows
        self._slots: dict[int, tuple[list[int], int]] = {}  # slot -> (its tokens, the reusable part when it ended)

    @property
    def pending(self) -> bool:
        return bool(self._slots)

    def retired(self, slot: int, tokens: list[int]) -> None:
        """The sequence in slot ended; tokens: all of its tokens, the pending one too (a next turn holds it)."""
        held = self.kv.length(slot)
        kept, tokens = self.kv.reusable(slot, held), tokens[: held + 1]  # a prompt cut short is not fed on
        if len(tokens) - kept >= self.kv.prefill_align > 1:
            self._slots[slot] = (tokens, kept)
        else:
            self._slots.pop(slot, None)

    def step(self) -> bool:
        """Settle one piece of one slot; False when there was nothing left to settle."""
        while self._slots:
            slot, (tokens, kept) = next(iter(self._slots.items()))
            held = self.kv.length(slot)
            # A slot taken since, or rewound below what it kept (a cost timing, forget_prefixes), is left as it is.
            if slot not in self.table.free or self.kv.reusable(slot, held) < kept or \
                    list(self.table.contents(slot)) != tokens[:held]:
                del self._slots[slot]
                continue
            try:
                left = self.kv.settle(slot, tokens, self.rows)
            except Exception:
                del self._slots[slot]
                raise
            finally:  # a forward that failed forgot its positions: the table says what the slot still holds
                self.table.refill(slot, tokens[: self.kv.length(slot)])
            if left:
                self._slots[slot] = (tokens, self.kv.reusable(slot, self.kv.length(slot)))
            else:
                del self._slots[slot]
            return True
        return False


class KVSlots:
    """The engine's KV: the target's batched cache, the draft's (a drafter's, where it has one) and which prompt each
    slot holds. Owns placing a sequence in a slot, keeping its accepted tokens, and what a slot keeps after it."""

    def __init__(self, target: BatchedCache, drafter, slots: int) -> None:
        self.target, self.drafter, self.table = target, drafter, SlotTable(slots)
        self.settler = Settler(self.table, target)  # the rows ended replies left, recomputed while idle

    @property
    def has_free(self) -> bool:
        return bool(self.table.free)

    def place(self, gen: Generation) -> None:
        """gen takes a free slot, reusing what prompt prefix a slot holds (its own, or copied from another where the
        backend copies KV); it feeds the rest of its prompt from gen.fed."""
        kv = self.target
        placement = self.table.place(gen.request.prompt, kv.can_copy)
        slot = placement.slot
        own = kv.reusable(slot, min(placement.own, kv.length(slot)))
        reuse, source = own, None
        if placement.copy_from is not None:
            copied = kv.reusable(placement.copy_from, min(placement.reuse, kv.length(placement.copy_from)))
            if copied > own:
                source = placement.copy_from
                kv.copy_prefix(source, slot, copied)
                reuse = copied
        kv.rewind(slot, min(reuse, kv.length(slot)))
        if self.drafter is not None:
            self.drafter.place(slot, own, source, reuse)
        gen.slot, gen.fed = slot, reuse
        gen.stats.cached_tokens = reuse
        self.table.occupy(slot, gen.tokens)

    def extend(self, gen: Generation, new_tokens: list[int]) -> None:
        """gen keeps new_tokens: its slot holds every token but the new pending one (rewound past what the verifier
        rejected, or a run computed past a stop), its draft's likewise."""
        self.target.rewind(gen.slot, len(gen.tokens) + len(new_tokens) - 1)
        gen.tokens += new_tokens
        if self.drafter is not None:
            self.drafter.settle(gen)

    def room(self, gen: Generation) -> int:
        """Positions left in gen's slot."""
        return self.target.capacity - self.target.length(gen.slot)

    def release(self, gen: Generation) -> None:
        """gen left the batch; its slot keeps the KV of its tokens for a later prompt to reuse."""
        self.table.release(gen.slot, self.target.length(gen.slot))
        self.settler.retired(gen.slot, gen.tokens)

    def scratch_slots(self) -> list[int]:
        """The free slots, least recently used first: where a cost timing overwrites the least worth keeping."""
        return self.table.by_age()

    def forget_emptied(self) -> None:
        """The slot table told what cost timings left of the free slots' kept prompts (they rewind what they use)."""
        for slot in self.table.free:
            self.table.forget(slot, self.target.length(slot))

    def forget_prefixes(self) -> None:
        """Empty every free slot, so that the next requests reuse no prompt an earlier one left (benchmarks: a
        prompt timed again must be read again)."""
        for slot in self.table.free:
            self.target.rewind(slot, 0)
            if self.drafter is not None:
                self.drafter.kv.rewind(slot, 0)


def fit_slots(models: Seq[Model], slots: int, n_ctx: int, budget_bytes: int | None, fraction: float) -> int:
    """Slots whose KV (every model's, n_ctx tokens each) fits the budget (default: `fraction` of the device's free
    memory): at most `slots`, at least one, or an error saying what one context needs."""
    per_slot = sum(m.kv_bytes_per_token() for m in models) * n_ctx
    explicit = budget_bytes is not None
    budget = budget_bytes if explicit else default_kv_budget(models[0], fraction)
    if budget is None:
        return slots
    fit = budget // per_slot
    if fit < 1:
        raise ValueError(f"a KV budget of {budget / 2**20:.0f} MiB holds no context of {n_ctx} tokens: one sequence "
                         f"needs {per_slot / 2**20:.0f} MiB; raise the budget or lower n_ctx")
    if fit < slots:
        log.warning("KV budget %.0f MiB holds %d contexts of %d tokens: %d slots, not %d", budget / 2**20, fit,
                    n_ctx, fit, slots)
    return min(slots, fit)


def default_kv_budget(model: Model, fraction: float) -> int | None:
    """`fraction` of the free memory of the model's device (None where unknown)."""
    device = torch.device(getattr(model, "torch_device", "cpu"))
    if device.type == "cuda":
        return int(fraction * torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return int(fraction * available)
