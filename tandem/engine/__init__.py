"""The batched engine: many requests decoded together, each speculating on its own.

    engine.py     Engine: admission, one batched step (draft, verify, accept) for every running sequence
    planner.py    what each sequence does next: draft lengths from measured batched costs (pure functions)
    kv_pool.py    which KV slot a request gets, and the prompt prefix it can reuse there
    sequence.py   one request's state (Generation), its text stream, the chunks the engine yields
"""

from tandem.engine.engine import Engine
from tandem.engine.sequence import GenerationChunk, GenerationResult, Request

__all__ = ["Engine", "GenerationChunk", "GenerationResult", "Request"]
