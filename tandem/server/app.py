"""The HTTP layer: OpenAI-compatible endpoints over one `Scheduler`, and `serve(args)` for `tandem serve`.

Request path: the ASGI guard (body size limit, access log, request counter) -> API-key check -> strict parsing
(`protocol.parse_request`) -> tokenizing and the context check, before anything is queued -> `Scheduler.submit` ->
chunks back from the worker thread -> one JSON response or an SSE stream. Every error leaves as OpenAI's error
object with a 4xx status; anything unexpected is a generic 500, logged here with its traceback, never sent.

Context policy: a prompt that leaves no room for one generated token is a 400 saying by how many tokens it is too
long; otherwise max_tokens is clamped to the room left (as llama-server does), and an absent max_tokens means "until
the context is full" (as OpenAI does). `usage` and `finish_reason: "length"` show what happened.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.api import DEFAULT_DRAFT_MAX
from tandem.backends.base import Model
from tandem.engine import Engine
from tandem.engine import Request as EngineRequest
from tandem.sampling import SamplingParams
from tandem.server import protocol
from tandem.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tandem.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from tandem.server.scheduler import Event, Job, QueueFullError, Scheduler, ShuttingDownError

log = logging.getLogger("tandem.server")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
RETRY_AFTER_S = 1  # what a 503 for a full queue asks the client to wait
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class BodyTooLargeError(Exception):
    pass


class _Guard:
    """Raw ASGI middleware: refuse bodies over the limit without buffering them; log and count every request.

    Pure ASGI (not BaseHTTPMiddleware) so streamed responses and client disconnects pass through untouched.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: ServerMetrics) -> None:
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics

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
                await self._too_large(send_watching)
                return
            await self.app(scope, self._limited(receive), send_watching)
        finally:
            path = scope["path"]
            self.metrics.requests.labels(endpoint=path if path in ENDPOINTS else "other", status=str(status)).inc()
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

    async def _too_large(self, send: Send) -> None:
        response = JSONResponse(_too_large_body(self.max_body_bytes), status_code=413)
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def _too_large_body(limit: int) -> dict:
    return error_body(f"the request body exceeds the limit of {limit} bytes", code="request_too_large")


