"""OpenAI's response shapes for /v1/chat/completions and /v1/completions: whole responses, stream chunks, choices,
log-probabilities, usage, and llama-server's `timings` with tandem's own fields (protocol.py parses the requests).
Reference: https://platform.openai.com/docs/api-reference/chat and llama.cpp's tools/server README (`timings`).
"""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from tandem.engine.generation import TokenLogprob
from tandem.speculative.stats import GenerationStats


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def timings(stats: GenerationStats, queue_ms: float = 0.0) -> dict[str, Any]:
    """llama-server's `timings` object for this request only, plus tandem's own fields (docs/api.md lists them)."""
    def per_second(n: int, ms: float) -> float:
        return 1000.0 * n / ms if ms > 0 else 0.0

    return {
        "cache_n": stats.cached_tokens,
        "prompt_n": stats.prompt_tokens - stats.cached_tokens,
        "prompt_ms": stats.prefill_ms,
        "prompt_per_second": per_second(stats.prompt_tokens - stats.cached_tokens, stats.prefill_ms),
        "predicted_n": stats.generated_tokens,
        "predicted_ms": stats.decode_ms,
        "predicted_per_second": per_second(stats.generated_tokens, stats.decode_ms),
        "draft_n": stats.draft_tokens,
        "draft_n_accepted": stats.accepted_tokens,
        "draft_ms": stats.draft_ms,
        "verify_ms": stats.verify_ms,
        "acceptance_rate": stats.acceptance_rate,
        "iterations": stats.iterations,
        "queue_ms": queue_ms,
        "policy_acceptance": stats.belief.get("acceptance", {}),
        "policy_predicted_speedup": stats.belief.get("predicted_speedup"),
        "sources": stats.sources,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV an earlier request left (not recomputed)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


Kind = Literal["chat", "text"]


def logprobs_object(kind: Kind, entries: list[TokenLogprob], piece: Callable[[int], str],
                    token_bytes: Callable[[int], bytes], text_offsets: list[int] | None = None) -> dict[str, Any]:
    """OpenAI's logprobs for `entries`: chat's {"content": [{token, logprob, bytes, top_logprobs}]}, or the
    completions API's parallel lists (tokens, token_logprobs, top_logprobs, text_offset: `text_offsets`, each
    token's first character in the text). piece(id) is a token's text, token_bytes(id) its own bytes (a token
    holding part of a UTF-8 character has those bytes, which joined give the text back). The values are the target's
    raw log-probabilities (see TokenLogprob); an echoed prompt's first token has none (logprob None), which OpenAI
    shows as null."""
    if kind == "chat":
        def one(token: int, logprob: float) -> dict[str, Any]:
            return {"token": piece(token), "logprob": logprob, "bytes": list(token_bytes(token))}

        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                            for e in entries], "refusal": None}
    return {"tokens": [piece(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else {piece(t): v for t, v in e.top} for e in entries],
            "text_offset": text_offsets or [0] * len(entries)}


class TextOffsets:
    """Completions' text_offset: where each token's text begins, in characters of the text its bytes decode to (a
    token that ends inside a character adds none until the character is complete)."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self.token_bytes, self.chars = token_bytes, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.all: list[int] = []  # every token's offset so far

    def take(self, tokens: list[int]) -> list[int]:
        offsets = []
        for token in tokens:
            offsets.append(self.chars)
            self.chars += len(self.decoder.decode(self.token_bytes(token)))
        self.all += offsets
        return offsets


def choice_object(kind: Kind, index: int, text: str | None, finish_reason: str, logprobs: dict[str, Any] | None,
                  tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One choice of a whole (non-streamed) response; a chat choice with tool calls has content None when the
    model wrote nothing else, as OpenAI's do."""
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(kind: Kind, request_id: str, model: str, choices: list[dict[str, Any]],
                         usage_: dict[str, int], timings_: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    """A whole (non-streamed) chat.completion or text_completion object. timings_: one dict for one choice; for
    n > 1, one per choice, which each choice carries (the top level then has none)."""
    obj = "chat.completion" if kind == "chat" else "text_completion"
    response = {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
                "usage": usage_}
    if isinstance(timings_, dict):
        response["timings"] = timings_
    else:
        for choice, t in zip(choices, timings_, strict=True):
            choice["timings"] = t
    return response


def stream_chunk(kind: Kind, request_id: str, created: int, model: str, text: str | None,
                 finish_reason: str | None = None, role: bool = False,
                 logprobs: dict[str, Any] | None = None, index: int = 0,
                 tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One chat.completion.chunk (or streamed text_completion) for choice `index`, carrying `text` (and the
    logprobs of the tokens that came with it, and tool-call deltas); each choice's first chat chunk has the role."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
