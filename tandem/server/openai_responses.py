"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), as Codex CLI and the openai client's
`responses.create` / `responses.stream` speak it: a thin translation onto the chat surface (turns.py), so the same
template, tools, forced calls, structured output and engine answer it.
More: docs/internals.md."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tandem.server import openapi
from tandem.server.asgi import SSEResponse, sse_event
from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest, SpeculativeOptions, WholeInt, _Lenient, _whole
from tandem.server.turns import Call, Turn, chat_prompt

STORE_SIZE = 256  # stored responses at most (each holds its whole conversation's text): the oldest go first
STORE_TTL_S = 3600.0  # a stored response is forgotten this long after it was made
TEXT_PARTS = ("input_text", "output_text", "text")
_REFUSED = "not supported: a request that sets it gets a 400"


class InputPart(_Lenient):
    type: str = Field(description=f"{', '.join(TEXT_PARTS)} (images and files: 400)")
    text: str | None = None


class InputItem(_Lenient):
    """A message ({role, content}), a function_call or a function_call_output; other item types are a 400."""

    type: str = "message"
    role: str | None = Field(None, description="messages: user, assistant, system or developer")
    content: str | list[InputPart] | None = None
    call_id: str | None = Field(None, description="function_call and function_call_output: the call's id")
    name: str | None = None
    arguments: str | None = Field(None, description="function_call: a JSON object, serialized")
    output: str | list[InputPart] | None = Field(None, description="function_call_output: the tool's result")
    id: str | None = None
    status: str | None = None


class FunctionTool(_Lenient):
    type: str = Field(description='"function" (built-in tools such as web_search: 400)')
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Lenient):
    type: Literal["function"]
    name: str


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(None, description="medium only (low, high: 400)")


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[InputItem] = Field(description="a user message, or items: messages, function_call, "
                                         "function_call_output")
    instructions: str | None = Field(None, description="the system message (not carried by previous_response_id)")
    previous_response_id: str | None = Field(None, description="continue a stored response's conversation")
    store: bool = Field(True, description=f"keep the response for previous_response_id (in memory, at most "
                        f"{STORE_SIZE}, for {STORE_TTL_S:.0f} s)")
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call [true]")
    text: TextOptions | None = Field(None, description="format: json_schema or json_object constrains the output")
    max_output_tokens: _whole(ge=1) | None = Field(None, description="[until the context is full]")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = Field(None, description="accepted; prefix reuse needs no key here")
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    # tandem's extras, as on the chat surface
    top_k: _whole(ge=0) = 0
    seed: WholeInt | None = None
    speculative: bool | SpeculativeOptions | None = None
    # What this server cannot honour: a 400 unless neutral (see `refused`).
    reasoning: dict[str, Any] | None = Field(None, description='null or {"effort": "none"} only (400 otherwise)')
    include: list[str] | None = Field(None, description="empty only (400 otherwise)")
    background: bool | None = Field(None, description="false only (400 otherwise)")
    truncation: str | None = Field(None, description='"disabled" only (400 otherwise)')
    conversation: str | dict[str, Any] | None = Field(None, description=_REFUSED)
    prompt: dict[str, Any] | None = Field(None, description=_REFUSED)
    top_logprobs: WholeInt | None = Field(None, description="0 only (400 otherwise)")
    max_tool_calls: WholeInt | None = Field(None, description=_REFUSED)

    def checked(self) -> ResponsesRequest:
        reasoning = {k: v for k, v in (self.reasoning or {}).items() if v is not None}
        refused = {"reasoning": reasoning and reasoning != {"effort": "none"}, "include": bool(self.include),
                   "background": bool(self.background), "truncation": self.truncation not in (None, "disabled"),
                   "conversation": self.conversation is not None, "prompt": self.prompt is not None,
                   "top_logprobs": bool(self.top_logprobs), "max_tool_calls": self.max_tool_calls is not None}
        for name, bad in refused.items():
            if bad:
                raise APIError(400, f"{name} is not supported by this server (got {getattr(self, name)!r})",
                               param=name, code="unsupported_parameter")
        for i, tool in enumerate(self.tools or []):
            if tool.type != "function":
                raise APIError(400, f"tools[{i}]: built-in tools ({tool.type!r}) are not supported; only function "
                               "tools are", param=f"tools[{i}].type", code="unsupported_tool")
            if tool.name is None:
                raise APIError(400, f"tools[{i}].name is required", param=f"tools[{i}].name")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise APIError(400, "input is empty: give at least one item", param="input")
        return self


