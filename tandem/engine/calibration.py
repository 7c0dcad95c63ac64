"""The batched engine's costs, timed on the engine's own caches at start-up (`measure`): the target's forward over
B sequences of n rows each, V(B, n), for B = 1, 2, 4, ... up to the slots; the draft's one-row step over B sequences;
the draft's catch-up; a change of the target's shape; and what feeding the draft beside a verify adds. The planner
(`planner.plan`) decides from them; the loop refines some as it runs (`BatchCosts.observe_*`). (The doctor's
one-request costs are `tandem.speculative.calibrate`'s.)
"""

from __future__ import annotations

import statistics
import time

from tandem.backends.base import BatchedCache
from tandem.engine.planner import BatchCosts
from tandem.speculative.policy import EVIDENCE_ROWS, CostModel

CONTEXT = 16  # tokens each timed sequence attends over
REPEATS = 3
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


def measure(target: BatchedCache, draft: BatchedCache | None, k_max: int, synchronize) -> BatchCosts:
    """Time the target's forward over B sequences of 1, 2, k_max + 1 (and, see PROBE_ROWS, more) rows each, the
    draft's one-row step over B sequences, for B = 1, 2, 4, ... up to the slots, the draft's catch-up and a change
    of shape (the caches must be empty: slots are scratch here)."""
    batches = [1]
    while batches[-1] * 2 <= target.slots:
        batches.append(batches[-1] * 2)
    if batches[-1] != target.slots:
        batches.append(target.slots)
    k_max = max(0, min(k_max, target.capacity - CONTEXT - 1))
    costs = BatchCosts()
    for b in batches:
        costs.verify[b] = _verify_costs(target, b, k_max, synchronize)
        if draft is not None:
            costs.draft_step[b] = _time(draft, b, 1, synchronize)
    if draft is not None:
        # Two sizes, a base and a price a token: on a GPU a forward's cost hardly grows with its tokens (Vulkan, H200:
        # 2.0 ms + 0.47 a token), where an 8-token forward's price a token priced a prompt's catch-up several times
        # over; on a CPU the base is near 0. Each reading its last row, as the drafter's catch-ups do: read back
        # whole, a 152k vocabulary's rows are 0.6 MB a token, and on this CPU cost a 0.5B draft 35% more at 32 rows
        # (bench/catch_up_rows.py); an evidence read's rows read back are priced apart (evidence_row_ms).
        short = _time(draft, 1, CATCH_UP_ROWS[0], synchronize, last_only=True)
        long = _time(draft, 1, CATCH_UP_ROWS[1], synchronize, last_only=True) \
            if draft.capacity >= CONTEXT + CATCH_UP_ROWS[1] else short * CATCH_UP_ROWS[1] / CATCH_UP_ROWS[0]
        costs.catch_up_ms_per_token = max(0.0, long - short) / (CATCH_UP_ROWS[1] - CATCH_UP_ROWS[0])
        costs.catch_up_base_ms = max(0.0, short - CATCH_UP_ROWS[0] * costs.catch_up_ms_per_token)
        if draft.capacity >= CONTEXT + EVIDENCE_ROWS:
            every = _time(draft, 1, EVIDENCE_ROWS, synchronize)
            last = _time(draft, 1, EVIDENCE_ROWS, synchronize, last_only=True)
            costs.evidence_row_ms = max(0.0, every - last) / (EVIDENCE_ROWS - 1)
    if k_max > 0:  # plain steps after a verify, and verifies after a plain step, against each repeated
        # Two forwards after the change: llama.cpp's CUDA build runs the first uncaptured and captures the second
        # (ggml-cuda's graph warm-up), replaying only from the third; elsewhere the second reuses the graph.
        rows = min(k_max, SWITCH_DRAFTS) + 1
        same = costs.verify[1].verify_ms  # each shape repeated, as timed above where it was
        repeated = {n: 2 * same[n] if n in same else _time(target, 1, n, synchronize, calls=2) for n in (1, rows)}
        plain_after_verify = _time(target, 1, 1, synchronize, after=rows, calls=2) - repeated[1]
        verify_after_plain = _time(target, 1, rows, synchronize, after=1, calls=2) - repeated[rows]
        costs.switch_ms = max(0.0, (plain_after_verify + verify_after_plain) / 2)
        if draft is not None and target.overlaps(draft):
            for b in batches:  # a typical verify, alone and with a draft row a sequence fed beside it
                costs.ahead_ms[b] = _feed_ahead_ms(target, draft, b, rows, synchronize)
            costs.decide_feeding_ahead()
    return costs


def _verify_costs(target: BatchedCache, batch: int, k_max: int, synchronize) -> CostModel:
    """V(batch, R) at R = batch x 1, 2 and k_max + 1 rows, and at PROBE_ROWS; at FINE_ROWS as well where a probe
    is off the line through the others."""
    def timed(rows: list[int]) -> dict[int, float]:
        return {batch * n: _time(target, batch, n, synchronize) for n in rows}

    table = timed(sorted({1, 2, k_max + 1}))
    probes = timed([n for n in PROBE_ROWS if 2 < n < k_max + 1])
    line = CostModel(draft_step_ms=0.0, verify_ms=dict(table))
    if any(abs(ms - line.verify(r)) > NONLINEAR * ms for r, ms in probes.items()):
        table |= timed([n for n in FINE_ROWS if n <= k_max and batch * n not in probes])
    return CostModel(draft_step_ms=0.0, verify_ms=table | probes)


def _time(cache: BatchedCache, batch: int, rows: int, synchronize, after: int | None = None, calls: int = 1,
          last_only: bool = False) -> float:
    """Median ms of `calls` forwards in a row of `rows` tokens in each of `batch` slots, after CONTEXT tokens (the
    first run is a warm-up), each run right after as many untimed forwards of `after` rows where given (a change of
    shape, from a shape run as long: ggml-cuda has captured it, as it has a verify in the loop, and a capture must
    then instantiate a new graph where one left captured at `rows` would be updated in place); every slot is
    rewound to empty after. Every row's logits are read back, as a verify reads them, unless last_only."""
    slots = list(range(batch))
    cache.forward([(s, [0] * CONTEXT) for s in slots], [True] * batch)

    def run() -> float:
        for _ in range(calls if after is not None else 0):
            cache.forward([(s, [0] * after) for s in slots], [False] * batch)
            _rewind(cache, slots, CONTEXT)
        return sum(_timed(cache, slots, rows, synchronize, last_only=last_only) for _ in range(calls))

    times = [run() for _ in range(REPEATS + 1)]
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
