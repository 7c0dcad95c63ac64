"""The batched engine: many requests decoded together, each speculating on its own.

    engine.py          Engine: one batched step (admit, plan, propose, forward, verify, accept, observe)
    batch.py           the generations waiting and running; admission, a step's prompt chunks
    proposers.py       the propose stage: prompt lookup, a draft model or head (its Drafter)
    policy.py          DraftPolicy: what each sequence drafts (source, length, first reads), and what steps teach
    planner.py         draft lengths from measured batched costs (pure functions)
    costs.py           the cost model: one sequence's (CostModel) and a batch's (BatchCosts), one interpolation
    calibration.py     those costs timed on the device (a batch's on the engine's caches, one sequence's)
    cost_store.py      costs kept on disk per device, pair and shape; a server's Calibrator
    drafter.py         the draft model's side: its slots, catch-ups, drafts, evidence reads
    outcomes.py        a step's outcome per sequence, read back in one transfer
    run_ahead.py       a lone sequence's plain steps queued ahead of the host
    kv_pool.py         the KV slots: which one a request gets, the prompt prefix it reuses there, what it keeps
    scoring.py         log-probabilities of prompts and emitted tokens
    generation.py      one request's state (Generation), its text stream, the chunks the engine yields
"""

from tandem.engine.engine import Engine
from tandem.engine.generation import GenerationChunk, GenerationResult, Request

__all__ = ["Engine", "GenerationChunk", "GenerationResult", "Request"]
