"""tandem: lossless speculative decoding with a draft model on the same device as the target.

The public names load on first use (PEP 562), so that a process importing only part of tandem does not import
torch: the llama.cpp worker process (tandem.backends.llamacpp_worker) must not, beside a CUDA build of llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {"load": "tandem.api", "generate": "tandem.api", "generate_batch": "tandem.api",
            "stream_generate": "tandem.api", "GenerationChunk": "tandem.api", "GenerationResult": "tandem.api",
            "Engine": "tandem.engine", "Request": "tandem.engine", "SamplingParams": "tandem.sampling",
            "GenerationStats": "tandem.speculative.stats"}

if TYPE_CHECKING:
    from tandem.api import GenerationChunk, GenerationResult, generate, generate_batch, load, stream_generate
    from tandem.engine import Engine, Request
    from tandem.sampling import SamplingParams
    from tandem.speculative.stats import GenerationStats

__all__ = ["load", "generate", "generate_batch", "stream_generate", "Engine", "Request", "GenerationResult",
           "GenerationChunk", "GenerationStats",
           "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
