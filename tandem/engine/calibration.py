"""The batched engine's costs, timed on the engine's own caches (`measure`): the target's forward over B sequences of
n rows each, V(B, n), for B = 1, 2, 4, ... up to the slots; the draft's one-row step over B sequences; the draft's
catch-up; a change of the target's shape; and what feeding the draft beside a verify adds. The planner
(`planner.plan`) decides from them; the loop refines some as it runs (`BatchCosts.observe_*`). One sequence's
costs (the doctor's, `tandem bench`'s predictions) are measured here too (`measure_costs`).

A server does not wait for all of that (`tandem serve` on a 2-core CPU: 33 s of a 40 s start, minutes beside another
job): it starts on the costs kept from an earlier start, or on `estimate` (batch 1 only, once each, the rest read off
that line: a few seconds), and runs `measure_steps` a timing at a time while it has nothing else to do (every slot is
empty between two timings, so requests can run in between), then plans from what it measured.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Generator, Iterable
from collections.abc import Sequence as Seq
from contextvars import ContextVar
from typing import TypeVar

from tandem.backends.base import BatchedCache, Model, Sequence
from tandem.config import POLICY
from tandem.engine.costs import NGRAM_STEP_MS, BatchCosts, CostModel

T = TypeVar("T")
log = logging.getLogger("tandem.calibration")
# Calibrator.step's `hurry`, for the timings it runs: whether a request waits, and a timing should end at the runs it
# has (one past the warm-up) instead of holding it back for all REPEATS.
HURRY: ContextVar[Callable[[], bool] | None] = ContextVar("tandem_calibration_hurry", default=None)
# Calibrator.step's slots to time in, the least recently used first (a server's free slots, whose kept prompts a
# timing overwrites): a batch of b takes the first b, so a conversation's slot is the last a timing takes.
SCRATCH: ContextVar[Seq[int] | None] = ContextVar("tandem_calibration_scratch", default=None)

CONTEXT = 16  # tokens each timed sequence attends over (and a warm-up of kernels and caches)
REPEATS = 3
STABLE_ROUNDS = 5  # measure_costs: at most this many measuring rounds ...
STABLE_TOLERANCE = 0.05  # ... until two in a row agree within this on every figure
ESTIMATE_RUNS = 2  # estimate: timed forwards of each size
AHEAD_PAIRS = 7  # feed-ahead: differences of a verify with and without the feed (_feed_ahead_ms)
# Rows a sequence at which the target's forward is timed: 1, 2 and k_max + 1, then PROBE_ROWS; where V there is
# off the line through the others by NONLINEAR, FINE_ROWS too. V(n) need be no straight line (llama.cpp's Vulkan
# matrix-vector kernel takes up to 8 columns); on a CPU it is one, and the probe is all it costs.
# The measurements behind these constants: docs/decisions/0005-cost-model.md.
PROBE_ROWS = (5,)
FINE_ROWS = (3, 8)
NONLINEAR = 0.15
CATCH_UP_ROWS = (8, 32)  # a draft's catch-up forward is timed over these many tokens
# A change of shape is timed between a plain step and a verify of this many drafts (+ 1 rows): a typical one. Between
# 1 and 2 rows ggml-cuda updates its captured graph in place, where a verify of 4 rows instantiates a new one.
SWITCH_DRAFTS = 3


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
    free; its kept prompt prefixes must be forgotten first: KVSlots.forget_prefixes)."""
    batches = batch_sizes(target.slots)
    k_max = max(0, min(k_max, target.capacity - CONTEXT - 1))
    costs = BatchCosts()
    for b in batches:
        costs.verify[b] = yield from _verify_steps(target, b, k_max, synchronize)
        if draft is not None:
            yield f"the draft's step over {b} sequences"
            costs.draft_step[b] = _time(draft, b, 1, synchronize)
    if draft is not None:
        # Two sizes, a base and a price a token: on a GPU a forward's cost hardly grows with its tokens, on a CPU
        # the base is near 0. Each reads its last row, as the drafter's catch-ups do (a 152k vocabulary's rows are
        # 0.6 MB a token); an evidence read's rows read back are priced apart (evidence_row_ms).
        yield "the draft's catch-up"
        short = _time(draft, 1, CATCH_UP_ROWS[0], synchronize, last_only=True)
        long = _time(draft, 1, CATCH_UP_ROWS[1], synchronize, last_only=True) \
            if draft.capacity >= CONTEXT + CATCH_UP_ROWS[1] else short * CATCH_UP_ROWS[1] / CATCH_UP_ROWS[0]
        costs.catch_up_ms_per_token = max(0.0, long - short) / (CATCH_UP_ROWS[1] - CATCH_UP_ROWS[0])
        costs.catch_up_base_ms = max(0.0, short - CATCH_UP_ROWS[0] * costs.catch_up_ms_per_token)
        if draft.capacity >= CONTEXT + POLICY.evidence_rows:
            yield "the draft's evidence read"
            every = _time(draft, 1, POLICY.evidence_rows, synchronize)
            last = _time(draft, 1, POLICY.evidence_rows, synchronize, last_only=True)
            costs.evidence_row_ms = max(0.0, every - last) / (POLICY.evidence_rows - 1)
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
    slot = _scratch(cache, 1)[0]
    cache.forward([(slot, [0] * CONTEXT)], [True])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(ESTIMATE_RUNS):
        for n in sorted(sizes, reverse=True):
            times[n].append(_timed(cache, [slot], n, synchronize, last_only=last_only))
    _rewind(cache, [slot], 0)
    return times


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
    slots = _scratch(cache, batch)
    cache.forward([(s, [0] * CONTEXT) for s in slots], [True] * batch)

    def once() -> float:
        for _ in range(calls if after is not None else 0):
            cache.forward([(s, [0] * after) for s in slots], [False] * batch)
            _rewind(cache, slots, CONTEXT)
        return sum(_timed(cache, slots, rows, synchronize, last_only=last_only) for _ in range(calls))

    hurry = HURRY.get()
    times = [once(), once()]  # the warm-up and one timed run at least
    while len(times) < REPEATS + 1 and not (hurry and hurry()):
        times.append(once())
    _rewind(cache, slots, 0)
    return statistics.median(times[1:])


