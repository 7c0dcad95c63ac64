"""The batched engine's costs, timed on the engine's own caches (`measure`): the target's forward over B sequences of
n rows each, V(B, n), for B = 1, 2, 4, ... up to the slots; the draft's one-row step over B sequences; the draft's
catch-up; a change of the target's shape; and what feeding the draft beside a verify adds. The planner
(`planner.plan`) decides from them; the loop refines some as it runs (`BatchCosts.observe_*`). (The doctor's
one-request costs are `tandem.speculative.calibrate`'s.)

A server does not wait for all of that (`tandem serve` on a 2-core CPU: 33 s of a 40 s start, minutes beside another
job): it starts on the costs kept from an earlier start, or on `estimate` (batch 1 only, once each, the rest read off
that line: a few seconds), and runs `measure_steps` a timing at a time while it has nothing else to do (every slot is
empty between two timings, so requests can run in between), then plans from what it measured.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Generator
from contextvars import ContextVar
from typing import TypeVar

from tandem.backends.base import BatchedCache
from tandem.engine.planner import BatchCosts
from tandem.speculative.policy import EVIDENCE_ROWS, CostModel

T = TypeVar("T")
log = logging.getLogger("tandem.calibration")
# Calibrator.step's `hurry`, for the timings it runs: whether a request waits, and a timing should end at the runs it
# has (one past the warm-up) instead of holding it back for all REPEATS.
_HURRY: ContextVar[Callable[[], bool] | None] = ContextVar("tandem_calibration_hurry", default=None)

CONTEXT = 16  # tokens each timed sequence attends over
REPEATS = 3
ESTIMATE_RUNS = 2  # estimate: timed forwards of each size
AHEAD_PAIRS = 7  # feed-ahead: differences of a verify with and without the feed (_feed_ahead_ms)
# Rows a sequence at which the target's forward is timed: 1, 2 and k_max + 1, then PROBE_ROWS; where V there is
# off the line through the others by NONLINEAR, FINE_ROWS too. V(n) need be no straight line: on llama.cpp's Vulkan
# build (H200/H100) 2-8 rows added 4.8 ms each and the 9th 120 ms (its matrix-vector kernel takes up to 8 columns), so
# a line from V(2) to V(9) put V(3) at 1.8x its cost and a 2-token draft never ran. On a CPU V is a line and the probe
# is all it costs (each row is a step's work there: an engine of 4 slots calibrates in seconds, not tens of them).
PROBE_ROWS = (5,)
FINE_ROWS = (3, 8)
NONLINEAR = 0.15
CATCH_UP_ROWS = (8, 32)  # a draft's catch-up forward is timed over these many tokens
# A change of shape is timed between a plain step and a verify of this many drafts (+ 1 rows): a typical one. Between
# 1 and 2 rows ggml-cuda updates its captured graph in place, but a verify of 4 rows takes other kernels and the
# capture instantiates a new graph: on an H100 (32B Q4_0 target) 7.2 ms a change timed 1-2 rows (the shape changed
# from uncaptured), 17.6 ms as the loop pays it (bench/llamacpp_episode.py), 11-16 ms timed so. Priced at 7.2, 2
# requests drafted in runs too short to repay it (0.96x plain; 1.00x priced right).
SWITCH_DRAFTS = 3
REMEASURE_WAIT_S = 30.0  # Calibrator: how long a full measurement that waits for a quiet machine waits to ask again


Timings = Generator[str, None, BatchCosts]  # yields what it times next, returns the costs (see measure_steps)


def measure(target: BatchedCache, draft: BatchedCache | None, k_max: int, synchronize) -> BatchCosts:
    """Time the target's forward over B sequences of 1, 2, k_max + 1 (and, see PROBE_ROWS, more) rows each, the
    draft's one-row step over B sequences, for B = 1, 2, 4, ... up to the slots, the draft's catch-up and a change
    of shape (the caches must be empty: slots are scratch here)."""
    return run(measure_steps(target, draft, k_max, synchronize))


def run(timings: Generator[str, None, T]) -> T:
    """Every timing of `timings` (measure_steps and its parts) in a row; what it returns."""
    while True:
        try:
            next(timings)
        except StopIteration as done:
            return done.value


def batch_sizes(slots: int) -> list[int]:
    """1, 2, 4, ... up to slots, and slots itself: the batches whose costs are timed."""
    batches = [1]
    while batches[-1] * 2 <= slots:
        batches.append(batches[-1] * 2)
    if batches[-1] != slots:
        batches.append(slots)
    return batches


def measure_steps(target: BatchedCache, draft: BatchedCache | None, k_max: int, synchronize) -> Timings:
    """`measure` a timing at a time: each `next` runs the one it yielded the name of before (a few forwards), and
    every slot of both caches is empty again between two, so a server's requests can run there (Engine's slots are
    free; its kept prompt prefixes must be forgotten first: Engine.forget_prefixes)."""
    batches = batch_sizes(target.slots)
    k_max = max(0, min(k_max, target.capacity - CONTEXT - 1))
    costs = BatchCosts()
    for b in batches:
        costs.verify[b] = yield from _verify_steps(target, b, k_max, synchronize)
        if draft is not None:
            yield f"the draft's step over {b} sequences"
            costs.draft_step[b] = _time(draft, b, 1, synchronize)
    if draft is not None:
        # Two sizes, a base and a price a token: on a GPU a forward's cost hardly grows with its tokens (Vulkan, H200:
        # 2.0 ms + 0.47 a token), where an 8-token forward's price a token priced a prompt's catch-up several times
        # over; on a CPU the base is near 0. Each reading its last row, as the drafter's catch-ups do: read back
        # whole, a 152k vocabulary's rows are 0.6 MB a token, and on this CPU cost a 0.5B draft 35% more at 32 rows
        # (bench/catch_up_rows.py); an evidence read's rows read back are priced apart (evidence_row_ms).
        yield "the draft's catch-up"
        short = _time(draft, 1, CATCH_UP_ROWS[0], synchronize, last_only=True)
        long = _time(draft, 1, CATCH_UP_ROWS[1], synchronize, last_only=True) \
            if draft.capacity >= CONTEXT + CATCH_UP_ROWS[1] else short * CATCH_UP_ROWS[1] / CATCH_UP_ROWS[0]
        costs.catch_up_ms_per_token = max(0.0, long - short) / (CATCH_UP_ROWS[1] - CATCH_UP_ROWS[0])
        costs.catch_up_base_ms = max(0.0, short - CATCH_UP_ROWS[0] * costs.catch_up_ms_per_token)
        if draft.capacity >= CONTEXT + EVIDENCE_ROWS:
            yield "the draft's evidence read"
            every = _time(draft, 1, EVIDENCE_ROWS, synchronize)
            last = _time(draft, 1, EVIDENCE_ROWS, synchronize, last_only=True)
            costs.evidence_row_ms = max(0.0, every - last) / (EVIDENCE_ROWS - 1)
    if k_max > 0:  # plain steps after a verify, and verifies after a plain step, against each repeated
        # Two forwards after the change: llama.cpp's CUDA build runs the first uncaptured and captures the second
        # (ggml-cuda's graph warm-up), replaying only from the third; elsewhere the second reuses the graph.
        rows = min(k_max, SWITCH_DRAFTS) + 1
        same = costs.verify[1].verify_ms  # each shape repeated, as timed above where it was
        yield "a change of the target's shape"
        repeated = {n: 2 * same[n] if n in same else _time(target, 1, n, synchronize, calls=2) for n in (1, rows)}
        plain_after_verify = _time(target, 1, 1, synchronize, after=rows, calls=2) - repeated[1]
        verify_after_plain = _time(target, 1, rows, synchronize, after=1, calls=2) - repeated[rows]
        costs.switch_ms = max(0.0, (plain_after_verify + verify_after_plain) / 2)
        if draft is not None and target.overlaps(draft):
            for b in batches:  # a typical verify, alone and with a draft row a sequence fed beside it
                yield f"the draft fed beside a verify of {b} sequences"
                costs.ahead_ms[b] = _feed_ahead_ms(target, draft, b, rows, synchronize)
            costs.decide_feeding_ahead()
    return costs


def estimate(target: BatchedCache, draft: BatchedCache | None, k_max: int, synchronize) -> BatchCosts:
    """Costs to start from where none are kept, in a dozen forwards (a second or two on a CPU, where a busy machine
    makes each several times dearer): V(1, n) at n = 1, 2 and k_max + 1 and the draft's step and 8-token catch-up,
    ESTIMATE_RUNS each after one context forward. Timed so few times, a figure is noise on a busy machine (V(1)
    read above V(2)), so the estimate errs towards plain decoding: the least of V(1)'s timings, the most of every
    other's. The other batches are read off them as a CPU runs them (a forward's cost a line in its rows:
    V(B, R) = V(1, R); a draft step over B sequences one catch-up row more a sequence), no change of shape priced and
    nothing fed ahead; on a GPU, where rows are all but free, that prices the larger batches' verifies too high
    (they draft less until measured). measure_steps then replaces it."""
    k_max = max(0, min(k_max, target.capacity - CONTEXT - 1))
    rows = sorted({1, 2, k_max + 1})
    timed = _time_each(target, rows, synchronize)
    line = CostModel(draft_step_ms=0.0, verify_ms={n: min(ms) if n == 1 else max(ms) for n, ms in timed.items()})
    costs = BatchCosts()
    for b in batch_sizes(target.slots):
        costs.verify[b] = CostModel(draft_step_ms=0.0, verify_ms={b * n: line.verify(b * n) for n in rows})
    if draft is not None:
        step = max(_time_each(draft, [1], synchronize)[1])
        short = max(_time_each(draft, [CATCH_UP_ROWS[0]], synchronize, last_only=True)[CATCH_UP_ROWS[0]])
        costs.catch_up_ms_per_token = short / CATCH_UP_ROWS[0]
        costs.draft_step = {b: step + (b - 1) * costs.catch_up_ms_per_token for b in costs.verify}
    return costs


def _time_each(cache: BatchedCache, sizes: list[int], synchronize, last_only: bool = False) -> dict[int, list[float]]:
    """n -> ms of ESTIMATE_RUNS forwards of n rows in slot 0 after CONTEXT tokens, the sizes in turn, the largest
    first: with no warm-up, a first forward's one-off costs land on the largest, pricing drafting up, never down.
    The slot is empty after."""
    cache.forward([(0, [0] * CONTEXT)], [True])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(ESTIMATE_RUNS):
        for n in sorted(sizes, reverse=True):
            times[n].append(_timed(cache, [0], n, synchronize, last_only=last_only))
    _rewind(cache, [0], 0)
    return times


def _verify_costs(target: BatchedCache, batch: int, k_max: int, synchronize) -> CostModel:
    return run(_verify_steps(target, batch, k_max, synchronize))


def _verify_steps(target: BatchedCache, batch: int, k_max: int, synchronize) -> Generator[str, None, CostModel]:
    """V(batch, R) at R = batch x 1, 2 and k_max + 1 rows, and at PROBE_ROWS; at FINE_ROWS as well where a probe
    is off the line through the others (a timing at a time: see measure_steps)."""
    def timed(rows: list[int]) -> Generator[str, None, dict[int, float]]:
        table = {}
        for n in rows:
            yield f"the target's forward over {batch} x {n} rows"
            table[batch * n] = _time(target, batch, n, synchronize)
        return table

    table = yield from timed(sorted({1, 2, k_max + 1}))
    probes = yield from timed([n for n in PROBE_ROWS if 2 < n < k_max + 1])
    line = CostModel(draft_step_ms=0.0, verify_ms=dict(table))
    if any(abs(ms - line.verify(r)) > NONLINEAR * ms for r, ms in probes.items()):
        table |= yield from timed([n for n in FINE_ROWS if n <= k_max and batch * n not in probes])
    return CostModel(draft_step_ms=0.0, verify_ms=table | probes)


def _time(cache: BatchedCache, batch: int, rows: int, synchronize, after: int | None = None, calls: int = 1,
          last_only: bool = False) -> float:
    """Median ms of `calls` forwards in a row of `rows` tokens in each of `batch` slots, after CONTEXT tokens (the
    first of REPEATS + 1 runs is a warm-up), each run right after as many untimed forwards of `after` rows where
    given (a change of shape, from a shape run as long: ggml-cuda has captured it, as it has a verify in the loop,
    and a capture must then instantiate a new graph where one left captured at `rows` would be updated in place);
    every slot is rewound to empty after. Every row's logits are read back, as a verify reads them, unless
    last_only. Where a request waits (Calibrator.step's `hurry`), the runs it has done are enough."""
    slots = list(range(batch))
    cache.forward([(s, [0] * CONTEXT) for s in slots], [True] * batch)

    def once() -> float:
        for _ in range(calls if after is not None else 0):
            cache.forward([(s, [0] * after) for s in slots], [False] * batch)
            _rewind(cache, slots, CONTEXT)
        return sum(_timed(cache, slots, rows, synchronize, last_only=last_only) for _ in range(calls))

    hurry = _HURRY.get()
    times = [once(), once()]  # the warm-up and one timed run at least
    while len(times) < REPEATS + 1 and not (hurry and hurry()):
        times.append(once())
    _rewind(cache, slots, 0)
    return statistics.median(times[1:])


def _feed_ahead_ms(target: BatchedCache, draft: BatchedCache, batch: int, rows: int, synchronize) -> float:
    """What feeding a draft row a slot beside a verify of `rows` rows a slot adds to it: the median of AHEAD_PAIRS
    differences, the verify timed alone and with the feed in turn (the first two pairs dropped: ggml-cuda captures
    its graphs on a shape's second forward). Two medians taken apart moved with the host: on an H200 one calibration
    read 4.10 ms where one minutes before read 1.05, and the engine then fed nothing ahead; on an H100 they read
    0.30-0.97 where the forwards one by one put it at 0.93 (bench/calibration_spread.py)."""
    slots = list(range(batch))
    target.forward([(s, [0] * CONTEXT) for s in slots], [True] * batch)
    added = [_timed(target, slots, rows, synchronize, draft) - _timed(target, slots, rows, synchronize)
             for _ in range(AHEAD_PAIRS + 2)]
    _rewind(target, slots, 0)
    return max(0.0, statistics.median(added[2:]))


def _timed(cache: BatchedCache, slots: list[int], rows: int, synchronize, alongside: BatchedCache | None = None,
           last_only: bool = False) -> float:
    """ms of one forward of `rows` tokens a slot (with a row a slot of `alongside` fed beside it), rewound after."""
    synchronize()
    started = time.perf_counter()
    if alongside is None:
        cache.forward([(s, [0] * rows) for s in slots], [last_only] * len(slots))
    else:
        cache.forward_picking([(s, [0] * rows) for s in slots], [False] * len(slots), [False] * len(slots),
                              (alongside, [(s, [0]) for s in slots]))
        alongside.synchronize()
    synchronize()
    ms = 1000.0 * (time.perf_counter() - started)
    _rewind(cache, slots, CONTEXT)
    if alongside is not None:
        _rewind(alongside, slots, 0)
    return ms


def _rewind(cache: BatchedCache, slots: list[int], length: int) -> None:
    for s in slots:
        cache.rewind(s, length)


class Calibrator:
    """The costs a long-lived engine (a server's) plans from, without making it wait for a measurement: `start`
    takes those kept for this device, pair and shape (calibrate.costs_path), else `estimate`s them in seconds and
    keeps that; `step`, run while the engine is idle, measures them in full a timing at a time (measure_steps) where
    what it started from is an estimate or was measured on a busy machine, then plans from and keeps what it
    measured. A full measurement waits for a quiet machine (calibrate.machine_busy), unless all it would replace
    is an estimate: measured busy, it is kept marked so and measured again once the machine is quiet."""

    def __init__(self, engine) -> None:
        from tandem.speculative.calibrate import costs_path, model_threads

        self.engine = engine
        self.path = costs_path(engine.target, engine.draft_model, engine.draft_max, engine.slots, engine.n_ctx)
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
        from tandem.speculative.calibrate import keep, machine_busy, read_kept

        engine = self.engine
        kept = read_kept(self.path, BatchCosts.from_measured, engine.target, engine.draft_model)
        if kept is not None:
            self.estimated, self.pending = kept.estimate, kept.estimate or not kept.quiet
            self.source = "estimate (kept)" if kept.estimate else "kept" if kept.quiet else "kept (busy machine)"
            self._plan_from(kept.costs)
            return
        quiet = not machine_busy(self.threads)
        costs = estimate(engine.target_kv, self._draft_kv(), engine.draft_max, self._synchronize)
        keep(self.path, costs.measured(), engine.target, engine.draft_model,
             quiet=quiet and not machine_busy(self.threads), estimate=True)
        self.source, self.estimated, self.pending = "estimate", True, True
        self._plan_from(costs)

    def step(self, hurry: Callable[[], bool] | None = None) -> float | None:
        """One timing of the full measurement, the engine idle (its free slots are scratch meanwhile, and their kept
        prompts forgotten); seconds until the next is due (0: now), None once nothing is left to measure. hurry():
        whether a request waits, and the timing should end at the runs it has (a server on a busy 2-core machine
        took up to a minute a timing of 4 sequences x 9 rows at REPEATS)."""
        from tandem.speculative.calibrate import keep, machine_busy

        if not self.pending:
            return None
        engine = self.engine
        if self._timings is None:
            self._quiet = not machine_busy(self.threads)
            self.waits_for_quiet = not self._quiet and not self.estimated
            if self.waits_for_quiet:
                return REMEASURE_WAIT_S
            self._timings = measure_steps(engine.target_kv, self._draft_kv(), engine.draft_max, self._synchronize)
            self.timings_done, self._started = 0, time.monotonic()
            log.info("measuring the costs in full while idle (planning from: %s)", self.source)
        engine.forget_prefixes()
        token = _HURRY.set(hurry)
        try:
            self.timing = next(self._timings)
            self.timings_done += 1
            return 0.0
        except StopIteration as done:
            costs = done.value
        except Exception:
            self.pending, self._timings, self.timing = False, None, None
            engine.forget_prefixes()  # a timing that raised may have left its slots full
            raise
        finally:
            _HURRY.reset(token)
        quiet = self._quiet and not machine_busy(self.threads)
        keep(self.path, costs.measured(), engine.target, engine.draft_model, quiet=quiet)
        self.source = "measured" if quiet else "measured (busy machine)"
        log.info("costs %s: %d timings in %.0f s while idle", self.source, self.timings_done,
                 time.monotonic() - self._started)
        self.estimated, self.pending, self._timings, self.timing = False, not quiet, None, None
        self._plan_from(costs)
        return REMEASURE_WAIT_S if self.pending else None

    def progress(self) -> dict:
        """What the engine plans from ("kept", "estimate", "measured", each maybe "(busy machine)": other work took
        the cores while it was timed) and, while a full measurement runs, how far along it is."""
        out: dict = {"source": self.source}
        if self._timings is not None:
            out |= {"measuring": self.timing, "timings_done": self.timings_done}
        elif self.pending:
            out["measuring"] = "waiting for a quiet machine" if self.waits_for_quiet else "when the server is idle"
        return out

    def _draft_kv(self) -> BatchedCache | None:
        return self.engine.drafter.kv if self.engine.drafter is not None else None

    def _synchronize(self) -> None:
        for model in (self.engine.target, self.engine.draft_model):
            if model is not None:
                model.synchronize()

    def _plan_from(self, costs: BatchCosts) -> None:
        # As Engine.calibrate plans from what it measured.
        engine = self.engine
        costs.steady_draft = engine.drafter is not None and engine.draft_model.steady_shapes
        engine.costs = costs.pad_rows(engine.target_kv.padded_rows)
