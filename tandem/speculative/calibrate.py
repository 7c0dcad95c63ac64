"""A pair's costs measured on the device it runs on, and kept.

- `cached_costs`: the batch-1 cost model (the draft's one-token step, the target's forward over n = 1, 2 and
  k_max + 1 tokens, affine in between), repeated until two rounds agree, for `tandem bench`'s predictions and the
  doctor; the batched engine measures its own (`engine.calibration.measure`) and keeps them through `kept_costs`.
- Either is kept on disk per device (with its thread count), pair (each file's path, size and time) and shape
  (`$TANDEM_HOME/costs/`, or $TANDEM_COSTS), so later starts decide alike (near break-even a cost read off a cold or
  busy device decides differently from one start to the next) and a changed file is measured afresh, never read
  stale; TANDEM_RECALIBRATE=1 (or `--recalibrate`) measures afresh. Costs measured while other work took the cores
  are kept marked so (`Kept.quiet`): a start on a busy machine uses them rather than pay a measurement that busy
  (minutes: a real-pair server took ~10.5 min to answer beside another job), and a start on a quiet one measures
  them again. The loop then refines every figure from the iterations it really runs.
- `shared_prior`: the process-wide acceptance prior of a target's requests.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Generic, TypeVar

from tandem.backends.base import Model, Sequence
from tandem.speculative.policy import AcceptancePrior, CostModel
from tandem.speculative.proposer import NgramProposer

log = logging.getLogger("tandem.calibrate")

WARMUP_TOKENS = 16  # context the timed forwards attend over, and a warm-up of kernels and caches
REPEATS = 3
NGRAM_STEP_MS = 0.01  # a dictionary lookup; measured online from there
NGRAM_PRIOR = (0.5, 2.0)  # prompt lookup proposes often-wrong continuations until the request shows otherwise ...
LONG_MATCH_PRIOR = (1.0, 2.0)  # ... less so after a match of its longest n-gram
CATCH_UP_TOKENS = 8  # a draft's forward over this many tokens prices its catch-up after plain steps
STABLE_ROUNDS = 5  # at most this many measuring rounds ...
STABLE_TOLERANCE = 0.05  # ... until two in a row agree within this on every figure
BUSY_SAMPLES = 3  # machine_busy: runnable tasks read this many times ...
BUSY_SAMPLE_S = 0.01  # ... this far apart, the fewest counted (a burst is not a busy machine)
COSTS_VERSION = 4  # of the on-disk format and how its figures are measured; another version is measured afresh
# (2: a change of shape timed between a plain step and a verify, each run long enough to be captured; 3: a catch-up
# timed reading its last row, an evidence read's rows apart; 4: the feed beside a verify timed as the median of
# differences, with and without it in turn)
RECALIBRATE_ENV = "TANDEM_RECALIBRATE"
COSTS_DIR_ENV = "TANDEM_COSTS"  # where measured costs are kept [$TANDEM_HOME/costs]
T = TypeVar("T")
_lock = threading.Lock()  # one measurement at a time: two requests must not time forwards against each other


def warm_up(model: Model, seq: Sequence, context: int, seconds: float) -> None:
    """One-token forwards on seq (rolled back to `context` after each) for `seconds`, at least three: a device idle
    before it runs at idle clocks, and Vulkan drivers build pipelines on first use. On an H200 through NVIDIA's
    Vulkan driver the doctor's target steps, timed first in a lease, read 6.5-7.5 ms where the bench's ran 2.4-2.9
    ms a minute later (and a second doctor run 2.35 ms); what exactly was cold is not pinned down."""
    token = model.tokenizer.bos_token_id or 0
    deadline, runs = time.perf_counter() + seconds, 0
    while runs < 3 or time.perf_counter() < deadline:
        seq.forward([token], logits="last")
        seq.rewind(context)
        runs += 1
    model.synchronize()


def time_forwards_ms(model: Model, sizes: Iterable[int], repeats: int = REPEATS,
                     context: int = WARMUP_TOKENS, drafting: bool = False, warmup_s: float = 0.0) -> dict[int, float]:
    """n -> median ms of one forward of n tokens after `context` tokens. One scratch sequence serves every n (a
    llama.cpp context costs far more to create than to run), rolled back after each forward; the first is a warm-up
    (allocations, graph capture), and `warmup_s` of one-token forwards come before them all (see warm_up)."""
    sizes = sorted(set(sizes))
    if sizes[-1] + 1 > model.n_ctx:
        raise ValueError(f"cannot time a forward of {sizes[-1]} tokens in a context of {model.n_ctx}")
    context = max(1, min(context, model.n_ctx - sizes[-1]))
    # The capacity decoding uses: attention over a static cache costs by capacity.
    seq = model.new_sequence(drafting=drafting)
    try:
        token = model.tokenizer.bos_token_id or 0
        seq.forward([token] * context, logits="last")
        if warmup_s > 0:
            warm_up(model, seq, context, warmup_s)
        out = {}
        for n in sizes:
            times = []
            for _ in range(repeats + 1):
                model.synchronize()
                started = time.perf_counter()
                seq.forward([token] * n, logits="all")
                model.synchronize()
                times.append(1000.0 * (time.perf_counter() - started))
                seq.rewind(context)
            out[n] = statistics.median(times[1:])
        return out
    finally:
        seq.close()


def _measure_once(target: Model, draft: Model | None, k_max: int) -> CostModel:
    verify_ms = time_forwards_ms(target, {1, 2, k_max + 1})
    if draft is None:
        return CostModel(draft_step_ms=NGRAM_STEP_MS, verify_ms=verify_ms, catch_up_ms_per_token=0.0)
    draft_ms = time_forwards_ms(draft, [1, CATCH_UP_TOKENS], drafting=True)
    return CostModel(draft_step_ms=draft_ms[1], verify_ms=verify_ms,
                     catch_up_ms_per_token=draft_ms[CATCH_UP_TOKENS] / CATCH_UP_TOKENS)


def _figures(costs: CostModel) -> list[float]:
    return [costs.draft_step_ms, costs.catch_up_ms_per_token or 0.0, *costs.verify_ms.values()]


def _agree(a: CostModel, b: CostModel) -> bool:
    return all(abs(x - y) <= STABLE_TOLERANCE * max(x, y, 1e-9) for x, y in zip(_figures(a), _figures(b), strict=True))


def measure_costs(target: Model, draft: Model | None, k_max: int) -> CostModel:
    """Rounds of measurement until two in a row agree within STABLE_TOLERANCE on every figure (at most
    STABLE_ROUNDS); each figure the lower of those two rounds' (noise on a shared machine only ever adds time)."""
    k_max = max(0, min(k_max, target.n_ctx - 2))  # a verify of k_max + 1 tokens must fit in the context
    last = _measure_once(target, draft, k_max)
    for _ in range(STABLE_ROUNDS - 1):
        new = _measure_once(target, draft, k_max)
        stable, previous, last = _agree(last, new), last, new
        if stable:
            break
    return CostModel(draft_step_ms=min(previous.draft_step_ms, last.draft_step_ms),
                     verify_ms={n: min(v, last.verify_ms[n]) for n, v in previous.verify_ms.items()},
                     catch_up_ms_per_token=min(previous.catch_up_ms_per_token or 0.0,
                                               last.catch_up_ms_per_token or 0.0))


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
    estimate: bool = False  # a quick estimate (engine.calibration.estimate), not a full measurement


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
            cache[key] = kept_costs(costs_path(target, draft, k_max), lambda: measure_costs(target, draft, k_max),
                                    asdict, _decode_cost_model, target, draft, refresh)
        return copy.deepcopy(cache[key])


def shared_prior(target: Model) -> AcceptancePrior:
    """The process-wide acceptance prior of a target's requests (kept on the target, like its costs): per source,
    so prompt lookup alone and mixed with a draft share what lookup accepted."""
    priors = target.__dict__.setdefault("_tandem_priors", {})
    with _lock:
        if "shared" not in priors:
            lookup = NgramProposer()
            defaults = {s: NGRAM_PRIOR for s in lookup.sources}
            defaults[lookup.sources[0]] = LONG_MATCH_PRIOR
            priors["shared"] = AcceptancePrior(defaults)
        return priors["shared"]
