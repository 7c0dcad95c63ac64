"""ASGI plumbing under the HTTP layer: the request guard (body size limit, access log, request counter) and the
server-sent-events response and framing."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.server.errors import error_body, shaped_error
from tandem.server.metrics import ServerMetrics

log = logging.getLogger("tandem.server")


class BodyTooLargeError(Exception):
    pass


class RequestGuard:
    """Raw ASGI middleware: refuse bodies over the limit without buffering them; log and count every request.

    Pure ASGI (not BaseHTTPMiddleware) so streamed responses and client disconnects pass through untouched.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: ServerMetrics, endpoints: Seq[str]) -> None:
        self.app, self.max_body_bytes, self.metrics, self.endpoints = app, max_body_bytes, metrics, endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def send_watching(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            declared = int(dict(scope["headers"]).get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        try:
            if declared > self.max_body_bytes:
                await self._too_large(scope["path"], send_watching)
                return
            await self.app(scope, self._limited(receive), send_watching)
        finally:
            path = scope["path"]
            self.metrics.requests.labels(endpoint=path if path in self.endpoints else "other", status=str(status)).inc()
            summary = scope.get("state", {}).get("generation_summary", "")
            log.info("%s %s %d %.0f ms%s", scope["method"], path, status, 1000 * (time.perf_counter() - started),
                     summary)

    def _limited(self, receive: Receive) -> Receive:
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLargeError()
            return message

        return limited

    async def _too_large(self, path: str, send: Send) -> None:
        response = JSONResponse(shaped_error(path, 413, too_large_body(self.max_body_bytes)), status_code=413)
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def too_large_body(limit: int) -> dict:
    return error_body(f"the request body exceeds the limit of {limit} bytes", code="request_too_large")


class SSEResponse(StreamingResponse):
    """A StreamingResponse that tells its job the stream is over, however it ended (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close, **kwargs) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_event(name: str, obj: Any) -> str:
    """A named server-sent event (`event:` line, then the data), as the Responses and Messages APIs stream them."""
    return f"event: {name}\n{sse(obj)}"
