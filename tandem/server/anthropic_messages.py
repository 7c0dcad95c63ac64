"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as Claude Code and the anthropic
client's `messages.create` / `messages.stream` speak it: a thin translation onto the chat surface (turns.py), so the
same template, tools, forced calls and engine answer it.
More: docs/internals.md."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tandem.server import openapi
from tandem.server.asgi import SSEResponse, sse_event
from tandem.server.errors import APIError, anthropic_error_body
from tandem.server.protocol import ChatCompletionRequest, SpeculativeOptions, _Lenient, _whole
from tandem.server.turns import Call, Turn, chat_prompt

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class Block(_Lenient):
    """A content block: text, tool_use (assistant), tool_result (user); images, documents and thinking are a 400."""

    type: str
    text: str | None = None
    id: str | None = Field(None, description="tool_use: the call's id")
    name: str | None = None
    input: dict[str, Any] | None = Field(None, description="tool_use: the arguments")
    tool_use_id: str | None = Field(None, description="tool_result: the call it answers")
    content: str | list[Block] | None = Field(None, description="tool_result: text or text blocks")
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = Field(None, description="accepted; prefix reuse needs no marks here")


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = Field(None, description="the input's JSON Schema (required for a custom "
                                                "tool; server tools, which have a `type`, are a 400)")
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] | bool = Field(alias="schema")


class OutputConfig(_Lenient):
    format: OutputFormat | None = Field(None, description="structured output: the text matches the schema")
    effort: str | None = Field(None, description="not supported (400)")


class _MessagesBody(_Lenient):
    model: str | None = Field(None, description="the served model's id or an alias (any name with --accept-any-model)")
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = Field(None, description='{"type": "disabled"} only (400 otherwise)')
    mcp_servers: list[Any] | None = Field(None, description="not supported (400)")

    def checked(self) -> _MessagesBody:
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise APIError(400, "thinking is not supported by this server: its models do not return thinking "
                           "blocks", param="thinking")
        if self.mcp_servers:
            raise APIError(400, "mcp_servers is not supported by this server", param="mcp_servers")
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom") or tool.input_schema is None:
                raise APIError(400, f"tools[{i}]: server tools ({tool.type!r}) are not supported; only custom "
                               "tools with an input_schema are", param=f"tools[{i}]")
        return self


class CountTokensRequest(_MessagesBody):
    """The body of /v1/messages/count_tokens: a message request's prompt, without generation settings."""


def _check_output_config(config: OutputConfig | None) -> None:
    if config is not None and config.effort is not None:
        raise APIError(400, "output_config.effort is not supported by this server", param="output_config.effort")


class MessagesRequest(_MessagesBody):
    max_tokens: _whole(ge=1) = Field(description="clamped to the room left in the context")
    stop_sequences: list[str] | None = None
    output_config: OutputConfig | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: _whole(ge=0) = 0
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    speculative: bool | SpeculativeOptions | None = None  # tandem's, as on the chat surface


def _texts(blocks: list[Block], where: str, allowed: tuple[str, ...]) -> None:
    for j, block in enumerate(blocks):
        if block.type not in allowed:
            what = "images and documents are" if block.type in ("image", "document") else \
                "thinking blocks are" if "thinking" in block.type else f"{block.type!r} blocks are"
            raise APIError(400, f"{where}[{j}]: {what} not supported here ({', '.join(allowed)})",
                           param=f"{where}[{j}].type")
        if block.type == "text" and block.text is None:
            raise APIError(400, f"{where}[{j}].text is required", param=f"{where}[{j}].text")


def _result_text(block: Block, where: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    _texts(block.content, f"{where}.content", ("text",))
    return "".join(b.text for b in block.content)


def chat_messages(body: _MessagesBody) -> list[dict]:
    """The conversation as chat messages (system first; tool results as tool messages, calls as tool_calls)."""
    out: list[dict] = []
    if body.system is not None:
        if isinstance(body.system, list):
            _texts(body.system, "system", ("text",))
        out.append({"role": "system", "content": body.system if isinstance(body.system, str) else
                    "\n\n".join(b.text for b in body.system)})
    for i, message in enumerate(body.messages):
        where = f"messages[{i}].content"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        if message.role == "assistant":
            _texts(message.content, where, ("text", "tool_use"))
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name,
                                                                  "arguments": json.dumps(b.input or {})}}
                     for b in message.content if b.type == "tool_use"]
            if any(c["id"] is None or c["function"]["name"] is None for c in calls):
                raise APIError(400, f"{where}: a tool_use block needs id and name", param=where)
            text = "".join(b.text for b in message.content if b.type == "text")
            out.append({"role": "assistant", "content": text or (None if calls else ""),
                        **({"tool_calls": calls} if calls else {})})
            continue
        _texts(message.content, where, ("text", "tool_result"))
        for j, block in enumerate(message.content):
            if block.type == "tool_result":
                if block.tool_use_id is None:
                    raise APIError(400, f"{where}[{j}].tool_use_id is required", param=f"{where}[{j}].tool_use_id")
                text = _result_text(block, f"{where}[{j}]")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {text}" if block.is_error else text})
        text = "".join(b.text for b in message.content if b.type == "text")
        if text or all(b.type == "text" for b in message.content):
            out.append({"role": "user", "content": text})
    return out


