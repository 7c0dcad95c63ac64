"""The llama.cpp backend in a worker process: the same Model, Sequence and BatchedCache, llama.cpp out of process.

Why: a CUDA build of llama.cpp and torch's CUDA libraries crash in one process (llama-cpp-python loads libllama
with RTLD_GLOBAL; libggml-cuda links the system's CUDA runtime and cuBLAS, torch brings its own: docs/backends.md).
Here llama.cpp lives in a child process that never imports torch (`python -m tandem.backends.llamacpp_worker`,
which imports only llamacpp_core, numpy and llama_cpp), and the engine cannot tell: `WorkerModel` is a `Model`.

Transport. Requests are small tuples pickled over a Unix socket pair (token ids, positions, slot numbers); logits
come back through one shared buffer (an unlinked file, mapped by both processes, grown with ftruncate when a
forward needs more rows) that the worker writes straight from llama.cpp's output and the parent copies once into
the tensor it returns: no logits are pickled. Greedy sequences need no logits at all: a step's drafting runs here
in one request (greedy_drafts) and a verify's rows come back as their argmax (forward_picking); a batched cache's
rewinds ride on its next request. One worker serves every model of the process (target and draft: one
CUDA context, and on a CPU no second OpenMP team spinning beside the first); requests are serialised by a lock.

A dead worker (a crash in llama.cpp, a kill) fails the request in flight and every later one with WorkerDiedError,
saying how it died, and logs it once; nothing waits on it.

When: `isolation="process"` (load option, `--llamacpp-isolation process`, or TANDEM_LLAMACPP_WORKER=1), and by
default (`auto`) where the installed llama.cpp is a CUDA build and torch has CUDA too. TANDEM_LLAMACPP_WORKER=0
keeps llama.cpp in process.
"""

from __future__ import annotations

if __name__ == "__main__":
    # The worker loads llama.cpp's libraries before numpy: on the H200 box a CUDA libllama loaded after numpy (as
    # after torch) segfaulted in llama_model_load's print_info, and loaded first it runs (h200-2026-12-05 results).
    import llama_cpp.llama_cpp  # noqa: F401

import functools
import importlib.util
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
from collections.abc import Sequence as Seq
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Literal

import numpy as np

from tandem.backends.base import Alongside, BatchedCache, Model, Sequence
from tandem.backends.llamacpp_settings import launches_asynchronously

if TYPE_CHECKING:
    import torch

    from tandem.config import ModelConfig
    from tandem.loading.tokenizer import Tokenizer

log = logging.getLogger("tandem.llamacpp")

WORKER_ENV = "TANDEM_LLAMACPP_WORKER"  # 1: always a worker process; 0: never; unset: as isolation says
ISOLATIONS = ("auto", "process", "none")
CUDA_BACKEND_LIBS = ("libggml-cuda.so", "ggml-cuda.dll", "libggml-cuda.dylib")  # a CUDA build of llama.cpp ships one
FLOAT32 = 4  # bytes
BATCHED_REQUESTS = ("batch_forward", "batch_greedy_drafts", "batch_feed", "batch_synchronize", "reusable",
                    "copy_prefix")  # name a batched cache


# --- when ---------------------------------------------------------------------------------------------------------


