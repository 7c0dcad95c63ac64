"""What /openapi.json says about the API: the request bodies (the models that also validate them: protocol.py's,
openai_responses.py's, anthropic_messages.py's) and the responses (models here that only describe; the handlers
build the JSON themselves).
More: docs/internals.md."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

REQUEST_MODELS: list[type[BaseModel]] = []  # every operation's body model (request_body adds them)
_REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for an operation whose JSON body is `model` (its schema joins the document's components)."""
    if model not in REQUEST_MODELS:
        REQUEST_MODELS.append(model)
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install(app: FastAPI) -> None:
    """Make app.openapi() include the request models' schemas (once, cached as FastAPI caches its own)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description,
                                   routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS], ref_template=_REF)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(defs.get("$defs", {}))
            # FastAPI documents a 422 for any operation with parameters; this server answers invalid input with
            # OpenAI's 400 instead (the RequestValidationError handler in app.py).
            for operations in document["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi


# --- responses (description only) -------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error (4xx) or server_error")
    param: str | None = Field(description="the offending request field, e.g. messages[0].content")
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error object: every 4xx and 5xx."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = Field(description="summed over the n choices")
    total_tokens: int
    prompt_tokens_details: dict[str, int] = Field(description="cached_tokens: prompt tokens whose KV was reused")


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object, serialized")


class ToolCallOut(BaseModel):
    id: str = Field(description="call_...")
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the reply is only tool calls")
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = Field(description='{"content": [{token, logprob, bytes, top_logprobs}]}')
    finish_reason: Literal["stop", "length", "tool_calls"]
    timings: dict[str, Any] | None = Field(None, description="n > 1: this choice's timings")


class ChatCompletion(BaseModel):
    """A chat.completion; with stream: true, text/event-stream of chat.completion.chunk objects instead, each for
    one choice (`index`), ending with `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str = Field(description="the served model's id")
    choices: list[ChatChoice]
    usage: Usage
    timings: dict[str, Any] | None = Field(None, description="n = 1: llama-server's per-request timings plus "
                                           "tandem's speculation figures (draft_n, draft_n_accepted, ...)")


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = Field(description="{tokens, token_logprobs, top_logprobs, text_offset}")
    finish_reason: Literal["stop", "length"]
    timings: dict[str, Any] | None = None


class Completion(BaseModel):
    """A text_completion; with stream: true, text/event-stream of text_completion chunks, ending with
    `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    timings: dict[str, Any] | None = None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    meta: dict[str, Any] = Field(description="n_ctx, vocab_size, backend, device, draft")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelObject]


class Health(BaseModel):
    status: Literal["ok", "loading", "warming", "draining", "failed"]
    queue_depth: int
    active: int
    stage: str  # what the server is doing: loading the models, timing the pair's costs, warming up, serving
    elapsed_s: float  # since the server started
    # The adaptive policy's costs: {"source": kept | estimate | measured (...), "measuring": what it times next,
    # "timings_done": n} while a full measurement runs in the background
    costs: dict | None = None


_STATUSES = ((400, "invalid request: the field is named in error.param"), (401, "missing or wrong API key"),
             (403, "Host header not allowed (DNS-rebinding guard; --allowed-hosts)"), (404, "unknown model"),
             (413, "body over the size limit"), (415, "Content-Type other than application/json"),
             (503, "not ready, busy or shutting down"))
ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in _STATUSES}


# --- the Responses and Messages APIs (description only) ---------------------------------------------------------

class ResponseObject(BaseModel):
    """OpenAI's response object; with stream: true, text/event-stream of named events (response.created ...
    response.completed) instead."""

    id: str = Field(description="resp_...: previous_response_id takes it")
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    incomplete_details: dict[str, str] | None = Field(description='{"reason": "max_output_tokens"} when cut')
    model: str
    output: list[dict[str, Any]] = Field(description="message items (output_text) and function_call items")
    usage: dict[str, Any] | None = Field(description="input_tokens (input_tokens_details.cached_tokens: reused), "
                                         "output_tokens, total_tokens")
    timings: dict[str, Any] | None = Field(None, description="as in chat completions")


class MessageObject(BaseModel):
    """Anthropic's message; with stream: true, text/event-stream of named events (message_start ... message_stop)
    instead."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]] = Field(description="text and tool_use blocks")
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: dict[str, int] = Field(description="input_tokens (computed), cache_read_input_tokens (reused), "
                                  "output_tokens")
    timings: dict[str, Any] | None = Field(None, description="as in chat completions")


class TokenCount(BaseModel):
    input_tokens: int = Field(description="the prompt's tokens under the model's chat template, tools included")


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, ...")
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error object: every 4xx and 5xx on /v1/messages*."""

    type: Literal["error"]
    error: AnthropicErrorDetail


ANTHROPIC_ERRORS = {status: {"model": AnthropicErrorResponse, "description": what} for status, what in _STATUSES}