def chat_request(body: _MessagesBody) -> ChatCompletionRequest:
    """The chat request that answers `body` (count_tokens: only its prompt matters)."""
    chat: dict[str, Any] = {"messages": chat_messages(body)}
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    stop=body.stop_sequences, speculative=body.speculative)
        _check_output_config(body.output_config)
        fmt = body.output_config.format if body.output_config else None
        if fmt is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.schema_}}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None and body.tools:
        if choice.type == "tool" and choice.name is None:
            raise APIError(400, "tool_choice: type tool needs a name", param="tool_choice.name")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type, {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    elif choice is not None and choice.type in ("any", "tool"):
        raise APIError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    try:
        return ChatCompletionRequest.model_validate(chat).checked()
    except APIError as e:  # a stop string list too long and the like: said under this API's field names
        raise APIError(400, e.message.replace("stop has", "stop_sequences has"), param=e.param) from None


def content_blocks(text: str, calls: list[Call]) -> list[dict]:
    blocks = [{"type": "text", "text": text}] if text or not calls else []
    return blocks + [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.input} for c in calls]


def stop(turn: Turn) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished turn."""
    sequence = turn.choice.stop_string
    return ("stop_sequence", sequence) if sequence else (STOP_REASONS[turn.finish_reason], None)


def usage(turn: Turn) -> dict[str, int]:
    """Anthropic's usage: input_tokens are those computed, cache_read_input_tokens those whose KV was reused (known
    once the prefill ran: a stream's message_start says 0 and all as computed)."""
    prompt, generated, cached = turn.usage
    return {"input_tokens": prompt - cached, "output_tokens": generated, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def message_object(message_id: str, model: str, content: list[dict], turn: Turn) -> dict[str, Any]:
    """The message; before the turn finished (a stream's message_start), without a stop_reason."""
    reason, sequence = stop(turn) if turn.finish_reason else (None, None)
    body = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(turn)}
    if reason is not None:
        body["timings"] = turn.timings()
    return body


async def stream(turn: Turn, message_id: str, model: str, request: Request) -> AsyncIterator[str]:
    """Anthropic's named events; a failure mid-stream is an `error` event, then the stream ends."""
    def event(kind: str, **fields: Any) -> str:
        return sse_event(kind, {"type": kind, **fields})

    yield event("message_start", message=message_object(message_id, model, [], turn))
    yield event("ping")
    index, text_open = 0, False
    try:
        async for text, calls in turn.deltas(None):
            if text:
                if not text_open:
                    yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    text_open = True
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": text})
            for call in calls:
                if text_open:
                    yield event("content_block_stop", index=index)
                    index, text_open = index + 1, False
                yield event("content_block_start", index=index, content_block={
                    "type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                yield event("content_block_delta", index=index,
                            delta={"type": "input_json_delta", "partial_json": call.arguments})
                yield event("content_block_stop", index=index)
                index += 1
    except APIError as e:
        yield sse_event("error", anthropic_error_body(e.status, e.message))
        return
    if text_open:
        yield event("content_block_stop", index=index)
    reason, sequence = stop(turn)
    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                usage=usage(turn), timings=turn.timings())
    yield event("message_stop")
    turn.summarize(request)


def add_routes(app: FastAPI, server) -> None:
    """POST /v1/messages and /v1/messages/count_tokens on `app`, answering from `server` (state.Server)."""

    async def prepared(request: Request, model: type[_MessagesBody]) -> tuple[Any, ChatCompletionRequest]:
        body = await server.parsed(request, model)
        return body, chat_request(body)

    @app.post("/v1/messages", response_model=None, openapi_extra=openapi.request_body(MessagesRequest),
              responses={200: {"model": openapi.MessageObject}, **openapi.ANTHROPIC_ERRORS},
              summary="Message (Anthropic)")
    async def create_message(request: Request) -> Response:
        """Anthropic's Messages API: text, tool_use / tool_result, stop_sequences, tool_choice, streaming."""
        body, chat = await prepared(request, MessagesRequest)
        ids, tool_format = await chat_prompt(server, chat)
        turn, message_id = Turn(server, chat, ids, tool_format), f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return SSEResponse(stream(turn, message_id, server.model_name, request),
                               on_close=lambda: server.cancel(turn.jobs))
        text, calls = await turn.whole(request)
        turn.summarize(request)
        return JSONResponse(message_object(message_id, server.model_name, content_blocks(text, calls), turn))

    @app.post("/v1/messages/count_tokens", response_model=openapi.TokenCount,
              openapi_extra=openapi.request_body(CountTokensRequest), responses=openapi.ANTHROPIC_ERRORS,
              summary="Count a message's tokens (Anthropic)")
    async def count_tokens(request: Request) -> dict:
        """The prompt's tokens under the model's chat template, tools included: what /v1/messages would read."""
        _, chat = await prepared(request, CountTokensRequest)
        ids, _ = await chat_prompt(server, chat, check=False)  # a prompt too long for the context is counted too
        return {"input_tokens": len(ids)}
