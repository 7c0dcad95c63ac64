"""One worker thread that owns every model call, a bounded FIFO queue in front of it, and N decode slots.

The models are not thread-safe, so all model work happens on this one thread. Each request is a `Job` whose
generation is a `tandem.stream_generate` iterator: it owns its own SpeculativeDecoder and KV sequences, so requests
share no cache state, and closing the iterator frees its sequences. The worker keeps up to `slots` generations
active and advances them round-robin, one decode iteration each, so concurrent streams all progress (slots=1 is
strictly serial). Admission is first come, first served.

Chunks go back to the event loop with `loop.call_soon_threadsafe` into the job's asyncio.Queue; a client that goes
away marks its job cancelled, and the worker closes that generation at its next turn.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tandem.api import GenerationChunk
from tandem.spec.stats import GenerationStats

log = logging.getLogger("tandem.server")

IDLE_WAIT_S = 1.0  # the worker re-checks for shutdown this often when there is nothing to do


class QueueFullError(Exception):
    """The queue holds max_queue waiting jobs already."""


class ShuttingDownError(Exception):
    """The scheduler no longer takes jobs."""


@dataclass
class Event:
    """One message from the worker to a request: a chunk (the last has finish_reason and stats) or an error."""

    chunk: GenerationChunk | None = None
    error: BaseException | None = None


@dataclass
class Job:
    """A request's generation. `start` is called on the worker thread and returns the chunk iterator."""

    start: Callable[[], Iterator[GenerationChunk]]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    enqueued_at: float = field(default_factory=time.perf_counter)
    queue_ms: float = 0.0  # time from submit to admission into a slot
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, event: Event) -> None:
        """Hand an event to the job's event loop (callable from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()


@dataclass
class _Active:
    job: Job
    generation: Iterator[GenerationChunk]


class Scheduler:
    """FIFO queue + worker thread. `submit` from the event loop; `cancel` from anywhere."""

    def __init__(self, slots: int = 1, max_queue: int = 64,
                 on_finish: Callable[[GenerationStats, float], None] | None = None,
                 on_cancel: Callable[[], None] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.slots, self.max_queue = slots, max_queue
        self.on_finish, self.on_cancel = on_finish, on_cancel
        self._waiting: deque[Job] = deque()
        self._active: list[_Active] = []  # touched only by the worker; others read its length
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_count(self) -> int:
        return len(self._active)

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tandem-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking jobs, close the active generations and fail the waiting ones."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue a job; raises QueueFullError when max_queue jobs already wait."""
        with self._cond:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if it still waits, else the worker closes it at its next turn."""
        if job.cancelled.is_set():
            return
        job.cancelled.set()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                pass

    # --- the worker thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._active:
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    break
                while self._waiting and len(self._active) < self.slots:
                    self._admit(self._waiting.popleft())
            for active in list(self._active):
                self._step(active)
        self._shutdown()

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        job.queue_ms = 1000.0 * (time.perf_counter() - job.enqueued_at)
        try:
            self._active.append(_Active(job, job.start()))
        except Exception as e:  # noqa: BLE001  (a bad job must not stop the worker)
            job.send(Event(error=e))

    def _step(self, active: _Active) -> None:
        """Advance one generation by one decode iteration and hand its chunk over."""
        job = active.job
        if job.cancelled.is_set():
            self._retire(active)
            if self.on_cancel:
                self.on_cancel()
            return
        try:
            chunk = next(active.generation)
        except StopIteration:  # stream_generate always ends with a final chunk; be safe anyway
            self._retire(active)
            job.send(Event(error=RuntimeError("the generation ended without a final chunk")))
            return
        except Exception as e:  # noqa: BLE001  (reported to this request only; the worker serves the rest)
            self._retire(active)
            if not isinstance(e, ValueError):
                log.exception("generation failed")
            job.send(Event(error=e))
            return
        job.send(Event(chunk=chunk))
        if chunk.finish_reason is not None:
            self._retire(active)
            if self.on_finish and chunk.stats is not None:
                try:
                    self.on_finish(chunk.stats, job.queue_ms)
                except Exception:  # noqa: BLE001  (metrics must never take the worker down)
                    log.exception("recording metrics failed")

    def _retire(self, active: _Active) -> None:
        """Close the generation (which frees its KV sequences) and free its slot."""
        self._active.remove(active)
        try:
            active.generation.close()
        except Exception:  # noqa: BLE001
            log.exception("closing a generation failed")

    def _shutdown(self) -> None:
        for active in list(self._active):
            self._retire(active)
            active.job.send(Event(error=ShuttingDownError("the server is shutting down")))
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            job.send(Event(error=ShuttingDownError("the server is shutting down")))