class ResponseStore:
    """Responses kept for previous_response_id: at most `size`, each for `ttl_s`; the oldest go first."""

    def __init__(self, size: int = STORE_SIZE, ttl_s: float = STORE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.size, self.ttl_s, self.clock = size, ttl_s, clock
        self.entries: OrderedDict[str, tuple[float, list[dict], dict]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        """messages: the conversation up to and including this response's output (no instructions)."""
        self.entries[response_id] = (self.clock() + self.ttl_s, messages, response)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[dict], dict] | None:
        now = self.clock()
        while self.entries and next(iter(self.entries.values()))[0] <= now:  # oldest first: expire from the front
            self.entries.popitem(last=False)
        entry = self.entries.get(response_id)
        return None if entry is None else entry[1:]


def _text(parts: str | list[InputPart] | None, where: str) -> str | None:
    if parts is None or isinstance(parts, str):
        return parts
    for j, part in enumerate(parts):
        if part.type not in TEXT_PARTS or part.text is None:
            raise APIError(400, f"{where}[{j}]: only text parts are supported ({', '.join(TEXT_PARTS)}), got "
                           f"{part.type!r}", param=where, code="unsupported_content")
    return "".join(part.text for part in parts)


def input_messages(items: str | list[InputItem]) -> list[dict]:
    """Input items as chat messages: an assistant's calls join its message, a call's output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, got {item.role!r}",
                               param=f"{where}.role")
            content = _text(item.content, f"{where}.content")
            if content is None:
                raise APIError(400, f"{where}.content is required", param=f"{where}.content")
            out.append({"role": item.role, "content": content})
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise APIError(400, f"{where}: a function_call needs call_id, name and arguments", param=where)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            output = _text(item.output, f"{where}.output")
            if item.call_id is None or output is None:
                raise APIError(400, f"{where}: a function_call_output needs call_id and output", param=where)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            what = "reasoning items are" if item.type == "reasoning" else f"input items of type {item.type!r} are"
            raise APIError(400, f"{where}: {what} not supported (message, function_call, function_call_output)",
                           param=f"{where}.type", code="unsupported_input")
    return out


def chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat request that answers `req` after the stored conversation `history`."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    chat: dict[str, Any] = {"messages": system + history + input_messages(req.input), "temperature": req.temperature,
                            "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed, "speculative": req.speculative,
                            "max_tokens": req.max_output_tokens, "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}}
            for t in req.tools]
    choice = req.tool_choice
    if choice is not None and (req.tools or choice not in ("auto", "none")):  # auto / none without tools: nothing
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                     "function": {"name": choice.name}}
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "strict": fmt.strict,
                                                                          "schema": fmt.schema_}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    return ChatCompletionRequest.model_validate(chat).checked()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def call_item(item_id: str, call: Call, arguments: str | None = None, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


class Exchange:
    """One request's answer as it is built: the response object, its output items, what is stored."""

    def __init__(self, server, req: ResponsesRequest, history: list[dict]) -> None:
        self.server, self.req, self.history = server, req, history
        self.id, self.created = _id("resp"), int(time.time())
        self.output: list[dict] = []

    def response(self, status: str, turn: Turn | None = None) -> dict:
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "model": self.server.model_name, "output": self.output,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": req.store, "temperature": req.temperature,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunctionChoice)
                else req.tool_choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "top_p": req.top_p, "truncation": "disabled", "usage": None, "user": req.user,
                "metadata": req.metadata or {}}
        if turn is not None:
            prompt, generated, cached = turn.usage
            body["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                             "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt + generated}
            body["timings"] = turn.timings()
            if turn.finish_reason == "length":
                body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return body

    def finish(self, turn: Turn, text: str, calls: list[Call]) -> dict:
        """The final response object; stored (unless store is false) with the conversation it ends."""
        body = self.response("completed", turn)
        if self.req.store:
            message = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            elif not text:
                message["content"] = ""
            conversation = self.history + input_messages(self.req.input) + [message]
            self.server.response_store.put(self.id, conversation, body)
        return body


