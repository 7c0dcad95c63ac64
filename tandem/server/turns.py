"""One reply for the APIs that are not Chat Completions (OpenAI's Responses, Anthropic's Messages): each translates
its request into a `ChatCompletionRequest`, so the chat surface's checks, chat template, tools, structured output
and forced calls apply unchanged, and `Turn` runs it on the same scheduler and engine through the same pieces
(`Server.make_jobs`, `completion.Responder`, `choices.Choice`), handing its text and tool calls over as they come
for each API to write in its own shapes. There is no second decode path: batching, speculation, prefix reuse,
timings and metrics are the chat endpoint's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from tandem.server import responses
from tandem.server.choices import Choice
from tandem.server.completion import as_api_error
from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest


class ClientGone(Exception):
    """The client of a non-streamed reply went away (its jobs are cancelled)."""


@dataclass
class Call:
    """A complete tool call: its id, the function's name, the arguments (a JSON object, serialized)."""

    id: str
    name: str
    arguments: str

    @property
    def input(self) -> dict[str, Any]:
        return json.loads(self.arguments)


async def chat_prompt(server, req: ChatCompletionRequest, check: bool = True) -> tuple[list[int], str | None]:
    """The prompt's token ids under the model's chat template (with the tools), and the format to parse tool calls
    in (None: text only); 400s for what the template cannot render or (with `check`) the context cannot hold."""
    tool_format = server.tool_format(req)
    try:
        ids = await run_in_threadpool(server.target.tokenizer.encode_chat, req.template_messages(), True,
                                      req.tools_offered)
    except APIError:
        raise
    except Exception as e:  # the chat template may refuse the messages (jinja's raise_exception)
        raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
    if check:
        server.check_prompt(ids, "messages")
    return ids, tool_format


class Turn:
    """One chat request's single reply, queued at once (a full queue is the caller's 503 before any byte is sent)."""

    def __init__(self, server, req: ChatCompletionRequest, ids: list[int], tool_format: str | None) -> None:
        self.server, self.req, self.ids = server, req, ids
        names = [t.function.name for t in req.tools or []] if tool_format else []
        self.choice = Choice(0, "chat", server.piece, tool_format, names, req.max_tool_calls, server.token_bytes)
        self.choice.prompt_tokens = len(ids)
        self.jobs = server.make_jobs(req, ids)
        server.submit(self.jobs)

    async def deltas(self, request: Request | None) -> AsyncIterator[tuple[str, list[Call]]]:
        """(text, complete calls) as the reply comes, until it is finished. With `request`, its client is watched
        (a non-streamed reply): ClientGone when it leaves. A worker-side failure raises as_api_error's APIError."""
        responder = self.server.responder
        try:
            while not self.choice.finished:
                event = await responder.next_event(self.jobs, request)
                if event is None:
                    raise ClientGone()
                if event.error is not None:
                    raise as_api_error(event.error)
                text, calls, _ = responder.take(self.jobs, self.choice, event.chunk)
                calls = [Call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls or []]
                if text or calls:
                    yield text, calls
        finally:
            self.server.cancel(self.jobs)  # a no-op once finished; frees the slot when the client left

    async def whole(self, request: Request) -> tuple[str, list[Call]]:
        """The whole reply: its text and its calls. ClientGone when the client left first (the app answers 499);
        any other failure as as_api_error says."""
        texts, calls = [], []
        try:
            async for text, more in self.deltas(request):
                texts.append(text)
                calls += more
        except ClientGone:
            raise
        except Exception as e:  # noqa: BLE001  (said as as_api_error says it)
            raise as_api_error(e) from None
        return "".join(texts), calls

    def summarize(self, request: Request) -> None:
        self.server.responder.summarize(request, self.choice.stats, self.jobs[0])

    @property
    def finish_reason(self) -> str:
        """stop, length or tool_calls (Chat Completions' names)."""
        return self.choice.finish_reason

    @property
    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, generated tokens, prompt tokens whose KV was reused)."""
        return len(self.ids), self.choice.n_tokens, self.choice.stats.cached_tokens

    def timings(self) -> dict[str, Any]:
        return responses.timings(self.choice.stats, self.jobs[0].queue_ms)
