"""Answering a generation request: its n choices queued as jobs on the scheduler, their chunks assembled by
`choices.Choice` (tool calls parsed out of the text), and the answer written as one JSON response or as an SSE
stream whose chunks carry their choice's index (app.py's endpoints check the request and call `Responder.run`).
A client that goes away cancels its jobs; a worker-side failure reaches it as `as_api_error` says."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from tandem.backends.base import Model
from tandem.engine.scoring import prompt_logprobs
from tandem.server import protocol, responses
from tandem.server.asgi import SSEResponse, sse
from tandem.server.choices import Choice
from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.scheduler import Event, Job, Scheduler, ShuttingDownError
from tandem.speculative.stats import GenerationStats

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


class Host(Protocol):
    """What a Responder needs of the server (state.Server)."""

    target: Model
    model_name: str
    scheduler: Scheduler

    def require_ready(self) -> None: ...
    def make_jobs(self, req: protocol._GenerationRequest, ids: list[int]) -> list[Job]: ...
    def submit(self, jobs: list[Job]) -> None: ...
    def cancel(self, jobs: list[Job]) -> None: ...
    def piece(self, token: int) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...


class Responder:
    """The server's generation requests from queueing to the last byte of their answers."""

    def __init__(self, server: Host) -> None:
        self.server = server

    async def next_event(self, jobs: list[Job], request: Request | None) -> Event | None:
        """The next event of the request's jobs; None when `request`'s client went away (then they are
        cancelled)."""
        events = jobs[0].events
        if request is None:
            return await events.get()
        getter = asyncio.ensure_future(events.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    self.server.cancel(jobs)
                    return None
        finally:
            getter.cancel()

    @staticmethod
    async def waiting_events(jobs: list[Job]) -> list[Event]:
        """The request's next event and every one already queued behind it (a stream's client that fell behind
        catches up in one write)."""
        events = jobs[0].events
        batch = [await events.get()]
        while not events.empty():
            batch.append(events.get_nowait())
        return batch

    async def run(self, request: Request, kind: responses.Kind, req: protocol._GenerationRequest, ids: list[int],
                  tool_format: str | None = None) -> Response:
        """Generate req.n choices for `ids`: one JSON response, or an SSE stream. tool_format: parse tool calls
        written in this format (tools.FORMATS) out of chat replies."""
        echo = isinstance(req, CompletionRequest) and req.echo
        scoring = None
        if echo and req.logprobs is not None:  # the prompt's own logprobs, computed on the worker like any model work
            self.server.require_ready()
            target, top = self.server.target, req.logprobs
            try:
                scoring = self.server.scheduler.call(lambda: prompt_logprobs(target, ids, top),
                                                     asyncio.get_running_loop())
            except ShuttingDownError as e:
                raise as_api_error(e) from None
        jobs = self.server.make_jobs(req, ids) if req.requested_max_tokens != 0 else []
        if jobs:
            self.server.submit(jobs)
        request_id = responses.new_id("chatcmpl" if kind == "chat" else "cmpl")
        tool_names = [t.function.name for t in req.tools or []] if tool_format else []
        max_calls = req.max_tool_calls if isinstance(req, ChatCompletionRequest) else None
        choices = [Choice(i, kind, self.server.piece, tool_format, tool_names, max_calls, self.server.token_bytes)
                   for i in range(req.n)]
        for choice in choices:
            choice.prompt_tokens = len(ids)
        if echo:
            prompt_text = await run_in_threadpool(self.server.target.tokenizer.decode, ids)
            try:
                prompt_scored = await scoring if scoring is not None else None
            except Exception as e:  # noqa: BLE001  (shutting down, or a bug: said as as_api_error says it)
                self.server.cancel(jobs)
                raise as_api_error(e) from None
            for choice in choices:
                choice.echo(prompt_text, prompt_scored)
        if req.stream:
            return SSEResponse(self.stream(request, kind, req, jobs, choices, request_id, len(ids)),
                                on_close=lambda: self.server.cancel(jobs))
        try:
            while not all(c.finished for c in choices):
                if not jobs:  # echo with max_tokens 0: the prompt is the whole answer
                    for choice in choices:
                        choice.close("length", GenerationStats(prompt_tokens=len(ids)))
                    break
                event = await self.next_event(jobs, request)
                if event is None:
                    return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
                if event.error is not None:
                    raise as_api_error(event.error)
                self.take(jobs, choices[event.index], event.chunk)
        finally:
            self.server.cancel(jobs)  # a no-op for finished jobs; frees the slots when we were cancelled
        self.summarize(request, choices[0].stats, jobs[0] if jobs else None, req.n)
        objects = [c.whole(with_logprobs=req.logprobs_count() is not None) for c in choices]
        timings = [responses.timings(c.stats, j.queue_ms if j else 0.0) for c, j in zip(choices, jobs or [None] * len(
            choices), strict=True)]
        return JSONResponse(responses.completion_response(
            kind, request_id, self.server.model_name, objects, self.usage(len(ids), choices),
            timings[0] if req.n == 1 else timings))

    def take(self, jobs: list[Job], choice: Choice, chunk) -> tuple:
        """Hand a chunk to its choice (none once it has finished); cancel the choice's generation when the choice
        ended before it (parallel_tool_calls false: its first call is complete)."""
        if choice.finished:
            return "", None, None
        sent = choice.add(chunk)
        if choice.ended_early:
            self.server.scheduler.cancel(jobs[choice.index])
        return sent

    @staticmethod
    def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
        """OpenAI's usage for a request: the prompt once, the completion tokens of every choice."""
        return responses.usage(prompt_tokens, sum(c.n_tokens for c in choices),
                              max(c.stats.cached_tokens for c in choices))

    async def stream(self, request: Request, kind: responses.Kind, req: protocol._GenerationRequest, jobs: list[Job],
                     choices: list[Choice], request_id: str, prompt_tokens: int) -> AsyncIterator[str]:
        """SSE events in OpenAI's chunk format, each for one choice (its `index`), ending with `data: [DONE]`.
        Cancellation (a disconnect) lands in the awaits here; SSEResponse then cancels the jobs."""
        created = int(time.time())

        def chunk_obj(index: int, text: str | None, finish: str | None = None, role: bool = False, logprobs=None,
                      tool_calls=None) -> dict:
            return responses.stream_chunk(kind, request_id, created, self.server.model_name, text, finish, role,
                                          logprobs, index, tool_calls)

        for choice in choices:
            if kind == "chat":
                yield sse(chunk_obj(choice.index, "", role=True))
            elif choice.echoed is not None:
                yield sse(chunk_obj(choice.index, choice.echoed[0], logprobs=choice.echoed[1]))
        timings_by_choice, failed = {}, False
        while not all(c.finished for c in choices):
            if not jobs:  # echo with max_tokens 0
                for choice in choices:
                    choice.close("length", GenerationStats(prompt_tokens=prompt_tokens))
                    yield sse(chunk_obj(choice.index, None if kind == "chat" else "", "length"))
                continue
            out = []  # the events already waiting go out in one write: one per event costs a slow client more
            for event in await self.waiting_events(jobs):
                if all(c.finished for c in choices):
                    break
                if event.error is not None:
                    out.append(sse(as_api_error(event.error).body()))
                    failed = True
                    break
                choice = choices[event.index]
                if choice.finished:  # ended early; chunks its generation sent before it was cancelled
                    continue
                text, calls, logprobs = self.take(jobs, choice, event.chunk)
                if text or logprobs or calls:
                    out.append(sse(chunk_obj(choice.index, text, logprobs=logprobs, tool_calls=calls)))
                if choice.finished:
                    timings = responses.timings(choice.stats, jobs[choice.index].queue_ms)
                    timings_by_choice[choice.index] = timings
                    last = chunk_obj(choice.index, None if kind == "chat" else "", choice.finish_reason)
                    last["timings"] = timings
                    out.append(sse(last))
            if out:
                yield "".join(out)
            if failed:
                break
        if not failed:
            if req.include_usage_in_stream:  # OpenAI's shape: one more chunk, no choices, the usage
                final = {**chunk_obj(0, None), "choices": [], "usage": self.usage(prompt_tokens, choices)}
                if req.n == 1 and timings_by_choice:
                    final["timings"] = timings_by_choice[0]
                yield sse(final)
            self.summarize(request, choices[0].stats, jobs[0] if jobs else None, req.n)
        yield "data: [DONE]\n\n"

    def summarize(self, request: Request, stats, job: Job | None, n: int = 1) -> None:
        """What the access log line adds for a generation (its first choice's figures, when there are n)."""
        request.state.generation_summary = (
            f" prompt={stats.prompt_tokens} generated={stats.generated_tokens} drafted={stats.draft_tokens} "
            f"accepted={stats.accepted_tokens} queue={job.queue_ms if job else 0:.0f}ms "
            f"prefill={stats.prefill_ms:.0f}ms decode={stats.decode_ms:.0f}ms" + (f" n={n}" if n > 1 else ""))


def as_api_error(error: BaseException) -> APIError:
    """A worker-side failure as what the client may see: its message for bad input, nothing for a bug."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ShuttingDownError):
        return APIError(503, str(error), type="server_error", code="shutting_down")
    if isinstance(error, ValueError):  # SamplingError, ContextOverflowError, ...: they name the bad input
        return APIError(400, str(error))
    return APIError(500, "internal server error", type="server_error")
