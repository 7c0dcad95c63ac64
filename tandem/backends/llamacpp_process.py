"""The llama.cpp worker process, both ends of its pipe: `WorkerProcess` starts it and sends it requests (the parent's
side); `worker_main` serves them (the child's side, `python -m tandem.backends.llamacpp_process`), holding
llama.cpp's objects by handle (llamacpp_core). llamacpp_worker's models and caches are its clients.

Transport. Requests are small tuples pickled over a Unix socket pair (token ids, positions, slot numbers); logits
come back through one shared buffer (an unlinked file, mapped by both processes, grown with ftruncate when a
forward needs more rows) that the worker writes straight from llama.cpp's output and the parent copies once into
the tensor it returns: no logits are pickled. The child imports only this module, llamacpp_core, numpy and
llama_cpp: never torch (llamacpp_worker's docstring says why).
"""

from __future__ import annotations

if __name__ == "__main__":
    # The worker loads llama.cpp's libraries before numpy: on the H200 box a CUDA libllama loaded after numpy (as
    # after torch) segfaulted in llama_model_load's print_info, and loaded first it runs (h200-2026-12-05 results).
    import llama_cpp.llama_cpp  # noqa: F401

import functools
import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Connection

import numpy as np

log = logging.getLogger("tandem.llamacpp")

FLOAT32 = 4  # bytes
BATCHED_REQUESTS = ("batch_forward", "batch_greedy_drafts", "batch_feed", "batch_synchronize", "reusable",
                    "settle", "copy_prefix")  # name a batched cache


# --- the parent's side ----------------------------------------------------------------------------------------------


class WorkerDiedError(RuntimeError):
    """The llama.cpp worker process is gone; every model it held is unusable."""


class WorkerProcess:
    """The child process running llama.cpp, its socket and the shared logits buffer; one per parent process."""

    _shared: WorkerProcess | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> WorkerProcess:
        with cls._shared_lock:
            if cls._shared is None or cls._shared.dead is not None:
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._buffer_file = tempfile.TemporaryFile(dir=shm_dir)  # unlinked: gone with both processes
        self._buffer_bytes = 0
        self._buffer: mmap.mmap | None = None
        fds = (child.fileno(), self._buffer_file.fileno())
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tandem.backends.llamacpp_process", *map(str, fds)],
            pass_fds=fds, stdin=subprocess.DEVNULL)
        child.close()
        self._conn = Connection(parent.detach())
        self._lock = threading.Lock()
        self.dead: str | None = None  # how it died, once it has
        self.models = 0  # open WorkerModels on it; the worker exits when the last closes

    @property
    def pid(self) -> int:
        return self.process.pid

    def rows(self, count: int, vocab: int) -> np.ndarray:
        """A view [count, vocab] of the shared buffer, grown first where it is too small."""
        need = max(count * vocab * FLOAT32, 1)
        if need > self._buffer_bytes:
            size = max(need, 2 * self._buffer_bytes)
            os.ftruncate(self._buffer_file.fileno(), size)
            # the old mapping unmaps when the last view of it goes (closing it under a live view would raise)
            self._buffer = mmap.mmap(self._buffer_file.fileno(), size)
            self._buffer_bytes = size
        return np.ndarray((count, vocab), dtype=np.float32, buffer=self._buffer)

    def call(self, *request, rows: tuple[int, int] | None = None):
        """Send a request and wait for its reply; rows=(count, vocab) makes room for that many logits rows first
        and returns them (copied) with the reply."""
        with self._lock:
            if self.dead is not None:
                raise WorkerDiedError(self.dead)
            view = self.rows(*rows) if rows is not None else None
            try:
                self._conn.send((*request, self._buffer_bytes))
                reply = self._conn.recv()
            except (EOFError, OSError, pickle.UnpicklingError) as e:
                self.dead = self._death(request[0], e)
                log.error("%s", self.dead)
                raise WorkerDiedError(self.dead) from None
            if reply[0] == "error":
                _, kind, message = reply
                raise (ValueError if kind == "ValueError" else RuntimeError)(message)
            return reply[1] if view is None else (reply[1], np.array(view[: rows[0]]))

    def _death(self, doing: str, error: Exception) -> str:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        how = f"exit status {code}" if code >= 0 else f"signal {-code} ({signal.Signals(-code).name})"
        return (f"the llama.cpp worker process (pid {self.pid}) died ({how}) during {doing!r}: its models are "
                f"gone; restart the server or load them again")

    def close(self) -> None:
        """Ask the worker to exit and wait for it (it also exits on its own when this process closes the socket)."""
        if self.dead is None:
            try:
                with self._lock:
                    self._conn.send(("exit", 0))
            except OSError:
                pass
        self._conn.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._buffer = None
        self._buffer_file.close()
        self.dead = self.dead or "closed"


# --- the worker's side ----------------------------------------------------------------------------------------------