class _SSEResponse(StreamingResponse):
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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Server:
    """The endpoints' state: the models, the scheduler, the metrics, the settings."""

    def __init__(self, target: Model, draft: Model | str | None, model_name: str, aliases: Seq[str],
                 draft_max: int, draft_policy: str, api_key: str | None, slots: int, max_queue: int,
                 kv_budget_bytes: int | None = None) -> None:
        self.target, self.draft = target, draft
        self.model_name = model_name
        self.model_names = {model_name, *aliases}
        self.draft_max, self.draft_policy = draft_max, draft_policy
        self.api_key = api_key
        self.created = int(time.time())
        self.engine = Engine(target, draft, slots=slots, draft_max=draft_max, kv_budget_bytes=kv_budget_bytes,
                             measure_costs=draft is not None and draft_policy == "adaptive")
        self.scheduler = Scheduler(self.engine, max_queue=max_queue)
        self.metrics = ServerMetrics(lambda: self.scheduler.queue_depth, lambda: self.scheduler.active_count)
        self.scheduler.on_finish = self.metrics.observe_generation
        self.scheduler.on_cancel = self.metrics.cancelled.inc
        self.scheduler.on_step = self.metrics.batch_size.observe

    # --- checks before queueing ----------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, name: str | None) -> None:
        # No model named is fine (llama-server allows it); a wrong name is OpenAI's 404.
        if name is not None and name not in self.model_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty: at least one token is needed", param=param)
        vocab = self.target.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param=param)
        n_ctx = self.target.n_ctx
        if len(ids) >= n_ctx:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the context holds {n_ctx}, with room for at "
                           f"least one generated token: {len(ids) - n_ctx + 1} tokens too many", param=param,
                           code="context_length_exceeded")

    # --- generation ----------------------------------------------------------------------------------------

    def make_job(self, req: protocol._GenerationRequest, ids: list[int]) -> Job:
        room = self.target.n_ctx - len(ids)
        requested = req.requested_max_tokens
        enabled, draft_max = req.draft_override()
        try:
            sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                                      seed=req.seed)
            request = EngineRequest(
                ids, sampling, max_tokens=min(requested, room) if requested is not None else room,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []), speculate=enabled,
                # The server's draft_max is a ceiling: requests may lower k, not raise it past what the operator chose.
                draft_max=self.draft_max if draft_max is None else min(draft_max, self.draft_max),
                draft_policy=self.draft_policy,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return Job(request=request, loop=asyncio.get_running_loop())

    def submit(self, job: Job) -> None:
        try:
            self.scheduler.submit(job)
        except QueueFullError as e:
            raise APIError(503, f"the server is busy: {e}; retry later", type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDownError as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    async def next_event(self, job: Job, request: Request | None) -> Event | None:
        """The job's next event; None when `request`'s client went away (then the job is cancelled)."""
        if request is None:
            return await job.events.get()
        getter = asyncio.ensure_future(job.events.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    self.scheduler.cancel(job)
                    return None
        finally:
            getter.cancel()

    async def run(self, request: Request, kind: protocol.Kind, req: protocol._GenerationRequest,
                  ids: list[int]) -> Response:
        job = self.make_job(req, ids)
        self.submit(job)
        request_id = protocol.new_id("chatcmpl" if kind == "chat" else "cmpl")
        if req.stream:
            return _SSEResponse(self.stream(request, kind, req, job, request_id, len(ids)),
                                on_close=lambda: self.scheduler.cancel(job))
        try:
            pieces, n_tokens = [], 0
            while True:
                event = await self.next_event(job, request)
                if event is None:
                    return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
                if event.error is not None:
                    raise _as_api_error(event.error)
                chunk = event.chunk
                pieces.append(chunk.text)
                n_tokens += len(chunk.tokens)
                if chunk.finish_reason is not None:
                    break
        finally:
            self.scheduler.cancel(job)  # a no-op when it finished; frees the slot when we were cancelled
        self.summarize(request, chunk.stats, job)
        return JSONResponse(protocol.completion_response(
            kind, request_id, self.model_name, "".join(pieces), chunk.finish_reason,
            protocol.usage(len(ids), n_tokens, chunk.stats.cached_tokens), protocol.timings(chunk.stats, job.queue_ms)))

    async def stream(self, request: Request, kind: protocol.Kind, req: protocol._GenerationRequest, job: Job,
                     request_id: str, prompt_tokens: int) -> AsyncIterator[str]:
        """SSE events in OpenAI's chunk format, ending with `data: [DONE]`. Cancellation (a disconnect) lands in
        the awaits here; _SSEResponse then cancels the job."""
        created = int(time.time())

        def chunk_obj(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            return protocol.stream_chunk(kind, request_id, created, self.model_name, text, finish, role)

        if kind == "chat":
            yield _sse(chunk_obj("", role=True))
        n_tokens = 0
        while True:
            event = await self.next_event(job, None)
            if event.error is not None:
                error = _as_api_error(event.error)
                yield _sse(error.body())
                break
            chunk = event.chunk
            n_tokens += len(chunk.tokens)
            if chunk.text:
                yield _sse(chunk_obj(chunk.text))
            if chunk.finish_reason is not None:
                timings = protocol.timings(chunk.stats, job.queue_ms)
                usage = protocol.usage(prompt_tokens, n_tokens, chunk.stats.cached_tokens)
                last = chunk_obj(None if kind == "chat" else "", chunk.finish_reason)
                last["timings"] = timings
                yield _sse(last)
                if req.include_usage_in_stream:  # OpenAI's shape: one more chunk, no choices, the usage
                    yield _sse({**chunk_obj(None), "choices": [], "usage": usage, "timings": timings})
                self.summarize(request, chunk.stats, job)
                break
        yield "data: [DONE]\n\n"

    def summarize(self, request: Request, stats, job: Job) -> None:
        """What the access log line adds for a generation."""
        request.state.generation_summary = (
            f" prompt={stats.prompt_tokens} generated={stats.generated_tokens} drafted={stats.draft_tokens} "
            f"accepted={stats.accepted_tokens} queue={job.queue_ms:.0f}ms prefill={stats.prefill_ms:.0f}ms "
            f"decode={stats.decode_ms:.0f}ms")


def _as_api_error(error: BaseException) -> APIError:
    """A worker-side failure as what the client may see: its message for bad input, nothing for a bug."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ShuttingDownError):
        return APIError(503, str(error), type="server_error", code="shutting_down")
    if isinstance(error, ValueError):  # SamplingError, ContextOverflowError, ...: they name the bad input
        return APIError(400, str(error))
    return APIError(500, "internal server error", type="server_error")


def create_app(
    target: Model,
    draft: Model | str | None = None,
    *,
    model_name: str | None = None,
    aliases: Seq[str] = (),
    draft_max: int = DEFAULT_DRAFT_MAX,
    draft_policy: str = "adaptive",
    api_key: str | None = None,
    max_queue: int = 64,
    slots: int = 1,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    kv_budget_bytes: int | None = None,
) -> FastAPI:
    """The FastAPI app serving `target` (speculatively with `draft`: a Model, "ngram" or None).

    Args:
        model_name: the id /v1/models lists and responses carry [the target file's name without .gguf];
            requests may name it or any of `aliases`.
        draft_max, draft_policy: the default drafting; requests may lower it or turn it off ("speculative").
        api_key: when set, /v1/* needs `Authorization: Bearer <api_key>` (/health and /metrics stay open).
        max_queue: requests that may wait for a slot; one more gets a 503 with Retry-After.
        slots: generations decoded together at most, in one batched forward a step (1 = strictly serial).
        max_body_bytes: larger request bodies get a 413 without being read.
        kv_budget_bytes: KV memory for every slot's context (default: half the free memory); fewer slots fit a
            smaller budget, and one that holds no whole context is a start-up error.
    The worker thread starts and stops with the app's lifespan.
    """
    file_name = os.path.basename(str(target.path)).removesuffix(".gguf")
    server = Server(target, draft, model_name or file_name, [*aliases, file_name, str(target.path)], draft_max,
                    draft_policy, api_key, slots, max_queue, kv_budget_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        try:
            yield
        finally:
            server.scheduler.stop()

    app = FastAPI(title="tandem", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(_Guard, max_body_bytes=max_body_bytes, metrics=server.metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        request.state.generation_summary = f" {exc.message}"  # the access log says why
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(BodyTooLargeError)
    async def too_large(request: Request, exc: BodyTooLargeError) -> JSONResponse:
        return JSONResponse(_too_large_body(max_body_bytes), status_code=413)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = protocol._param_name(tuple(x for x in err.get("loc", ()) if x != "body"))
        return JSONResponse(error_body(f"{param or 'request'}: {err.get('msg')}", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(message, kind, code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        server.authorize(request)
        req = protocol.parse_request(ChatCompletionRequest, await request.body())
        server.check_model(req.model)
        try:
            ids = await run_in_threadpool(target.tokenizer.encode_chat, req.template_messages())
        except Exception as e:  # the chat template may refuse the messages (jinja's raise_exception)
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        server.check_prompt(ids, "messages")
        return await server.run(request, "chat", req, ids)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        server.authorize(request)
        req = protocol.parse_request(CompletionRequest, await request.body())
        server.check_model(req.model)
        prompt = req.prompt
        ids = await run_in_threadpool(target.tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
        server.check_prompt(ids, "prompt")
        return await server.run(request, "text", req, ids)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        server.authorize(request)
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "tandem",
            "meta": {"n_ctx": target.n_ctx, "vocab_size": target.vocab_size, "backend": target.backend,
                     "device": target.device, "draft": _draft_name(draft)},
        }]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "queue_depth": server.scheduler.queue_depth,
                "active": server.scheduler.active_count}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _draft_name(draft: Model | str | None) -> str | None:
    if draft is None or isinstance(draft, str):
        return draft
    return os.path.basename(str(draft.path))


def serve(args) -> int:
    """`tandem serve`: load the pair as `tandem generate` does, warm it up, and serve until interrupted."""
    import sys

    import uvicorn

    import tandem
    from tandem.cli import load_pair

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    target, draft = load_pair(args)
    app = create_app(
        target, draft, model_name=getattr(args, "served_model_name", None) or args.model, aliases=[args.model],
        draft_max=args.draft_max, draft_policy=args.draft_policy, api_key=args.api_key, max_queue=args.max_queue,
        slots=args.slots, max_body_bytes=getattr(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES),
        kv_budget_bytes=int(args.kv_budget_mib * 2**20) if getattr(args, "kv_budget_mib", None) else None,
    )
    # One short generation first: kernels warm up and the adaptive policy measures its costs before any client waits.
    first = target.tokenizer.bos_token_id or 0
    tandem.generate(target, prompt=[first], draft=draft, max_tokens=2, draft_max=args.draft_max,
                    draft_policy=args.draft_policy, n_ctx=None)
    print(f"tandem: serving {args.model} (draft: {_draft_name(draft)}) on http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False)
    return 0
