"""The HTTP layer: OpenAI's chat and completions endpoints over one `Scheduler` (`serve.py` runs it for `tandem
serve`), and OpenAI's Responses and Anthropic's Messages APIs translated onto the same path (`openai_responses.py`,
`anthropic_messages.py`, through `turns.py`).
More: docs/internals.md."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from tandem.backends.base import Model
from tandem.config import EngineConfig, ServerConfig
from tandem.server import anthropic_messages, openai_responses, openapi, protocol
from tandem.server.asgi import BodyTooLargeError, RequestGuard, too_large_body
from tandem.server.errors import APIError, error_body, shaped_error
from tandem.server.metrics import CONTENT_TYPE_LATEST
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.safety import BrowserGuard
from tandem.server.state import Draft, Loader, Server, WarmUp
from tandem.server.turns import ClientGone, chat_prompt

log = logging.getLogger("tandem.server")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/models", "/health", "/metrics", "/openapi.json")
def create_app(target: Model | None = None, draft: Draft = None, *, load: Loader | None = None,
               warm_up: WarmUp | None = None, engine: EngineConfig | None = None,
               server: ServerConfig | None = None, kv_usage: Callable[[], float] | None = None) -> FastAPI:
    """The FastAPI app serving `target` (speculatively with `draft`: a Model, "ngram" or None).

    Args:
        target, draft: the models; or leave them out and give `load`, which returns (target, draft) and runs on a
            thread once the app starts, while /health answers 503 "loading".
        warm_up: run on the same thread after loading (/health: "warming"); requests wait for "ok".
        engine: how the engine runs (slots, draft_max, draft_policy, prompt_lookup, kv_budget_bytes: EngineConfig);
            requests may lower the drafting or turn it off ("speculative").
        server: what it admits and how it answers (model names, api_key, max_queue, body size, allowed hosts,
            CORS origins: ServerConfig). A model loaded later needs server.model_name.
        kv_usage: the KV cache usage fraction the metrics export [the slots running sequences hold].
    The worker thread starts and stops with the app's lifespan.
    """
    engine, config = engine or EngineConfig(), server or ServerConfig()
    if target is None and load is None:
        raise ValueError("create_app needs a target model or a load function")
    if target is None and config.model_name is None:
        raise ValueError("create_app needs a model_name when the model is loaded later")
    file_name = os.path.basename(str(target.path)).removesuffix(".gguf") if target is not None else None
    server = Server(engine, config, config.model_name or file_name, kv_usage)
    if target is not None:
        server.attach(target, draft)
        if warm_up is None:
            server.ready()
        else:
            server.status = "warming"

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        if server.status != "ready":
            threading.Thread(target=server.prepare, args=(load, warm_up), name="tandem-load", daemon=True).start()
        try:
            yield
        finally:
            server.drain()
            server.scheduler.stop()

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN (blank offline, a third party's code on
    # this origin); /openapi.json is served below, behind the API key like the rest.
    app = FastAPI(title="tandem", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, description="An OpenAI- and Anthropic-compatible server with lossless speculative "
                  "decoding (docs/api.md). With --api-key every route but /health and /metrics needs the key.")
    openapi.install(app)
    app.state.server = server
    # Starlette wraps the app in the order added, the last outermost: guard -> browser guard -> CORS -> app.
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(BrowserGuard, allowed_hosts=config.allowed_hosts)
    app.add_middleware(RequestGuard, max_body_bytes=config.max_body_bytes, metrics=server.metrics, endpoints=ENDPOINTS)

    def error_response(request: Request, status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        """OpenAI's error object, or Anthropic's on Anthropic's routes."""
        return JSONResponse(shaped_error(request.url.path, status, body), status_code=status,
                            headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        request.state.generation_summary = f" {exc.message}"  # the access log says why
        return error_response(request, exc.status, exc.body(), exc.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # the client closed the request (nginx's code): nobody reads it

    @app.exception_handler(BodyTooLargeError)
    async def too_large(request: Request, exc: BodyTooLargeError) -> JSONResponse:
        return error_response(request, 413, too_large_body(config.max_body_bytes))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = protocol._param_name(tuple(x for x in err.get("loc", ()) if x != "body"))
        return error_response(request, 400, error_body(f"{param or 'request'}: {err.get('msg')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(request, exc.status_code, error_body(message, kind, code=code),
                              getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(request, 500, error_body("internal server error", "server_error"))

    @app.post("/v1/chat/completions", response_model=None, openapi_extra=openapi.request_body(ChatCompletionRequest),
              responses={200: {"model": openapi.ChatCompletion}, **openapi.ERRORS}, summary="Chat completion")
    async def chat_completions(request: Request) -> Response:
        """OpenAI's chat completions, with tools, n choices, logprobs, streaming; see docs/api.md."""
        req = await server.parsed(request, ChatCompletionRequest)
        ids, tool_format = await chat_prompt(server, req)
        return await server.responder.run(request, "chat", req, ids, tool_format)

    @app.post("/v1/completions", response_model=None, openapi_extra=openapi.request_body(CompletionRequest),
              responses={200: {"model": openapi.Completion}, **openapi.ERRORS}, summary="Text completion")
    async def completions(request: Request) -> Response:
        """OpenAI's (legacy) completions: a text or token-id prompt, n choices, echo, logprobs, streaming."""
        req = await server.parsed(request, CompletionRequest)
        prompt = req.prompt
        tokenizer = server.target.tokenizer
        ids = await run_in_threadpool(tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
        server.check_prompt(ids, "prompt")
        return await server.responder.run(request, "text", req, ids)

    openai_responses.add_routes(app, server)
    anthropic_messages.add_routes(app, server)

    @app.get("/v1/models", response_model=openapi.ModelList, responses=openapi.ERRORS, summary="Served models")
    async def models(request: Request) -> dict:
        """The served model (one; its aliases are accepted in requests but not listed)."""
        server.require_ready()
        server.authorize(request)
        return {"object": "list", "data": [server.model_object(server.model_name)]}

    @app.get("/v1/models/{model_id:path}", response_model=openapi.ModelObject, responses=openapi.ERRORS,
             summary="One model")
    async def model(request: Request, model_id: str) -> dict:
        """The model named `model_id` (its id or an alias); 404 for any other name."""
        server.require_ready()
        server.authorize(request)
        server.check_model(model_id)
        return server.model_object(model_id if model_id in server.model_names else server.model_name)

    @app.get("/health", response_model=openapi.Health, responses={503: {"model": openapi.Health}},
             summary="Readiness")
    async def health() -> JSONResponse:
        """200 {"status": "ok"} when generations are taken; 503 with the status (loading, warming, draining,
        failed) otherwise, which is what gateways and orchestrators probe. "stage" and "elapsed_s" say what it
        is doing and since when; "costs", what the adaptive policy plans from (docs/internals.md)."""
        return JSONResponse(server.health(), status_code=200 if server.status == "ready" else 503)

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics",
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text exposition"}})
    async def metrics() -> Response:
        """Request, token and speculation counters; queue, batch and KV gauges (also under vLLM's names). Open
        without the API key: load-aware routers and scrapers read it; it holds counts, never a prompt or a reply."""
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_document(request: Request) -> JSONResponse:
        server.authorize(request)
        return JSONResponse(app.openapi())

    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:
        return "0"