def llamacpp_has_cuda() -> bool:
    """Whether the installed llama-cpp-python is a CUDA build, read from its files: loading it is what crashes."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return False
    # LLAMA_CPP_LIB_PATH: llama-cpp-python then loads libllama (and its ggml) from there instead
    libs = [os.environ.get("LLAMA_CPP_LIB_PATH", "")]
    libs += [os.path.join(root, "lib") for root in spec.submodule_search_locations]
    return any(os.path.isdir(lib) and any(name.startswith(CUDA_BACKEND_LIBS) for name in os.listdir(lib))
               for lib in libs if lib)


def torch_has_cuda() -> bool:
    import torch

    return torch.version.cuda is not None


def wants_worker(device: str, isolation: str = "auto") -> bool:
    """Whether llama.cpp should run in a worker process: TANDEM_LLAMACPP_WORKER if set, else `isolation`
    ("process", "none", or "auto": a CUDA device, or a CUDA build of llama.cpp beside a CUDA torch)."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"unknown llama.cpp isolation {isolation!r}; choose one of {', '.join(ISOLATIONS)}")
    env = os.environ.get(WORKER_ENV, "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"{WORKER_ENV} must be 0 or 1, got {env!r}")
        return env == "1"
    if isolation != "auto":
        return isolation == "process"
    # Even with no layer offloaded a CUDA libllama crashed beside CUDA torch (docs/backends.md).
    return device.split(":")[0].lower() == "cuda" or (llamacpp_has_cuda() and torch_has_cuda())


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
            [sys.executable, "-m", "tandem.backends.llamacpp_worker", *map(str, fds)],
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


class WorkerSequence(Sequence):
    def __init__(self, model: WorkerModel, handle: int, capacity: int) -> None:
        self.model, self.handle, self.capacity = model, handle, capacity
        self._length = 0
        self._open = True

    @property
    def length(self) -> int:
        return self._length

    def forward(self, tokens: Seq[int] | torch.Tensor, logits: Literal["all", "last"] = "all") -> torch.Tensor:
        import torch

        self._live()
        ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        self._check_room(len(ids))
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        vocab = self.model.vocab_size
        if not ids:
            return torch.empty((0, vocab), dtype=torch.float32)
        count = 1 if logits == "last" else len(ids)
        _, rows = self.model.worker.call("forward", self.handle, ids, logits == "last", rows=(count, vocab))
        self._length += len(ids)
        return torch.from_numpy(rows)

    def rewind(self, length: int) -> None:
        self._live()
        self._check_rewind(length)
        if length != self._length:
            self.model.worker.call("rewind", self.handle, length)
            self._length = length

    def close(self) -> None:
        if self._open:
            self._open = False
            if self.model.worker.dead is None:
                self.model.worker.call("close", self.handle)

    def _live(self) -> None:
        if not self._open:
            raise RuntimeError("this sequence is closed")


class WorkerBatchedCache(BatchedCache):
    can_copy = True
    drafts_greedy = True

    def __init__(self, model: WorkerModel, slots: int, capacity: int, drafting: bool) -> None:
        self.model, self.slots, self.capacity = model, slots, capacity
        self.handle, self.prefill_align = model.worker.call("batched", model.handle, slots, capacity, model.n_batch,
                                                            not drafting)
        self._lengths = [0] * slots
        # Rewinds not yet sent: they go with the next request on the cache (after a verify each sequence's target
        # and draft slots rewind, 2-4 round trips of their own a drafting step that the next forward carries)
        self._rewinds: dict[int, int] = {}
        self._open = True

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def _call(self, op: str, *args, rows: tuple[int, int] | None = None):
        """A request on this cache, the rewinds since the last one applied first in the worker."""
        return self.model.worker.call(op, self.handle, self._take_rewinds(), *args, rows=rows)

    def _take_rewinds(self) -> dict[int, int]:
        rewinds, self._rewinds = self._rewinds, {}
        return rewinds

    def feed(self, batch: Seq[tuple[int, Seq[int]]]) -> None:
        self._check(batch)
        self._call("batch_feed", [(slot, list(tokens)) for slot, tokens in batch])
        for slot, tokens in batch:
            self._lengths[slot] += len(tokens)

    def overlaps(self, other: BatchedCache) -> bool:
        return isinstance(other, WorkerBatchedCache) and other.model.worker is self.model.worker and \
            launches_asynchronously(self.model.device) and launches_asynchronously(other.model.device)

    def synchronize(self) -> None:
        self._call("batch_synchronize")

    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        return self.forward_picking(batch, last_only, [False] * len(batch))

    def forward_picking(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool], picks: Seq[bool],
                        alongside: Alongside | None = None) -> list[torch.Tensor]:
        """The picked entries' argmax comes back in the reply; the shared buffer's rows are copied only where some
        entry is not picked (then all of them: one copy). A feed alongside goes in the same request."""
        import torch

        self._check(batch)
        batch = [(slot, list(tokens)) for slot, tokens in batch]
        counts = [1 if last else len(tokens) for (_, tokens), last in zip(batch, last_only, strict=True)]
        every = all(picks)
        beside = None
        if alongside is not None and self.overlaps(alongside[0]):
            other, feed = alongside
            other._check(feed)
            beside = (other.handle, other._take_rewinds(), [(slot, list(tokens)) for slot, tokens in feed])
        reply = self._call("batch_forward", batch, list(last_only), list(picks), beside,
                           rows=None if every else (sum(counts), self.model.vocab_size))
        chosen, rows = (reply, None) if every else reply
        for slot, tokens in batch:
            self._lengths[slot] += len(tokens)
        if beside is not None:
            for slot, tokens in alongside[1]:
                other._lengths[slot] += len(tokens)
        elif alongside is not None:
            alongside[0].feed(alongside[1])
        out, at = [], 0
        for i, count in enumerate(counts):
            out.append(torch.tensor(chosen[i], dtype=torch.long) if picks[i] else
                       torch.from_numpy(rows[at : at + count]))
            at += count
        return out

    def greedy_drafts(self, feeds: Seq[Seq[tuple[int, Seq[int]]]], counts: Seq[int], vocab_limit: int,
                      steady: bool) -> tuple[list[list[int]], int]:
        """One round trip a draft step, where a forward a draft token cost one each and a logits copy
        (llamacpp_core.BatchedForward.greedy_drafts)."""
        self._check_feeds(feeds)
        feeds = [[(slot, list(tokens)) for slot, tokens in feed] for feed in feeds]
        drawn, forwards, lengths = self._call("batch_greedy_drafts", feeds, list(counts), vocab_limit, steady)
        for slot, length in lengths.items():
            self._lengths[slot] = length
        return drawn, forwards

    def rewind(self, slot: int, length: int) -> None:
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"cannot rewind slot {slot} to {length}: it holds {self._lengths[slot]} tokens")
        if length < self._lengths[slot]:
            self._rewinds[slot] = self._lengths[slot] = length

    def reusable(self, slot: int, length: int) -> int:
        return self._call("reusable", slot, length) if self.prefill_align > 1 else length

    def copy_prefix(self, src: int, dst: int, length: int) -> bool:
        self._call("copy_prefix", src, dst, length)
        self._lengths[dst] = length
        return True

    def attach_head(self, head: Model) -> WorkerHeadCache:
        if not isinstance(head, WorkerModel) or head.worker is not self.model.worker:
            raise ValueError(f"a head draft must be loaded in its target's worker process (isolation='process'), "
                             f"got {head!r}")
        return WorkerHeadCache(head, self)

    def close(self) -> None:
        if self._open:
            self._open = False
            if self.model.worker.dead is None:
                self.model.worker.call("close", self.handle)