async def stream(exchange: Exchange, turn: Turn, request: Request) -> AsyncIterator[str]:
    """The documented event sequence; a failure mid-stream is an `error` event, then the stream ends."""
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        sequence += 1
        return sse_event(kind, {"type": kind, "sequence_number": sequence - 1, **fields})

    yield event("response.created", response=exchange.response("in_progress"))
    yield event("response.in_progress", response=exchange.response("in_progress"))
    texts, calls, open_text = [], [], None  # open_text: [item id, its text] while a message item is open

    def close_text():
        item_id, text = open_text
        at = len(exchange.output)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        exchange.output.append(message_item(item_id, text))
        return [event("response.output_text.done", item_id=item_id, output_index=at, content_index=0, text=text,
                      logprobs=[]),
                event("response.content_part.done", item_id=item_id, output_index=at, content_index=0, part=part),
                event("response.output_item.done", output_index=at, item=exchange.output[-1])]

    try:
        async for text, new_calls in turn.deltas(None):
            at = len(exchange.output)
            if text:
                if open_text is None:
                    open_text = [_id("msg"), ""]
                    yield event("response.output_item.added", output_index=at,
                                item=message_item(open_text[0], "", "in_progress"))
                    yield event("response.content_part.added", item_id=open_text[0], output_index=at,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                open_text[1] += text
                texts.append(text)
                yield event("response.output_text.delta", item_id=open_text[0], output_index=at, content_index=0,
                            delta=text, logprobs=[])
            for call in new_calls:
                if open_text is not None:
                    for e in close_text():
                        yield e
                    open_text = None
                at, item_id = len(exchange.output), _id("fc")
                yield event("response.output_item.added", output_index=at,
                            item=call_item(item_id, call, "", "in_progress"))
                yield event("response.function_call_arguments.delta", item_id=item_id, output_index=at,
                            delta=call.arguments)
                yield event("response.function_call_arguments.done", item_id=item_id, output_index=at,
                            name=call.name, arguments=call.arguments)
                exchange.output.append(call_item(item_id, call))
                yield event("response.output_item.done", output_index=at, item=exchange.output[-1])
                calls.append(call)
    except APIError as e:
        yield event("error", code=e.code or e.type, message=e.message, param=e.param)
        return
    if open_text is not None:
        for e in close_text():
            yield e
    body = exchange.finish(turn, "".join(texts), calls)
    yield event("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
    turn.summarize(request)


def add_routes(app: FastAPI, server) -> None:
    """POST /v1/responses and GET /v1/responses/{response_id} on `app`, answering from `server` (state.Server)."""
    server.response_store = ResponseStore()

    @app.post("/v1/responses", response_model=None, openapi_extra=openapi.request_body(ResponsesRequest),
              responses={200: {"model": openapi.ResponseObject}, **openapi.ERRORS}, summary="Response (OpenAI)")
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API: text, function tools, structured output, previous_response_id, streaming."""
        req = await server.parsed(request, ResponsesRequest)
        history: list[dict] = []
        if req.previous_response_id is not None:
            stored = server.response_store.get(req.previous_response_id)
            if stored is None:
                raise APIError(400, f"previous response {req.previous_response_id!r} is not stored here (unknown, "
                               f"expired, or made with store: false)", param="previous_response_id",
                               code="previous_response_not_found")
            history = stored[0]
        chat = chat_request(req, history)
        ids, tool_format = await chat_prompt(server, chat)
        exchange = Exchange(server, req, history)
        turn = Turn(server, chat, ids, tool_format)
        if req.stream:
            return SSEResponse(stream(exchange, turn, request), on_close=lambda: server.cancel(turn.jobs))
        text, calls = await turn.whole(request)
        if text or not calls:
            exchange.output.append(message_item(_id("msg"), text))
        exchange.output += [call_item(_id("fc"), call) for call in calls]
        turn.summarize(request)
        return JSONResponse(exchange.finish(turn, text, calls))

    @app.get("/v1/responses/{response_id}", response_model=openapi.ResponseObject, responses=openapi.ERRORS,
             summary="A stored response")
    async def get_response(request: Request, response_id: str) -> dict:
        """A response made with store: true, while it is kept; 404 otherwise."""
        server.authorize(request)
        stored = server.response_store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r}", param="response_id", code="not_found")
        return stored[1]
