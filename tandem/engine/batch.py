"""The engine's generations: those waiting for a slot, in arrival order, and those running, which share each step."""

from __future__ import annotations

from collections import deque

from tandem.engine.generation import Generation
from tandem.engine.kv_pool import KVSlots


class Batch:
    """Who waits and who runs; admission into free slots, and which prompt rows a step takes."""

    def __init__(self) -> None:
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def queue(self, gen: Generation) -> None:
        self.waiting.append(gen)

    def cancel(self, gen: Generation) -> None:
        """A waiting generation leaves the queue now; a running one is marked, to leave at the next step."""
        gen.cancelled = True
        if gen in self.waiting:
            self.waiting.remove(gen)

    def cancelled(self) -> list[Generation]:
        return [g for g in self.running if g.cancelled]

    def admit(self, kv: KVSlots) -> list[Generation]:
        """Waiting generations take the free slots, first come first placed; returns those admitted."""
        admitted = []
        while self.waiting and kv.has_free:
            gen = self.waiting.popleft()
            kv.place(gen)
            self.running.append(gen)
            admitted.append(gen)
        return admitted

    def leave(self, gen: Generation) -> None:
        self.running.remove(gen)

    def decoding(self) -> list[Generation]:
        return [g for g in self.running if not g.prefilling]

    def prompt_chunks(self, budget: int, align: int) -> list[tuple[Generation, list[int]]]:
        """This step's prompt rows per prefilling generation, `budget` rows in all, in admission order; a chunk
        that does not end its prompt ends on the backend's alignment."""
        prefills = []
        for gen in self.running:
            if gen.prefilling and budget > 0:
                remaining = gen.prompt_len - gen.fed
                n = min(remaining, budget)
                if n < remaining:
                    n = max(n - n % align, min(align, remaining))
                rows = gen.tokens[gen.fed : gen.fed + n]
                prefills.append((gen, rows))
                budget -= len(rows)
        return prefills