class WorkerHeadCache(BatchedCache):
    """A head draft over a target's cache in the worker (llamacpp_head.HeadDrafts there): a draft step is one round
    trip, the target's pending rewinds applied first, its logits back through the shared buffer."""

    def __init__(self, head: WorkerModel, target: WorkerBatchedCache) -> None:
        self.model, self.target = head, target
        self.slots, self.capacity = target.slots, target.capacity
        self.handle = head.worker.call("head", head.handle, target.handle, head.config)
        self._forgotten: dict[int, int] = {}  # slot -> the length a new sequence there keeps (sent with the next step)
        self._open = True

    def length(self, slot: int) -> int:
        return self.target.length(slot)

    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        import torch

        self._check(batch)
        entries = [(slot, int(tokens[-1])) for slot, tokens in batch]
        forgotten, self._forgotten = self._forgotten, {}
        _, rows = self.model.worker.call("head_step", self.handle, self.target.handle, self.target._take_rewinds(),
                                         forgotten, entries, rows=(len(entries), self.model.vocab_size))
        return [torch.from_numpy(rows[i : i + 1]) for i in range(len(entries))]

    def rewind(self, slot: int, length: int) -> None:
        self._forgotten[slot] = length  # a new sequence in slot: the target rewinds itself

    def close(self) -> None:
        if self._open:
            self._open = False
            if self.model.worker.dead is None:
                self.model.worker.call("close", self.handle)


