"""tandem: lossless speculative decoding with a draft model on the same device as the target."""

from tandem.api import GenerationChunk, GenerationResult, generate, load, stream_generate
from tandem.sampling import SamplingParams
from tandem.spec.stats import GenerationStats

__all__ = ["load", "generate", "stream_generate", "GenerationResult", "GenerationChunk", "GenerationStats",
           "SamplingParams"]
__version__ = "0.1.0"
