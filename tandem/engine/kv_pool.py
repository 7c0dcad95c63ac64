"""Which KV slot a request gets, and how much of its prompt is already there.

Each slot of the engine's caches (target and draft alike) keeps what its last sequence left in it after that
sequence ends: the next request whose prompt starts the same way (the next turn of a conversation, a shared system
prompt) feeds only the rest. A new request takes the free slot holding the longest common prefix, ties to the least
recently used; where a busy or other slot holds a longer one and the backend can copy KV, that prefix is copied
over. Least recently used contents are what gets overwritten first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass


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

    def forget(self, slot: int, keep: int) -> None:
        """Only the first `keep` tokens of a free slot's contents are still valid (its cache was rewound)."""
        self._contents[slot] = self._contents[slot][:keep]
