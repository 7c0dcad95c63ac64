"""A pair's measured costs kept on disk, and a server's costs kept current while it idles.

Kept per device (with its thread count), pair (each file's path, size and time) and shape (`$TANDEM_HOME/costs/`,
or $TANDEM_COSTS), so later starts decide alike and a changed file is measured afresh (TANDEM_RECALIBRATE=1 or
`--recalibrate`: always). Costs measured while other work took the cores are kept marked so (`Kept.quiet`): a busy
start uses them, a quiet one measures them again. `cached_costs`: one sequence's (tandem bench, the doctor);
`Calibrator`: a server's batched costs, estimated at start and measured in full a timing at a time while idle.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Generic, TypeVar

from tandem.backends.base import Model
from tandem.engine import calibration
from tandem.engine.calibration import HURRY, SCRATCH, Timings, estimate, measure_steps
from tandem.engine.costs import BatchCosts, CostModel

log = logging.getLogger("tandem.costs")

BUSY_SAMPLES = 3  # machine_busy: runnable tasks read this many times ...
BUSY_SAMPLE_S = 0.01  # ... this far apart, the fewest counted (a burst is not a busy machine)
COSTS_VERSION = 4  # of the on-disk format and how its figures are measured; another version is measured afresh
# (2: a change of shape timed between a plain step and a verify, each run long enough to be captured; 3: a catch-up
# timed reading its last row, an evidence read's rows apart; 4: the feed beside a verify timed as the median of
# differences, with and without it in turn)
RECALIBRATE_ENV = "TANDEM_RECALIBRATE"
COSTS_DIR_ENV = "TANDEM_COSTS"  # where measured costs are kept [$TANDEM_HOME/costs]
REMEASURE_WAIT_S = 30.0  # Calibrator: how long a full measurement that waits for a quiet machine waits to ask again
T = TypeVar("T")
_lock = threading.Lock()  # one measurement at a time: two requests must not time forwards against each other


def _file_id(path: str) -> str | None:
    try:
        st = os.stat(path)
    except (OSError, TypeError):
        return None
    return f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"


def model_threads(model: Model) -> int | None:
    """The CPU threads a model's forward runs on: llama.cpp's n_threads, torch's intra-op threads."""
    threads = getattr(model, "n_threads", None)
    if threads is None and getattr(model, "backend", None) == "torch":
        import torch

        threads = torch.get_num_threads()
    return threads


def device_id(model: Model) -> str:
    """The device a model runs on, as specific as we can name it cheaply (a CPU's model, a GPU's name), and the
    threads it runs on (a forward on one thread costs about twice one on two)."""
    device = str(getattr(model, "device", "cpu"))
    name = platform.processor() or platform.machine()
    try:
        if device.startswith("cuda") and model.backend == "torch":
            import torch

            name = torch.cuda.get_device_name(torch.device(device))
        else:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except (OSError, RuntimeError, AssertionError):
        pass
    return f"{model.backend}:{device}:{getattr(model, 'dtype', '')}:{name}:{os.cpu_count()}:{model_threads(model)}"


def _pair_ids(target: Model, draft: Model | None) -> tuple[str | None, str | None]:
    return _file_id(getattr(target, "path", None)), "ngram" if draft is None else _file_id(getattr(draft, "path", None))


def costs_path(target: Model, draft: Model | None, k_max: int, slots: int | None = None,
               n_ctx: int | None = None) -> str | None:
    """Where the pair's measured costs are kept (`slots`: the batched engine's, for that many sequences of n_ctx
    tokens), or None where a model is not a file (random weights, tests)."""
    from tandem.loading.registry import tandem_home

    target_id, draft_id = _pair_ids(target, draft)
    if target_id is None or draft_id is None:
        return None
    fields = [COSTS_VERSION, device_id(target), target_id, draft_id, n_ctx or target.n_ctx, k_max]
    key = json.dumps(fields if slots is None else fields + [slots])
    folder = os.environ.get(COSTS_DIR_ENV) or os.path.join(tandem_home(), "costs")
    return os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


@dataclass
class Kept(Generic[T]):
    """Costs as kept on disk, and how they were taken."""

    costs: T
    quiet: bool  # measured with no other work taking the cores (machine_busy); else to be measured again when quiet
    estimate: bool = False  # a quick estimate (calibration.estimate), not a full measurement


