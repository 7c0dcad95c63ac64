"""Measure a pair's costs on the device it runs on, once per (target, proposer kind), for the adaptive policy.

A few forwards on scratch sequences: the draft's one-token step, and the target's forward over n = 1, 2 and
k_max + 1 tokens (a forward's cost is affine in n, so the policy interpolates the rest). The decode loop then
refines every figure from the iterations it really runs.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterable

from tandem.backends.base import Model, Sequence
from tandem.spec.policy import AdaptivePolicy, CostModel
from tandem.spec.proposer import DraftModelProposer, Proposer

WARMUP_TOKENS = 16  # context the timed forwards attend over, and a warm-up of kernels and caches
REPEATS = 3
NGRAM_STEP_MS = 0.01  # a dictionary lookup; measured online from there
NGRAM_PRIOR = (0.5, 2.0)  # prompt lookup proposes often-wrong continuations until the request shows otherwise
CATCH_UP_TOKENS = 8  # a draft's forward over this many tokens prices its catch-up after plain steps


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


def measure_costs(target: Model, draft: Model | None, k_max: int) -> CostModel:
    k_max = max(0, min(k_max, target.n_ctx - 2))  # a verify of k_max + 1 tokens must fit in the context
    verify_ms = time_forwards_ms(target, {1, 2, k_max + 1})
    if draft is None:
        return CostModel(draft_step_ms=NGRAM_STEP_MS, verify_ms=verify_ms, catch_up_ms_per_token=0.0)
    draft_ms = time_forwards_ms(draft, [1, CATCH_UP_TOKENS], drafting=True)
    return CostModel(draft_step_ms=draft_ms[1], verify_ms=verify_ms,
                     catch_up_ms_per_token=draft_ms[CATCH_UP_TOKENS] / CATCH_UP_TOKENS)


def cached_costs(target: Model, draft: Model | None, k_max: int) -> CostModel:
    """Costs measured once per pair and k_max; each request gets its own copy to refine."""
    cache = target.__dict__.setdefault("_tandem_costs", {})
    key = (id(draft), k_max)
    if key not in cache:
        cache[key] = measure_costs(target, draft, k_max)
    return copy.deepcopy(cache[key])


def policy_for(target: Model, proposer: Proposer, draft_max: int) -> AdaptivePolicy:
    if isinstance(proposer, DraftModelProposer):
        return AdaptivePolicy(cached_costs(target, proposer.draft, draft_max), draft_max)
    return AdaptivePolicy(cached_costs(target, None, draft_max), draft_max, prior=NGRAM_PRIOR)
