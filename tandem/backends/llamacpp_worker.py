"""The llama.cpp backend in a worker process: the same Model, Sequence and BatchedCache, llama.cpp out of process.

Why: a CUDA build of llama.cpp and torch's CUDA libraries crash in one process (llama-cpp-python loads libllama
with RTLD_GLOBAL; libggml-cuda links the system's CUDA runtime and cuBLAS, torch brings its own: docs/backends.md).
Here llama.cpp lives in a child process that never imports torch (llamacpp_process: the process and its
transport), and the engine cannot tell: `WorkerModel` is a `Model`, its caches are proxies of the worker's.

Greedy sequences need no logits at all: a step's drafting runs in the worker in one request (greedy_drafts) and a
verify's rows come back as their argmax (forward_picking); a batched cache's rewinds ride on its next request. One
worker serves every model of the process (target and draft: one CUDA context, and on a CPU no second OpenMP team
spinning beside the first); requests are serialised by a lock.

A dead worker (a crash in llama.cpp, a kill) fails the request in flight and every later one with WorkerDiedError,
saying how it died, and logs it once; nothing waits on it.

When: `isolation="process"` (load option, `--llamacpp-isolation process`, or TANDEM_LLAMACPP_WORKER=1), and by
default (`auto`) where the installed llama.cpp is a CUDA build and torch has CUDA too. TANDEM_LLAMACPP_WORKER=0
keeps llama.cpp in process.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Literal

from tandem.backends.base import Alongside, BatchedCache, Model, Sequence
from tandem.backends.llamacpp_process import WorkerDiedError, WorkerProcess
from tandem.backends.llamacpp_settings import launches_asynchronously

if TYPE_CHECKING:
    import torch

    from tandem.config import ModelConfig
    from tandem.loading.tokenizer import Tokenizer

log = logging.getLogger("tandem.llamacpp")

WORKER_ENV = "TANDEM_LLAMACPP_WORKER"  # 1: always a worker process; 0: never; unset: as isolation says
ISOLATIONS = ("auto", "process", "none")
CUDA_BACKEND_LIBS = ("libggml-cuda.so", "ggml-cuda.dll", "libggml-cuda.dylib")  # a CUDA build of llama.cpp ships one


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


class _Held:
    """What the worker holds by handle for a model of this process: closed there once, unless the worker is gone."""

    model: WorkerModel
    handle: int
    _open: bool

    def close(self) -> None:
        if self._open:
            self._open = False
            if self.model.worker.dead is None:
                self.model.worker.call("close", self.handle)


class WorkerSequence(_Held, Sequence):
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

    def _live(self) -> None:
        if not self._open:
            raise RuntimeError("this sequence is closed")


class WorkerBatchedCache(_Held, BatchedCache):
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
                      steady: bool, floors: Seq[float] | None = None) -> tuple[list[list[int]], int]:
        """One round trip a draft step, where a forward a draft token cost one each and a logits copy
        (llamacpp_core.BatchedForward.greedy_drafts)."""
        self._check_feeds(feeds)
        feeds = [[(slot, list(tokens)) for slot, tokens in feed] for feed in feeds]
        drawn, forwards, lengths = self._call("batch_greedy_drafts", feeds, list(counts), vocab_limit, steady,
                                              None if floors is None else list(floors))
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

    def settle(self, slot: int, tokens: Seq[int], rows: int) -> int:
        if self.prefill_align == 1:
            return 0
        try:
            left, self._lengths[slot] = self._call("settle", slot, list(tokens), rows)
        except RuntimeError:  # the failed forward forgot its positions: the slot holds what it could keep
            self._lengths[slot] = self._call("reusable", slot, self._lengths[slot])
            raise
        return left

    def copy_prefix(self, src: int, dst: int, length: int) -> bool:
        self._call("copy_prefix", src, dst, length)
        self._lengths[dst] = length
        return True

    def attach_head(self, head: Model) -> WorkerHeadCache:
        if not isinstance(head, WorkerModel) or head.worker is not self.model.worker:
            raise ValueError(f"a head draft must be loaded in its target's worker process (isolation='process'), "
                             f"got {head!r}")
        return WorkerHeadCache(head, self)


class WorkerHeadCache(_Held, BatchedCache):
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
