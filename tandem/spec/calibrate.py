"""Measure a pair's costs on the device it runs on, once per (target, proposer kind), for the adaptive policy.

A few forwards on scratch sequences: the draft's one-token step, and the target's forward over n = 1, 2 and
k_max + 1 tokens (a forward's cost is affine in n, so the policy interpolates the rest). The decode loop then
refines every figure from the iterations it really runs.
"""

from __future__ import annotations

import copy
import statistics
import time

from tandem.backends.base import Model
from tandem.spec.policy import AdaptivePolicy, CostModel
from tandem.spec.proposer import DraftModelProposer, Proposer

WARMUP_TOKENS = 16  # context the timed forwards attend over, and a warm-up of kernels and caches
REPEATS = 3
NGRAM_STEP_MS = 0.01  # a dictionary lookup; measured online from there
NGRAM_PRIOR = (0.5, 2.0)  # prompt lookup proposes often-wrong continuations until the request shows otherwise


def time_forward_ms(model: Model, n_tokens: int, repeats: int = REPEATS, context: int = WARMUP_TOKENS) -> float:
    """Median ms of one forward of n_tokens after `context` tokens, on a scratch sequence (rolled back each time)."""
    if n_tokens + 1 > model.n_ctx:
        raise ValueError(f"cannot time a forward of {n_tokens} tokens in a context of {model.n_ctx}")
    context = max(1, min(context, model.n_ctx - n_tokens))
    seq = model.new_sequence()  # the capacity decoding uses: attention over a static cache costs by capacity
    try:
        token = model.tokenizer.bos_token_id or 0
        seq.forward([token] * context, logits="last")
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up (allocations, graph capture)
            model.synchronize()
            started = time.perf_counter()
            seq.forward([token] * n_tokens, logits="all")
            model.synchronize()
            times.append(1000.0 * (time.perf_counter() - started))
            seq.rewind(context)
        return statistics.median(times[1:])
    finally:
        seq.close()


def measure_costs(target: Model, draft: Model | None, k_max: int) -> CostModel:
    k_max = max(0, min(k_max, target.n_ctx - 2))  # a verify of k_max + 1 tokens must fit in the context
    draft_step = time_forward_ms(draft, 1) if draft is not None else NGRAM_STEP_MS
    sizes = sorted({1, 2, k_max + 1})
    return CostModel(draft_step_ms=draft_step, verify_ms={n: time_forward_ms(target, n) for n in sizes})


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
