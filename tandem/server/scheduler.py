"""One worker thread that owns every model call: a bounded FIFO queue in front of the batched engine.

The models are not thread-safe, so all model work happens on this one thread. It hands waiting jobs to the engine
(tandem.engine.Engine) while the engine has a free slot, then runs engine steps: every admitted request advances in
the same batched forward, new requests join at step boundaries, finished and cancelled ones leave at once (their
slot keeps its KV for a later prompt with the same prefix). Admission is first come, first served; `max_queue`
jobs may wait for a slot, one more is refused (the server answers 503).

Chunks go back to the event loop with `loop.call_soon_threadsafe` into the job's asyncio.Queue, a step's chunks in
one call; a client that goes away marks its job cancelled, and the worker drops it from the batch at its next step.

Work that can wait (`when_idle`: measuring the engine's costs in full, building the grammar library's view of the
vocabulary) runs a piece at a time while no job waits or runs, so a server answers before it is done.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.engine import Engine, GenerationChunk, Request
from tandem.engine.generation import Generation
from tandem.server.metrics import StepClock
from tandem.speculative.stats import GenerationStats

log = logging.getLogger("tandem.server")

IDLE_WAIT_S = 1.0  # the worker re-checks for shutdown this often when there is nothing to do
QUIET_S = 1.0  # idle work waits for this long without requests: not the gaps between a client's back-to-back ones
SETTLE_QUIET_S = 0.2  # settling ended replies (KVSlots.settler) waits this long: it is the next turn's own work

IdleTask = Callable[[], float | None]  # one piece of work; seconds until the next piece is due, None when done


class QueueFullError(Exception):
    """The queue holds max_queue waiting jobs already."""


class ShuttingDownError(Exception):
    """The scheduler no longer takes jobs."""


@dataclass
class Event:
    """One message from the worker to a request: a chunk (the last has finish_reason and stats) or an error."""

    chunk: GenerationChunk | None = None
    error: BaseException | None = None
    index: int = 0  # the choice (of a request's n) it belongs to


@dataclass
class Job:
    """A request's generation: what to run (`request`) and where its events go (`loop`, `events`). The n choices
    of one request are n jobs sharing one `events` queue; each event carries its job's `index`."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0
    enqueued_at: float = field(default_factory=time.perf_counter)
    queue_ms: float = 0.0  # time from submit to admission into the engine
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, event: Event) -> None:
        """Hand an event to the job's event loop (callable from any thread)."""
        send_all(self.loop, [(self, event)])


def send_all(loop: asyncio.AbstractEventLoop, batch: list[tuple[Job, Event]]) -> None:
    """Hand a step's events to their jobs on `loop` in one wake-up, in order: a wake-up per event (a syscall and a
    GIL hand-off each) cost the worker and the event loop more than the event itself at high concurrency."""
    def deliver() -> None:
        for job, event in batch:
            job.events.put_nowait(replace(event, index=job.index))

    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        for job, _ in batch:
            job.cancelled.set()