def read_kept(path: str | None, decode: Callable[[dict], T], target: Model, draft: Model | None) -> Kept[T] | None:
    """The costs kept at `path` for this pair, or None: none kept, another format version, files that are not the
    ones they were measured on (their ids are in the key too: this guards a reused name), or TANDEM_RECALIBRATE."""
    if path is None or os.environ.get(RECALIBRATE_ENV, "") not in ("", "0"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("version") != COSTS_VERSION:
            return None
        if "files" in doc and doc["files"] != list(_pair_ids(target, draft)):
            return None
        return Kept(decode(doc["costs"]), bool(doc.get("quiet", True)), bool(doc.get("estimate", False)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def keep(path: str | None, costs: dict, target: Model, draft: Model | None, quiet: bool = True,
         estimate: bool = False) -> None:
    """Write `costs` (encoded) to `path` for the next start, atomically; a read-only home keeps nothing."""
    if path is None:
        return
    doc = {"version": COSTS_VERSION, "device": device_id(target), "target": target.path,
           "draft": "ngram" if draft is None else draft.path, "files": list(_pair_ids(target, draft)),
           "quiet": quiet, "estimate": estimate, "costs": costs,
           "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home costs a measurement per start, nothing else


def _runnable_besides_us() -> int | None:
    """Tasks runnable now besides the one reading (Linux's /proc/loadavg, its fourth field), the fewest of
    BUSY_SAMPLES reads; None where there is no such file."""
    counts = []
    for i in range(BUSY_SAMPLES):
        try:
            with open("/proc/loadavg", encoding="ascii") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return None
        if i + 1 < BUSY_SAMPLES:
            time.sleep(BUSY_SAMPLE_S)
    return min(counts)


def machine_busy(threads: int | None = None) -> bool:
    """Whether other work takes cores a forward on `threads` threads (default: every core) would run on, now: the
    tasks runnable besides this one and those threads more than the cores. (Where /proc/loadavg is missing, the
    1-minute load average over the cores; it lags, and counts this process's own forwards.)"""
    cores = os.cpu_count() or 1
    others = _runnable_besides_us()
    if others is not None:
        return others + min(threads or cores, cores) > cores
    try:
        return os.getloadavg()[0] > cores
    except (AttributeError, OSError):
        return False


def kept_costs(path: str | None, measure: Callable[[], T], encode: Callable[[T], dict], decode: Callable[[dict], T],
               target: Model, draft: Model | None, refresh: bool = False) -> T:
    """Costs read from `path` (see costs_path), else measured and kept there for the next start. Costs kept from a
    busy machine are used as they are while it is busy still, and measured again (and replaced) once it is quiet;
    costs measured now while it is busy are kept marked so. refresh: measure again, and replace what is there."""
    threads = model_threads(target)
    kept = None if refresh else read_kept(path, decode, target, draft)
    if kept is not None and not kept.estimate and (kept.quiet or machine_busy(threads)):
        return kept.costs
    quiet = not machine_busy(threads)
    costs = measure()
    quiet = quiet and not machine_busy(threads)
    if not quiet:  # ratios read under contention (V(2) at 2.4 steps, not 1.3) would outlive it
        log.warning("costs measured while other work took the cores are kept as measured on a busy machine: a start "
                    "on a quiet machine measures them again")
    keep(path, encode(costs), target, draft, quiet)
    return costs


def _decode_cost_model(c: dict) -> CostModel:
    return CostModel(float(c["draft_step_ms"]), {int(n): float(v) for n, v in c["verify_ms"].items()},
                     None if c["catch_up_ms_per_token"] is None else float(c["catch_up_ms_per_token"]))


def cached_costs(target: Model, draft: Model | None, k_max: int, refresh: bool = False) -> CostModel:
    """Costs measured once per pair and k_max (kept on the target, and on disk for the next start); each request
    gets its own copy to refine. refresh: measure again, and replace what is on disk."""
    cache = target.__dict__.setdefault("_tandem_costs", {})
    key = (id(draft), k_max)
    with _lock:
        if key not in cache or refresh:
            cache[key] = kept_costs(costs_path(target, draft, k_max),
                                    lambda: calibration.measure_costs(target, draft, k_max), asdict,
                                    _decode_cost_model, target, draft, refresh)
        return copy.deepcopy(cache[key])


class Calibrator:
    """The costs a long-lived engine (a server's) plans from, without making it wait for a measurement: `start`
    takes those kept for this device, pair and shape (costs_path), else `estimate`s them in seconds and
    keeps that; `step`, run while the engine is idle, measures them in full a timing at a time (measure_steps) where
    what it started from is an estimate or was measured on a busy machine, then plans from and keeps what it
    measured. A full measurement waits for a quiet machine (machine_busy), unless all it would replace
    is an estimate: measured busy, it is kept marked so and measured again once the machine is quiet."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.path = engine.costs_path()
        self.threads = model_threads(engine.target)
        self.source: str | None = None  # what the engine plans from: see progress()
        self.pending = False  # a full measurement is still to be taken
        self.estimated = False  # what the engine plans from is an estimate
        self.timings_done = 0  # of the running full measurement
        self.timing: str | None = None  # what it times next
        self._timings: Timings | None = None
        self._quiet = True  # no other work took the cores while it ran, so far
        self._started = 0.0  # time.monotonic() when it began
        self.waits_for_quiet = False  # the last step found the machine busy, and what is kept was measured in full

    def start(self) -> None:
        """Plan from the kept costs, else from an estimate (timed now, and kept for the next start)."""
        engine = self.engine
        kept = read_kept(self.path, BatchCosts.from_measured, engine.target, engine.draft_model)
        if kept is not None:
            self.estimated, self.pending = kept.estimate, kept.estimate or not kept.quiet
            self.source = "estimate (kept)" if kept.estimate else "kept" if kept.quiet else "kept (busy machine)"
            engine.plan_from(kept.costs)
            return
        quiet = not machine_busy(self.threads)
        costs = estimate(engine.target_kv, engine.draft_kv, engine.draft_max, engine._synchronize)
        keep(self.path, costs.measured(), engine.target, engine.draft_model,
             quiet=quiet and not machine_busy(self.threads), estimate=True)
        self.source, self.estimated, self.pending = "estimate", True, True
        engine.plan_from(costs)

    def step(self, hurry: Callable[[], bool] | None = None) -> float | None:
        """One timing of the full measurement, the engine idle (its free slots are scratch meanwhile, and their kept
        prompts forgotten); seconds until the next is due (0: now), None once nothing is left to measure. hurry():
        whether a request waits, and the timing should end at the runs it has (a server on a busy 2-core machine
        took up to a minute a timing of 4 sequences x 9 rows at REPEATS)."""
        if not self.pending:
            return None
        engine = self.engine
        if self._timings is None:
            self._quiet = not machine_busy(self.threads)
            self.waits_for_quiet = not self._quiet and not self.estimated
            if self.waits_for_quiet:
                return REMEASURE_WAIT_S
            self._timings = measure_steps(engine.target_kv, engine.draft_kv, engine.draft_max, engine._synchronize)
            self.timings_done, self._started = 0, time.monotonic()
            log.info("measuring the costs in full while idle (planning from: %s)", self.source)
        # The timing runs in the least recently used free slots: a conversation's kept prompt is overwritten only
        # by a timing of every slot, not by each timing (its next turn would read the whole prompt again).
        token, scratch = HURRY.set(hurry), SCRATCH.set(engine.kv.scratch_slots())
        try:
            self.timing = next(self._timings)
            self.timings_done += 1
            return 0.0
        except StopIteration as done:
            costs = done.value
        except Exception:
            self.pending, self._timings, self.timing = False, None, None
            engine.kv.forget_prefixes()  # a timing that raised may have left its slots full
            raise
        finally:
            HURRY.reset(token)
            SCRATCH.reset(scratch)
            engine.kv.forget_emptied()
        quiet = self._quiet and not machine_busy(self.threads)
        keep(self.path, costs.measured(), engine.target, engine.draft_model, quiet=quiet)
        self.source = "measured" if quiet else "measured (busy machine)"
        log.info("costs %s: %d timings in %.0f s while idle", self.source, self.timings_done,
                 time.monotonic() - self._started)
        self.estimated, self.pending, self._timings, self.timing = False, not quiet, None, None
        engine.plan_from(costs)
        return REMEASURE_WAIT_S if self.pending else None

    def measure_now(self, seconds: float) -> None:
        """Run `step` until the measurement is whole or `seconds` have passed (what is left runs while idle)."""
        deadline = time.monotonic() + seconds
        while self.pending and time.monotonic() < deadline and self.step() == 0.0:
            pass

    def progress(self) -> dict:
        """What the engine plans from ("kept", "estimate", "measured", each maybe "(busy machine)": other work took
        the cores while it was timed) and, while a full measurement runs, how far along it is."""
        out: dict = {"source": self.source}
        if self._timings is not None:
            out |= {"measuring": self.timing, "timings_done": self.timings_done}
        elif self.pending:
            out["measuring"] = "waiting for a quiet machine" if self.waits_for_quiet else "when the server is idle"
        return out

