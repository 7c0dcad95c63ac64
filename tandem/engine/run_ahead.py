"""Plain decode steps queued ahead of the host: a lone sequence's plain stretch without a host sync a step.

Each step's input is the previous step's output, still on the device, so the host queues a step before the one
before it has run and the GPU never waits for Python between steps (docs/decisions/0007). Each token is copied
back as it lands, QUEUE_DEPTH steps behind the queue, so a stop token ends the run with at most QUEUE_DEPTH - 1
steps computed past it, and dropped.
"""

from __future__ import annotations

import torch

from tandem.backends.base import BatchedCache
from tandem.engine.generation import Generation
from tandem.engine.outcomes import verify
from tandem.sampling import argmax

RUN_AHEAD = 8  # plain steps a run queues at most (where the device runs asynchronously of the host)
LOOKUP_RUN_AHEAD = 4  # ... for a sequence whose text prompt lookup watches: a copy that starts is found soon
QUEUE_DEPTH = 3  # steps queued ahead of the one whose token the host waits for


class RunAhead:
    """Queues up to `steps` plain steps of one slot and reads their tokens back; owns the pinned landing buffer."""

    def __init__(self, device: torch.device, depth: int = RUN_AHEAD) -> None:
        self.device = device
        if device.type == "cuda":  # into pinned memory, or each copy would wait for the queue to drain
            self._landing = torch.empty(depth, dtype=torch.long, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(depth)]

    def run(self, cache: BatchedCache, gen: Generation, steps: int) -> tuple[list[int], int]:
        """Feed gen's pending token and the tokens it leads to, up to `steps` forwards into its slot; returns (new
        tokens, forwards run). The tokens end at the first stop token; the slot then holds forwards' worth of
        tokens past its length before (the caller rewinds what it does not keep). A sampled step is the engine's
        plain step (verify with no drafts, on gen's generator), so a seed gives the same tokens either way."""
        landed: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        token = torch.tensor(gen.tokens[-1:], dtype=torch.long, device=self.device)
        no_drafts = torch.empty(0, dtype=torch.long, device=self.device)

        def queue(token: torch.Tensor) -> torch.Tensor:
            logits = cache.step_on_device(gen.slot, token)  # [1, V]
            if gen.sampling.greedy:
                token = argmax(logits).view(1)
            else:
                token = verify(gen, no_drafts, None, logits)[1].view(1)
            if self.device.type == "cuda":
                at = len(landed)
                host, event = self._landing[at : at + 1], self._events[at]
                host.copy_(token, non_blocking=True)
                event.record()
                landed.append((host, event))
            else:
                landed.append((token, None))
            return token

        for _ in range(min(steps, QUEUE_DEPTH)):
            token = queue(token)
        new_tokens: list[int] = []
        while len(new_tokens) < len(landed):
            host, event = landed[len(new_tokens)]
            if event is not None:
                event.synchronize()
            new_tokens.append(int(host))
            if new_tokens[-1] in gen.stop_token_ids:
                break
            if len(landed) < steps:
                token = queue(token)
        return new_tokens, len(landed)


class DeviceSpan:
    """The device's time between two points of the host's queue (CUDA events, read after a host sync past the
    second): what work the host queued without waiting for it took, e.g. a lone sequence's drafts."""

    def __init__(self) -> None:
        self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> None:
        self._end.record()

    def ms(self) -> float:
        return self._start.elapsed_time(self._end)
