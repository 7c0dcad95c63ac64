"""Phase timing that never adds a host synchronisation.

On CUDA the marks are events recorded in the stream; they are read only after the decode loop's one sync per
iteration, when every marked kernel has finished. On synchronous backends (CPU torch, llama.cpp) a mark is the
wall clock.
"""

from __future__ import annotations

import time

import torch


class PhaseClock:
    def __init__(self, device: torch.device | str | None) -> None:
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans_ms(self) -> list[float]:
        """Milliseconds between consecutive marks, once the last has been reached. Clears the marks."""
        if self.cuda:
            if self.marks:
                self.marks[-1].synchronize()
            spans = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        else:
            spans = [1000.0 * (b - a) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        self.marks = []
        return spans