class WorkerModel(Model):
    """A GGUF file loaded by llama.cpp in the worker process; config and tokenizer read here from its metadata."""

    backend = "llama.cpp"
    isolation = "process"

    def __init__(self, path: str | os.PathLike, n_ctx: int | None = None, n_threads: int | None = None,
                 n_gpu_layers: int = 0, device: str = "cpu", n_batch: int | None = None,
                 flash_attn: bool | None = None, use_mmap: bool = True, repack: bool = True) -> None:
        """Arguments as LlamaCppModel's."""
        from tandem.backends.llamacpp_settings import DEFAULT_N_BATCH, DEFAULT_N_CTX, k_q8_ok, steady_shapes
        from tandem.loading.gguf import open_gguf
        from tandem.loading.tokenizer import Tokenizer

        self.path = os.fspath(path)
        gguf = open_gguf(self.path)  # a bad file is refused here, before llama.cpp sees it
        self.config: ModelConfig = gguf.config
        self.tokenizer: Tokenizer = Tokenizer.from_gguf(gguf)
        self.device = device
        self.steady_shapes = steady_shapes(device)
        self.n_ctx = n_ctx if n_ctx is not None else min(DEFAULT_N_CTX, self.config.context_length)
        self.n_batch = n_batch or DEFAULT_N_BATCH
        self.worker = WorkerProcess.shared()
        self.worker.models += 1
        options = dict(n_threads=n_threads, n_gpu_layers=n_gpu_layers, device=device, flash_attn=flash_attn,
                       k_q8_ok=k_q8_ok(self.config), use_mmap=use_mmap, repack=repack)
        try:
            self.handle, info = self.worker.call("load", self.path, self.config.vocab_size, options)
        except Exception:
            self._release_worker()
            raise
        self.n_threads, self.k_q8, self.repacked = info["n_threads"], info["k_q8"], info["repacked"]
        self.device_description = info["device_description"]
        self._open = True

    @property
    def worker_pid(self) -> int:
        return self.worker.pid

    def new_sequence(self, n_ctx: int | None = None, drafting: bool = False,
                     n_batch: int | None = None) -> WorkerSequence:
        from tandem.backends.llamacpp_settings import DRAFT_N_BATCH

        self._live()
        capacity = n_ctx or self.n_ctx
        n_batch = min(n_batch or (DRAFT_N_BATCH if drafting else self.n_batch), capacity)
        handle = self.worker.call("sequence", self.handle, capacity, n_batch, not drafting)
        return WorkerSequence(self, handle, capacity)

    def new_batched_cache(self, slots: int, n_ctx: int | None = None, drafting: bool = False) -> WorkerBatchedCache:
        self._live()
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        return WorkerBatchedCache(self, slots, n_ctx or self.n_ctx, drafting)

    def kv_bytes_per_token(self) -> int:
        from tandem.backends.llamacpp_settings import kv_bytes_per_token

        return kv_bytes_per_token(self.config, self.k_q8)

    def close(self) -> None:
        if getattr(self, "_open", False):
            self._open = False
            if self.worker.dead is None:
                self.worker.call("close", self.handle)
            self._release_worker()

    def _release_worker(self) -> None:
        self.worker.models -= 1
        if self.worker.models == 0:
            self.worker.close()

    def _live(self) -> None:
        if not self._open:
            raise RuntimeError(f"model {self.path!r} is closed")
        if self.worker.dead is not None:
            raise WorkerDiedError(self.worker.dead)

    # No __del__ that closes: a collection inside another request's round trip would send a request of its own in
    # the middle of it. What is not closed goes with the worker, which exits when this process closes its socket.


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
            cache = core.BatchedForward(self.objects[model], slots, capacity, n_batch, exact)
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
            feeds, counts, vocab_limit, steady = args
            drawn, forwards = cache.greedy_drafts(feeds, counts, vocab_limit, steady)
            return drawn, forwards, {slot: cache.lengths[slot] for feed in feeds for slot, _ in feed}
        if op == "batch_feed":
            return cache.feed(*args)
        if op == "batch_synchronize":
            return cache.synchronize()
        if op == "reusable":
            return cache.reusable(*args)
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