def _feed_ahead_ms(target: BatchedCache, draft: BatchedCache, batch: int, rows: int, synchronize) -> float:
    """What feeding a draft row a slot beside a verify of `rows` rows a slot adds to it: the median of AHEAD_PAIRS
    differences, the verify timed alone and with the feed in turn (the first two pairs dropped: ggml-cuda captures
    its graphs on a shape's second forward): two medians taken apart moved with the host."""
    slots = _scratch(target, batch)
    _rewind(draft, slots, 0)
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


def _scratch(cache: BatchedCache, batch: int) -> list[int]:
    """The slots a timing of `batch` sequences runs in (SCRATCH's first, else 0..batch-1), emptied."""
    order = SCRATCH.get()
    slots = list(order[:batch]) if order is not None and len(order) >= batch else list(range(batch))
    _rewind(cache, slots, 0)
    return slots


def _rewind(cache: BatchedCache, slots: list[int], length: int) -> None:
    for s in slots:
        cache.rewind(s, length)


# --- one sequence's costs (the doctor's, the bench's predictions) -------------------------------------------

def warm_up(model: Model, seq: Sequence, context: int, seconds: float) -> None:
    """One-token forwards on seq (rolled back to `context` after each) for `seconds`, at least three: a device idle
    before it runs at idle clocks, and Vulkan drivers build pipelines on first use."""
    token = model.tokenizer.bos_token_id or 0
    deadline, runs = time.perf_counter() + seconds, 0
    while runs < 3 or time.perf_counter() < deadline:
        seq.forward([token], logits="last")
        seq.rewind(context)
        runs += 1
    model.synchronize()


def time_forwards_ms(model: Model, sizes: Iterable[int], repeats: int = REPEATS,
                     context: int = CONTEXT, drafting: bool = False, warmup_s: float = 0.0) -> dict[int, float]:
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


def time_head_step_ms(target: Model, head: Model, repeats: int = REPEATS, context: int = CONTEXT) -> float:
    """Median ms of a head draft's step (one token over the target's KV of `context` tokens: a head runs only
    beside its target, docs/decisions/0004); the first is a warm-up."""
    context = max(1, min(context, target.n_ctx - 2))
    kv = target.new_batched_cache(1, context + 2)
    head_kv = kv.attach_head(head)
    try:
        token = target.tokenizer.bos_token_id or 0
        kv.forward([(0, [token] * context)], [True])
        times = []
        for _ in range(repeats + 1):
            target.synchronize()
            started = time.perf_counter()
            head_kv.forward([(0, [token])], [True])
            target.synchronize()
            times.append(1000.0 * (time.perf_counter() - started))
        return statistics.median(times[1:])
    finally:
        head_kv.close()
        kv.close()


def _measure_once(target: Model, draft: Model | None, k_max: int) -> CostModel:
    from tandem.speculative.compat import is_head

    verify_ms = time_forwards_ms(target, {1, 2, k_max + 1})
    if draft is None:
        return CostModel(draft_step_ms=NGRAM_STEP_MS, verify_ms=verify_ms, catch_up_ms_per_token=0.0)
    if is_head(draft):  # reads the target's KV: nothing to catch up on
        return CostModel(draft_step_ms=time_head_step_ms(target, draft), verify_ms=verify_ms,
                         catch_up_ms_per_token=0.0)
    draft_ms = time_forwards_ms(draft, [1, CATCH_UP_ROWS[0]], drafting=True)
    return CostModel(draft_step_ms=draft_ms[1], verify_ms=verify_ms,
                     catch_up_ms_per_token=draft_ms[CATCH_UP_ROWS[0]] / CATCH_UP_ROWS[0])


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
