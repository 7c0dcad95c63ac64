"""tandem: lossless speculative decoding with a draft model on the same device as the target."""

from tandem.api import GenerationChunk, GenerationResult, generate, generate_batch, load, stream_generate
from tandem.engine import Engine, Request
from tandem.sampling import SamplingParams
from tandem.spec.stats import GenerationStats

__all__ = ["load", "generate", "generate_batch", "stream_generate", "Engine", "Request", "GenerationResult",
           "GenerationChunk", "GenerationStats",
           "SamplingParams"]
__version__ = "0.1.0"