class Scheduler:
    """FIFO queue + worker thread driving an Engine. `submit` from the event loop; `cancel` from anywhere."""

    def __init__(self, engine: Engine | None, slots: int = 1, max_queue: int = 64,
                 on_finish: Callable[[GenerationStats, float], None] | None = None,
                 on_cancel: Callable[[], None] | None = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        """engine: None until `attach` (a server answers /health while its models load); jobs wait meanwhile."""
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine, self.slots, self.max_queue = None, slots, max_queue
        self.on_finish, self.on_cancel, self.on_step = on_finish, on_cancel, on_step
        self._waiting: deque[Job] = deque()
        self._calls: deque[tuple[Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._active: dict[int, tuple[Job, Generation]] = {}  # touched only by the worker; others read its length
        self._idle: deque[IdleTask] = deque()  # run by the worker while nothing else is to do (when_idle)
        self._idle_due = 0.0  # time.monotonic() at which the first of them is due
        self._busy_until = 0.0  # time.monotonic() when the worker last had work (QUIET_S)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.clock = StepClock()  # where the steps' wall time goes (exported by ServerMetrics, logged at shutdown)
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: Engine) -> None:
        """Run jobs on `engine`; its slots (which a KV budget may have made fewer) bound the batch."""
        with self._cond:
            self.engine, self.slots = engine, engine.slots
            engine.step_hook = self.clock.engine_step
            self._cond.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_count(self) -> int:
        return len(self._active)

    def has_waiting(self) -> bool:
        """Whether a job or a call waits for the worker (what idle work, running on it, holds back)."""
        return bool(self._waiting or self._calls)

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
        self.submit_all([job])

    def submit_all(self, jobs: list[Job]) -> None:
        """Queue jobs together (a request's n choices): all of them, next to each other so they are admitted into
        the same batch when slots allow, or none (QueueFullError when they would pass max_queue)."""
        with self._cond:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            waiting = len(self._waiting)  # a group larger than max_queue still goes in while it has room to start
            if waiting >= self.max_queue or waiting + len(jobs) > max(self.max_queue, len(jobs)):
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")
            self._waiting.extend(jobs)
            self._cond.notify()

    def call(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """Run fn() on the worker thread, between engine steps (model work that is not a generation, such as
        scoring a prompt: the models are the worker's alone); its result or exception lands in the future."""
        future = loop.create_future()
        with self._cond:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            self._calls.append((fn, future, loop))
            self._cond.notify()
        return future

    def when_idle(self, task: IdleTask) -> None:
        """Run task() on the worker, a piece a call, while no job waits or runs (and no `call`); tasks run one after
        another in the order given. A task that raises is logged and dropped."""
        with self._cond:
            self._idle.append(task)
            # Counted as work now: a server is started to be used, and a timing under way when its first request
            # comes would delay that request.
            self._busy_until = max(self._busy_until, time.monotonic())
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if it still waits, else the worker drops it at its next step."""
        if job.cancelled.is_set():
            return
        job.cancelled.set()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                pass
            self._cond.notify()

    # --- the worker thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    self.clock.paused()
                    wait = self._idle_wait()
                    if wait == 0.0:
                        break
                    self._cond.wait(wait)
                if self._stopping:
                    break
                idle = not self._has_work()
                admitted = []
                while self._waiting and len(self._active) + len(admitted) < self.slots:
                    admitted.append(self._waiting.popleft())
                calls, self._calls = list(self._calls), deque()
            if idle:
                self.clock.paused()
                self._run_idle()
                continue
            for fn, future, loop in calls:
                self._run_call(fn, future, loop)
            adding = time.perf_counter()
            for job in admitted:
                self._admit(job)
            self.clock.added(time.perf_counter() - adding)
            self._step()
            self._busy_until = time.monotonic()
        self._shutdown()

    def _has_work(self) -> bool:
        return self.engine is not None and bool(self._waiting or self._active or self._calls)

    def _idle_wait(self) -> float:
        """Seconds to wait for a job before the first idle work is due (0: it is due), at most IDLE_WAIT_S."""
        if self.engine is None:
            return IDLE_WAIT_S
        dues, settler = [], self._settler()
        if settler is not None and settler.pending:  # the next turn of a conversation is likely its first taker
            dues.append(self._busy_until + SETTLE_QUIET_S)
        if self._idle:
            # A cost timing in the few ms between one client's requests delayed each by it and, with one slot,
            # overwrote the conversation's prompt (docs/decisions/0001).
            dues.append(max(self._idle_due, self._busy_until + QUIET_S))
        if not dues:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(0.0, min(dues) - time.monotonic()))

    def _settler(self):
        """The engine's KVSlots.settler (None for an engine without one: the tests' scripted engines)."""
        return getattr(getattr(self.engine, "kv", None), "settler", None)

    def _run_idle(self) -> None:
        """A piece of idle work: settling ended replies first, then the first idle task. Sequences the engine still
        holds were cancelled (a job leaves the scheduler at once, the engine at its next step): one step retires
        them first, freeing their slots."""
        if self.engine.busy:
            self.engine.step()
        settler = self._settler()
        if settler is not None and settler.pending:
            try:
                settler.step()
            except Exception:  # noqa: BLE001  (as an idle task's failure: the slot is left as it is)
                log.exception("settling a finished reply's KV failed; the server carries on without it")
            return
        task = self._idle[0]
        try:
            wait = task()
        except Exception:  # noqa: BLE001  (idle work must never take the worker down)
            log.exception("background work failed; the server carries on without it")
            wait = None
        with self._cond:
            if wait is None:
                self._idle.popleft()
                self._idle_due = 0.0
            else:
                self._idle_due = time.monotonic() + wait

    @staticmethod
    def _run_call(fn: Callable[[], Any], future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        def settle(result: Any, error: BaseException | None) -> None:
            if future.cancelled():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001  (handed to the caller; the worker carries on)
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits for it
            pass

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        job.queue_ms = 1000.0 * (time.perf_counter() - job.enqueued_at)
        try:
            gen = self.engine.add(job.request)
        except Exception as e:  # noqa: BLE001  (a bad job must not stop the worker)
            job.send(Event(error=e))
            return
        self._active[gen.id] = (job, gen)

    def _step(self) -> None:
        """One engine step for every active job; hand each its chunk."""
        for job, gen in list(self._active.values()):
            if job.cancelled.is_set():
                self._retire(gen)
                if self.on_cancel:
                    self.on_cancel()
        if not self._active:
            return
        try:
            if self.on_step:
                self.on_step(len(self._active))
            started = time.perf_counter(), time.thread_time()
            events = self.engine.step()
            self.clock.stepped(started, (time.perf_counter(), time.thread_time()))
        except Exception as e:  # noqa: BLE001  (a failed step fails the batch's requests, never the worker)
            log.exception("an engine step failed")
            for job, gen in list(self._active.values()):
                self._retire(gen)
                job.send(Event(error=e))
            return
        sends: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
        for gen, chunk in events:
            job, _ = self._active.get(gen.id, (None, None))
            if job is None:
                continue
            sends.setdefault(job.loop, []).append((job, Event(chunk=chunk)))
            if chunk.finish_reason is not None:
                del self._active[gen.id]
                if self.on_finish and chunk.stats is not None:
                    try:
                        self.on_finish(chunk.stats, job.queue_ms)
                    except Exception:  # noqa: BLE001  (metrics must never take the worker down)
                        log.exception("recording metrics failed")
        for loop, batch in sends.items():
            send_all(loop, batch)

    def _retire(self, gen: Generation) -> None:
        """Drop the generation from the batch (its slot frees at the engine's next step)."""
        self._active.pop(gen.id, None)
        self.engine.cancel(gen)

    def _shutdown(self) -> None:
        if self.clock.steps:
            log.info("steps served: %s", self.clock.summary())
        for job, gen in list(self._active.values()):
            self._retire(gen)
            job.send(Event(error=ShuttingDownError("the server is shutting down")))
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            calls, self._calls = list(self._calls), deque()
        for job in waiting:
            job.send(Event(error=ShuttingDownError("the server is shutting down")))
        for _fn, future, loop in calls:
            self._run_call(_shutting_down, future, loop)


def _shutting_down() -> None:
    raise ShuttingDownError("the server is shutting down")
