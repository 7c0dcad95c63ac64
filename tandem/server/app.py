"""The HTTP layer: OpenAI's chat and completions endpoints over one `Scheduler` (`serve.py` runs it for `tandem
serve`), and OpenAI's Responses and Anthropic's Messages APIs translated onto the same path (`openai_responses.py`,
`anthropic_messages.py`, through `turns.py`).

Request path: the ASGI guard (body size limit, access log, request counter) -> the browser guard (Host and
Content-Type, `safety.py`) -> CORS when origins are allowed -> readiness -> API-key check -> strict parsing
(`protocol.parse_request`) -> tokenizing (chat: the template gets the tools) and the context check, before anything
is queued -> the request's n choices queued together and answered by `completion.Responder` (chunks back from the
worker thread, each choice assembled by `choices.Choice`; one JSON response or an SSE stream). Every
error leaves as OpenAI's error object (Anthropic's on its routes) with a 4xx status; anything unexpected is a
generic 500, logged here with its traceback, never sent. /openapi.json describes it all (openapi.py).

Context policy: a prompt that leaves no room for one generated token is a 400 saying by how many tokens it is too
long; otherwise max_tokens is clamped to the room left (as llama-server does), and an absent max_tokens means "until
the context is full" (as OpenAI does). `usage` and `finish_reason: "length"` show what happened.

Lifecycle: `tandem serve` listens before it loads, so /health answers 503 with {"status": "loading"}, then
"warming", then 200 {"status": "ok"}; generation endpoints answer 503 (Retry-After) until then. The body says what it
is doing ("stage") and for how long ("elapsed_s"), and, with the adaptive policy, what the costs it plans from are
("costs": kept from an earlier start, a few seconds' estimate, or measured in full while the server is idle: the
server answers on the first two and refines them, engine.cost_store.Calibrator). On SIGTERM it drains:
the listener closes, /health and new requests get 503 "shutting_down", and the streams in flight finish within
--shutdown-timeout before the process exits 0. Behind a gateway (docs/deployment.md) this is what lets the gateway
retry elsewhere instead of losing requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from tandem.backends.base import ContextOverflowError, Model
from tandem.config import EngineConfig, ServerConfig
from tandem.engine import Engine
from tandem.engine import Request as EngineRequest
from tandem.engine.cost_store import Calibrator, machine_busy, model_threads
from tandem.engine.generation import check_prompt
from tandem.logits.grammar import ll_tokenizer
from tandem.sampling import SamplingParams
from tandem.server import anthropic_messages, openai_responses, openapi, protocol
from tandem.server.asgi import BodyTooLargeError, RequestGuard, too_large_body
from tandem.server.completion import Responder
from tandem.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tandem.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from tandem.server.safety import BrowserGuard
from tandem.server.scheduler import Job, QueueFullError, Scheduler, ShuttingDownError
from tandem.server.tools import FORCED_FORMAT, detect_format, template_supports_tools
from tandem.server.turns import ClientGone, chat_prompt

log = logging.getLogger("tandem.server")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/models", "/health", "/metrics", "/openapi.json")
NOT_READY = {  # status -> what a request gets while the server is not ready
    "loading": "the server is loading its models",
    "warming": "the server is warming up",
    "draining": "the server is shutting down",
    "failed": "the server failed to load its models",
}

Draft = Model | str | None
Loader = Callable[[], tuple[Model, Draft]]
WarmUp = Callable[[Engine], None]  # runs on the engine that will serve
IdleWork = Callable[[], float | None]  # Scheduler.when_idle's tasks


class Server:
    """The endpoints' state: the models, the scheduler, the metrics, the settings, the readiness.

    `status` goes loading -> warming -> ready -> draining (or failed); only "ready" takes generations.
    """

    def __init__(self, engine: EngineConfig, config: ServerConfig, model_name: str,
                 kv_usage: Callable[[], float] | None = None) -> None:
        self.target: Model | None = None
        self.draft: Draft = None
        self.engine_config, self.config = engine, config
        self.model_name = model_name
        self.model_names = {model_name, *config.aliases}
        self.created = int(time.time())
        self.status = "loading"
        self.stage = "loading the models"  # what it is doing now, for /health and the log
        self.started = time.monotonic()
        self.idle_work: list[IdleWork] = []  # handed to the scheduler once ready (warm_up may add some)
        self.calibrator: Calibrator | None = None  # the adaptive policy's costs (attach)
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.engine: Engine | None = None  # made by attach(): it sizes its KV pool and measures batched costs
        self.scheduler = Scheduler(None, slots=engine.slots, max_queue=config.max_queue)
        self.metrics = ServerMetrics(lambda: self.scheduler.queue_depth, lambda: self.scheduler.active_count,
                                     kv_usage or self.kv_usage, model_name)
        self.scheduler.on_finish = self.metrics.observe_generation
        self.scheduler.on_cancel = self.metrics.cancelled.inc
        self.scheduler.on_step = self.metrics.batch_size.observe
        self.responder = Responder(self)

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def attach(self, target: Model, draft: Draft) -> None:
        """Serve `target` (with `draft`); requests may also name its file, with or without the directory."""
        file_name = os.path.basename(str(target.path)).removesuffix(".gguf")
        self.model_names |= {file_name, str(target.path)}
        self.target, self.draft = target, draft
        # The costs come from the Calibrator, not the engine's own start-up measurement: kept or estimated now,
        # measured in full once the server is ready and idle.
        self.engine = Engine(target, draft, self.engine_config, measure_costs=False)
        threads = model_threads(target)
        if str(target.device).startswith("cpu") and threads and machine_busy(threads):
            # ggml's threads wait on each other at every operation: one descheduled, the rest spin (a 2-core machine
            # beside one busy process: 200 ms a step on 2 threads, 73 on 1, 35 quiet).
            log.warning("other work is running on the cores this server's %d threads compute on: its forwards may take "
                        "several times as long beside it; --threads %d leaves that work a core", threads,
                        max(1, threads - 1))
        if draft is not None and self.engine_config.draft_policy == "adaptive" and self.engine.draft_max > 0:
            self.set_stage("timing the pair's costs")
            self.calibrator = Calibrator(self.engine)
            self.calibrator.start()
            if not str(target.device).startswith("cpu"):
                # A GPU times the whole measurement in seconds; a server loaded from its start is never idle and
                # planned from the estimate all along (docs/decisions/0001).
                self.calibrator.measure_now(self.config.measure_at_start_s)
            log.info("costs: %s (%s)", self.calibrator.source, self.costs_summary())
            self.idle_work.append(lambda: self.calibrator.step(hurry=self.scheduler.has_waiting))
        self.scheduler.attach(self.engine)

    def set_stage(self, stage: str) -> None:
        self.stage = stage
        log.info("%s (%.1f s since start)", stage, time.monotonic() - self.started)

    def costs_summary(self) -> str:
        costs = self.engine.costs if self.engine is not None else None
        if costs is None:
            return "none"
        return (f"plain step {costs.target_ms(1, 1):.1f} ms, verify of 2 tokens {costs.target_ms(1, 2):.1f} ms, "
                f"draft step {costs.draft_ms(1):.1f} ms")

    def ready(self) -> None:
        """Take generations; the work that can wait runs while the server is idle (Scheduler.when_idle)."""
        self.status, self.stage = "ready", "serving"
        for task in self.idle_work:
            self.scheduler.when_idle(task)
        self.idle_work = []

    def health(self) -> dict:
        body = {"status": "ok" if self.status == "ready" else self.status, "queue_depth": self.scheduler.queue_depth,
                "active": self.scheduler.active_count, "stage": self.stage,
                "elapsed_s": round(time.monotonic() - self.started, 1)}
        if self.calibrator is not None:
            body["costs"] = self.calibrator.progress()
        return body

    def prepare(self, load: Loader | None, warm_up: WarmUp | None) -> None:
        """Load the models (when none are attached), warm them up, then take requests. Runs on its own thread;
        no generation runs meanwhile, since none is admitted before "ready"."""
        try:
            if self.target is None:
                self.set_stage("loading the models")
                self.attach(*load())
            self.status = "warming"
            if warm_up is not None:
                self.set_stage("warming up")
                warm_up(self.engine)
        except BaseException as e:  # noqa: BLE001  (reported through load_error; serve() exits with it)
            self.status, self.load_error = "failed", e
            if not isinstance(e, ValueError | FileNotFoundError):
                log.error("loading the models failed", exc_info=e)
            if self.on_load_error is not None:
                self.on_load_error(e)
            return
        if self.status == "warming":  # not draining meanwhile
            self.ready()
            log.info("ready after %.1f s: serving %s (draft: %s)", time.monotonic() - self.started, self.model_name,
                     _draft_name(self.draft))

    def drain(self) -> None:
        """Stop admitting: /health and new requests get 503; what is queued or streaming carries on."""
        self.status = "draining"

    def require_ready(self) -> None:
        if self.status != "ready":
            code = "shutting_down" if self.status == "draining" else "not_ready"
            raise APIError(503, f"{NOT_READY[self.status]}; retry later", type="server_error", code=code,
                           headers={"Retry-After": str(self.config.retry_after_s)})

    def kv_usage(self) -> float:
        """Fraction of the KV memory the running sequences hold (slots are reserved whole: Engine.kv_usage)."""
        return self.engine.kv_usage() if self.engine is not None else 0.0

    # --- checks before queueing ----------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        """With an API key set, every route but /health needs it: `Authorization: Bearer <key>`, or Anthropic's
        `x-api-key: <key>`."""
        api_key = self.config.api_key
        if api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        given = key if scheme.lower() == "bearer" else request.headers.get("x-api-key")
        if given is None or not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>' (or 'x-api-key: "
                           "<key>')", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, name: str | None) -> None:
        # No model named is fine (llama-server allows it); a wrong name is OpenAI's 404, unless the operator
        # accepts any name (replicas behind a gateway: docs/deployment.md says why).
        if name is not None and name not in self.model_names and not self.config.accept_any_model:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def model_object(self, model_id: str) -> dict:
        target = self.target
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "tandem",
                "meta": {"n_ctx": target.n_ctx, "vocab_size": target.vocab_size, "backend": target.backend,
                         "device": target.device, "draft": _draft_name(self.draft)}}

    def tool_format(self, req: ChatCompletionRequest) -> str | None:
        """The format to parse tool calls in (None: the reply is text only), or a 400 for tools this server
        cannot offer: a template that ignores them."""
        if req.tools_offered is None:
            return None
        template = self.target.tokenizer.chat_template
        if not template_supports_tools(template):
            raise APIError(400, "this model's chat template does not render tools, so the model would never see "
                           "them", param="tools", code="tools_not_supported")
        if req.forces_call:  # the reply is constrained to the calls' JSON (protocol.forced_schema)
            return FORCED_FORMAT
        return detect_format(template, self.target.config.architecture)

    def check_prompt(self, ids: list[int], param: str) -> None:
        try:
            check_prompt(ids, self.target.vocab_size, self.target.n_ctx)
        except ContextOverflowError as error:
            raise APIError(400, str(error), param=param, code="context_length_exceeded") from None
        except ValueError as error:
            raise APIError(400, str(error), param=param) from None

    # --- generation ----------------------------------------------------------------------------------------

    def make_jobs(self, req: protocol._GenerationRequest, ids: list[int]) -> list[Job]:
        """The request's n choices as n jobs sharing one event queue (choice i samples with req.choice_seed(i))."""
        room = self.target.n_ctx - len(ids)
        requested = req.requested_max_tokens
        enabled, draft_max = req.draft_override()
        loop, events, jobs = asyncio.get_running_loop(), asyncio.Queue(), []
        logits = req.logits_settings(self.target.vocab_size)
        for index in range(req.n):
            try:
                sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                          min_p=req.min_p, seed=req.choice_seed(index))
                request = EngineRequest(
                    ids, sampling, max_tokens=min(requested, room) if requested is not None else room,
                    stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []), speculate=enabled,
                    draft_max=draft_max,  # None: the server's; more is capped there (Generation.draft_max)
                    draft_policy=self.engine_config.draft_policy, logprobs=req.logprobs_count(),
                    logits=logits,
                )
            except ValueError as e:
                raise APIError(400, str(e)) from None
            jobs.append(Job(request=request, loop=loop, events=events, index=index))
        return jobs

    def submit(self, jobs: list[Job]) -> None:
        self.require_ready()  # again: a drain may have begun while the prompt was tokenized
        try:
            self.scheduler.submit_all(jobs)
        except QueueFullError as e:
            raise APIError(503, f"the server is busy: {e}; retry later", type="server_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except ShuttingDownError as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None

    def cancel(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.scheduler.cancel(job)

    def piece(self, token: int) -> str:
        """A token's text, as logprobs show it."""
        return self.target.tokenizer.decode([token])

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes (part of a UTF-8 character for some), as llguidance reads them from the vocabulary;
        a special token's, its text's."""
        vocab = ll_tokenizer(self.target.tokenizer, self.target.vocab_size)
        if token >= vocab.vocab_size or vocab.is_special_token(token):
            return self.piece(token).encode()
        return vocab.decode_bytes([token])


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
        return JSONResponse(protocol.shaped_error(request.url.path, status, body), status_code=status,
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
        server.require_ready()
        server.authorize(request)
        req = protocol.parse_request(ChatCompletionRequest, await request.body())
        server.check_model(req.model)
        ids, tool_format = await chat_prompt(server, req)
        return await server.responder.run(request, "chat", req, ids, tool_format)

    @app.post("/v1/completions", response_model=None, openapi_extra=openapi.request_body(CompletionRequest),
              responses={200: {"model": openapi.Completion}, **openapi.ERRORS}, summary="Text completion")
    async def completions(request: Request) -> Response:
        """OpenAI's (legacy) completions: a text or token-id prompt, n choices, echo, logprobs, streaming."""
        server.require_ready()
        server.authorize(request)
        req = protocol.parse_request(CompletionRequest, await request.body())
        server.check_model(req.model)
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
        is doing and since when; "costs", what the adaptive policy plans from (see the module docstring)."""
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


def _draft_name(draft: Model | str | None) -> str | None:
    if draft is None or isinstance(draft, str):
        return draft
    return os.path.basename(str(draft.path))