class _Worker:
    """Objects by handle, and the request handlers; runs in the child process."""

    def __init__(self, buffer_fd: int) -> None:
        self.objects: dict[int, object] = {}
        self.next_handle = 1
        self.buffer_fd = buffer_fd
        self.buffer: mmap.mmap | None = None
        self.buffer_bytes = 0
        self.scratch = None  # rows read here and never shared (llamacpp_core.ReusedRows), made on first use

    def allocate(self, rows: int, vocab: int) -> np.ndarray:
        return np.ndarray((rows, vocab), dtype=np.float32, buffer=self.buffer)

    def map_buffer(self, size: int) -> None:
        if size > self.buffer_bytes:
            self.buffer = mmap.mmap(self.buffer_fd, size)
            self.buffer_bytes = size

    def add(self, obj: object) -> int:
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.objects[handle] = obj
        return handle

    def handle(self, op: str, *args):
        from tandem.backends import llamacpp_core as core
        from tandem.backends.llamacpp_batched import BatchedForward

        if op == "load":
            path, vocab_size, options = args
            weights = core.LlamaCppWeights(path, vocab_size, **options)
            return self.add(weights), {"n_threads": weights.n_threads, "k_q8": weights.k_q8,
                                       "repacked": weights.repacked,
                                       "device_description": weights.device_description}
        if op == "sequence":
            model, capacity, n_batch, exact = args
            weights = self.objects[model]
            return self.add(core.SequenceForward(weights, weights.context(capacity, n_batch), capacity, exact))
        if op == "batched":
            model, slots, capacity, n_batch, exact = args
            cache = BatchedForward(self.objects[model], slots, capacity, n_batch, exact)
            return self.add(cache), cache.prefill_align
        if op == "forward":
            handle, ids, last = args
            self.objects[handle].forward(ids, last, self.allocate)
            return None
        if op in BATCHED_REQUESTS:  # on a batched cache: the rewinds the parent kept for it first
            handle, rewinds, *args = args
            cache = self.objects[handle]
            for slot, length in rewinds.items():
                cache.rewind(slot, length)
        if op == "batch_forward":  # the picked entries' argmax in the reply; with every one picked, no rows shared
            batch, last_only, picks, beside = args
            alongside = None
            if beside is not None:  # another cache's feed, launched before this forward's rows are read
                other = self.objects[beside[0]]
                for slot, length in beside[1].items():
                    other.rewind(slot, length)
                alongside = functools.partial(other.feed, beside[2])
            self.scratch = self.scratch or core.ReusedRows()
            rows = cache.forward(batch, last_only, self.scratch if all(picks) else self.allocate, alongside)
            return {i: core.argmax_rows(r).tolist() for i, (r, pick) in enumerate(zip(rows, picks, strict=True))
                    if pick}
        if op == "rewind":
            return self.objects[args[0]].rewind(args[1])
        if op == "head":  # a head draft over a target's batched cache (llamacpp_head)
            from tandem.backends.llamacpp_head import drafts_for

            head, target, config = args
            return self.add(drafts_for(config, self.objects[head], self.objects[target]))
        if op == "head_step":  # the target's rewinds first: the head drafts at its length
            handle, target, rewinds, forgotten, entries = args
            for slot, length in rewinds.items():
                self.objects[target].rewind(slot, length)
            drafts = self.objects[handle]
            for slot, length in forgotten.items():
                drafts.forget(slot, length)
            drafts.step(entries, self.allocate)
            return None
        if op == "batch_greedy_drafts":
            feeds, counts, vocab_limit, steady, floors = args
            drawn, forwards = cache.greedy_drafts(feeds, counts, vocab_limit, steady, floors)
            return drawn, forwards, {slot: cache.lengths[slot] for feed in feeds for slot, _ in feed}
        if op == "batch_feed":
            return cache.feed(*args)
        if op == "batch_synchronize":
            return cache.synchronize()
        if op == "reusable":
            return cache.reusable(*args)
        if op == "settle":
            return cache.settle(*args), cache.lengths[args[0]]
        if op == "copy_prefix":
            return cache.copy_prefix(*args)
        if op == "close":
            obj = self.objects.pop(args[0])
            if isinstance(obj, core.SequenceForward):
                obj.weights.release(obj.context)
            else:
                obj.close()
            return None
        if op == "imports":  # tests: what this process has loaded, in the order it loaded them
            return [name for name in sys.modules if name in ("torch", "numpy", "llama_cpp.llama_cpp")]
        if op == "crash":  # tests: die as llama.cpp would, mid-request
            os.kill(os.getpid(), signal.SIGSEGV)
        raise ValueError(f"unknown request {op!r}")


def worker_main(socket_fd: int, buffer_fd: int) -> int:
    """Serve requests until the parent says exit or goes away."""
    conn = Connection(socket_fd)
    worker = _Worker(buffer_fd)
    while True:
        try:
            *request, buffer_bytes = conn.recv()
        except (EOFError, OSError):
            return 0
        if request[0] == "exit":
            return 0
        worker.map_buffer(buffer_bytes)
        try:
            reply = ("ok", worker.handle(*request))
        except Exception as e:  # noqa: BLE001  (the parent re-raises it; the worker keeps serving)
            reply = ("error", "ValueError" if isinstance(e, ValueError) else type(e).__name__, str(e))
        conn.send(reply)


if __name__ == "__main__":
    if "torch" in sys.modules:  # the point of this process (module docstring)
        raise SystemExit("tandem's llama.cpp worker must not import torch")
    sys.exit(worker_main(int(sys.argv[1]), int(sys.argv[2])))
