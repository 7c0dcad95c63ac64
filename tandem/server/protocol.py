"""OpenAI's request and response shapes for /v1/chat/completions and /v1/completions, and their validation.

Requests are parsed from the raw body with pydantic in strict JSON mode, so a known field of the wrong type is a 400
naming the field (OpenAI does the same), while unknown fields are ignored (OpenAI's clients send extras such as
`presence_penalty` or `logit_bias`). Every error leaves the server as `{"error": {message, type, param, code}}`.
Reference: https://platform.openai.com/docs/api-reference/chat and llama.cpp's tools/server README (`timings`).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.engine.sequence import MAX_TOP_LOGPROBS, TokenLogprob
from tandem.logits.options import logits_settings
from tandem.logits.processor import DEFAULT_REPEAT_LAST_N, MAX_PENALTY, LogitsError, LogitsSettings
from tandem.spec.stats import GenerationStats

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_DRAFT_OVERRIDE = 64  # a per-request draft_max above this is surely a mistake (and each new k calibrates once)
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error the client caused (or may retry), sent as OpenAI's error object with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- requests -------------------------------------------------------------------------------------------------

class _Lenient(BaseModel):
    """Strict types for the fields we know, silence for the ones we don't."""

    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class SpeculativeOptions(_Lenient):
    """Per-request draft override: {"draft_max": k} caps draft tokens per iteration; {"enabled": false} is off."""

    enabled: bool = True
    draft_max: int | None = Field(None, ge=0, le=MAX_DRAFT_OVERRIDE)


class JSONSchemaFormat(_Lenient):
    """response_format.json_schema: the schema the output must match (name, description, strict: informative)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _GenerationRequest(_Lenient):
    """Fields common to chat and text completions. Defaults are OpenAI's (temperature 1, top_p 1)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    speculative: bool | SpeculativeOptions | None = None
    # Logits processing (tandem.logits): structured output, OpenAI's bias and penalties, llama-server's extras.
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # llama-server's: a GBNF grammar (or a Lark one) the output must match
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    repeat_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)  # llama-server's; 1 = off
    repeat_last_n: int = Field(DEFAULT_REPEAT_LAST_N, ge=-1)  # its window: -1 = the whole context, 0 = off

    def checked(self) -> _GenerationRequest:
        """Cross-field checks pydantic's per-field constraints can't express."""
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: only n=1 (no batching)", param="n")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                           param="stop")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise APIError(400, f"seed must fit in 64 bits, got {self.seed}", param="seed")
        return self

    def logits_settings(self, vocab: int) -> LogitsSettings | None:
        """The request's logits processing for a model of `vocab` logits (None: none), or a 400 naming the field."""
        fmt = self.response_format
        try:
            return logits_settings(fmt and fmt.model_dump(by_alias=True), None, self.grammar, self.logit_bias,
                                   self.frequency_penalty, self.presence_penalty, self.repeat_penalty,
                                   self.repeat_last_n, vocab)
        except LogitsError as e:
            raise APIError(400, str(e), param=e.param) from None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprobs_count(self) -> int | None:
        """None: no logprobs; n >= 0: each token's logprob and its n likeliest alternatives."""
        return None

    def draft_override(self) -> tuple[bool, int | None]:
        """(speculation enabled, draft_max override or None)."""
        spec = self.speculative
        if spec is None or spec is True:
            return True, None
        if spec is False:
            return False, None
        return spec.enabled, spec.draft_max


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def checked(self) -> ChatCompletionRequest:
        super().checked()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                raise APIError(400, f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}",
                               param=f"messages[{i}].role")
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"messages[{i}].content[{j}]: only {{type: 'text', text}} parts are "
                                       f"supported, got type {part.type!r}", param=f"messages[{i}].content")
        return self

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template wants them: content as one string, `developer` as `system`."""
        out = []
        for m in self.messages:
            text = m.content if isinstance(m.content, str) else "".join(p.text or "" for p in m.content)
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
        return out


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def checked(self) -> CompletionRequest:
        super().checked()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise APIError(400, f"a batch of {len(self.prompt)} prompts is not supported (n/batch not "
                               f"supported): send one prompt per request", param="prompt")
            self.prompt = self.prompt[0]
        return self


def parse_request(model: type[_GenerationRequest], body: bytes) -> Any:
    """Validate a raw JSON body into `model`; raise APIError(400) naming the first offending field."""
    if not body.strip():
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        # The deepest location is the most specific: for `stop: [1]` it is stop[0], not the `str` branch of stop.
        err = max(e.errors(include_url=False), key=lambda x: len(x["loc"]))
        if err["type"] == "json_invalid":
            raise APIError(400, f"malformed JSON in the request body: {err['msg']}") from None
        param = _param_name(err["loc"])
        where = f"{param}: " if param else "the request body: "
        raise APIError(400, where + err["msg"], param=param) from None
    return request.checked()


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


def _param_name(loc: tuple) -> str | None:
    """'messages[0].content' from pydantic's loc, dropping the union-member tags it inserts ('str', 'list[int]')."""
    name = ""
    for item in loc:
        if isinstance(item, int):
            name += f"[{item}]"
        elif not _TYPE_TAG.match(item):
            name += f".{item}" if name else item
    return name or None


# --- responses ------------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def timings(stats: GenerationStats, queue_ms: float = 0.0) -> dict[str, Any]:
    """llama-server's `timings` object for one request, plus tandem's own fields.

    Every figure covers this request only (never a server-lifetime total); durations are milliseconds.
    prompt_*: the prefill (target and draft prompt processing, up to the first token) of the prompt tokens not
    reused; cache_n: prompt tokens whose KV an earlier request left in the slot (prefix reuse). predicted_*: tokens
    returned and the decode time after the first token (as llama-server counts them). draft_n / draft_n_accepted:
    draft tokens proposed to the verifier / accepted by it. draft_ms / verify_ms: total time drafting / in the
    target's verify (or plain) forwards; iterations: target forwards after the prefill; queue_ms: time waiting
    for a slot before the prefill began. policy_acceptance / policy_predicted_speedup: what the adaptive policy
    believed at the end (acceptance per draft source; the mean speed-up over plain it predicted for its plans), so
    a user can see why it drafted or did not; sources: per source, iterations, drafted and accepted tokens.
    """
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
                    text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs for `entries`: chat's {"content": [{token, logprob, bytes, top_logprobs}]}, or the
    completions API's parallel lists (tokens, token_logprobs, top_logprobs, text_offset from `text_offset`).
    piece(id) is a token's text. The values are the target's raw log-probabilities (see TokenLogprob)."""
    if kind == "chat":
        def one(token: int, logprob: float) -> dict[str, Any]:
            text = piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                            for e in entries], "refusal": None}
    offsets, at = [], text_offset
    for e in entries:
        offsets.append(at)
        at += len(piece(e.token))
    return {"tokens": [piece(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{piece(t): v for t, v in e.top} for e in entries], "text_offset": offsets}


def completion_response(kind: Kind, request_id: str, model: str, text: str, finish_reason: str,
                        usage_: dict[str, int], timings_: dict[str, Any],
                        logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole (non-streamed) chat.completion or text_completion object."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage_, "timings": timings_}


def stream_chunk(kind: Kind, request_id: str, created: int, model: str, text: str | None,
                 finish_reason: str | None = None, role: bool = False,
                 logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One chat.completion.chunk (or streamed text_completion) carrying `text` (and the logprobs of the tokens
    that came with it); the first chat chunk has the role."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
