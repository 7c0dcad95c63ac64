"""The server's state behind the endpoints (app.py): the models, the scheduler, the metrics, the settings and the
readiness; the checks a request passes before it is queued, and its jobs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from tandem.backends.base import ContextOverflowError, Model
from tandem.config import EngineConfig, ServerConfig
from tandem.engine import Engine
from tandem.engine import Request as EngineRequest
from tandem.engine.cost_store import Calibrator, machine_busy, model_threads
from tandem.engine.generation import check_prompt
from tandem.loading import progress
from tandem.logits.grammar import ll_tokenizer
from tandem.sampling import SamplingParams
from tandem.server import protocol
from tandem.server.completion import Responder
from tandem.server.errors import APIError
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.scheduler import Job, QueueFullError, Scheduler, ShuttingDownError
from tandem.server.tools import FORCED_FORMAT, detect_format, template_supports_tools

log = logging.getLogger("tandem.server")

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
Parsed = TypeVar("Parsed", bound=protocol._Lenient)  # a request body's model


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
        self.stage = self.phase = "loading the models"  # what it is doing now (/health, the log), and in which phase
        self.started = self.stage_started = time.monotonic()
        self.step_name: str | None = None  # the step `stage` shows, without its count
        self.idle_work: list[IdleWork] = []  # handed to the scheduler once ready (warm_up may add some)
        self.calibrator: Calibrator | None = None  # the adaptive policy's costs (attach)
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.engine: Engine | None = None  # made by attach(): it sizes its KV pool and measures batched costs
        self.scheduler = Scheduler(None, slots=engine.slots, max_queue=config.max_queue)
        self.metrics = ServerMetrics(lambda: self.scheduler.queue_depth, lambda: self.scheduler.active_count,
                                     kv_usage or self.kv_usage, model_name, self.scheduler.clock)
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
        self.set_stage("making the engine")  # its KV pool; on a GPU, compiling and capturing the forwards' graphs
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
        """A new phase of the start (loading, making the engine, timing, warming up)."""
        self.phase = stage
        self.set_step(stage)

    def set_step(self, what: str, done: int | None = None, total: int | None = None) -> None:
        """A step of the phase (tandem.loading.progress's reports: "dequantising x.gguf", 3 of 339 tensors):
        /health shows it with its count; the log gets a line when it begins, with what the one before took, so a
        start's log is its profile."""
        shown = what if what == self.phase else f"{self.phase}: {what}"
        if shown != self.step_name:
            now = time.monotonic()
            log.info("%s (%.1f s since start; the step before took %.1f s)", shown, now - self.started,
                     now - self.stage_started)
            self.step_name, self.stage_started = shown, now
        self.stage = f"{shown} {done}/{total}" if total else shown

    def costs_summary(self) -> str:
        costs = self.engine.costs if self.engine is not None else None
        if costs is None:
            return "none"
        return (f"plain step {costs.target_ms(1, 1):.1f} ms, verify of 2 tokens {costs.target_ms(1, 2):.1f} ms, "
                f"draft step {costs.draft_ms(1):.1f} ms")

    def ready(self) -> None:
        """Take generations; the work that can wait runs while the server is idle (Scheduler.when_idle)."""
        self.status, self.stage = "ready", "serving"
        self.step_name, self.stage_started = self.stage, time.monotonic()
        for task in self.idle_work:
            self.scheduler.when_idle(task)
        self.idle_work = []

    def health(self) -> dict:
        body = {"status": "ok" if self.status == "ready" else self.status, "queue_depth": self.scheduler.queue_depth,
                "active": self.scheduler.active_count, "stage": self.stage,
                "elapsed_s": round(time.monotonic() - self.started, 1),
                "stage_s": round(time.monotonic() - self.stage_started, 1)}
        if self.calibrator is not None:
            body["costs"] = self.calibrator.progress()
        return body

    def prepare(self, load: Loader | None, warm_up: WarmUp | None) -> None:
        """Load the models (when none are attached), warm them up, then take requests. Runs on its own thread;
        no generation runs meanwhile, since none is admitted before "ready"."""
        try:
            with progress.listening(self.set_step):
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
            log.info("ready after %.1f s (the last step took %.1f s): serving %s (draft: %s)",
                     time.monotonic() - self.started, time.monotonic() - self.stage_started, self.model_name,
                     _draft_name(self.draft))
            self.ready()

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

    async def parsed(self, request: Request, model: type[Parsed]) -> Parsed:
        """A request let in: the server ready, its key right, its body parsed (strictly), its model this one."""
        self.require_ready()
        self.authorize(request)
        req = protocol.parse_request(model, await request.body())
        self.check_model(req.model)
        return req

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


def _draft_name(draft: Model | str | None) -> str | None:
    if draft is None or isinstance(draft, str):
        return draft
    return os.path.basename(str(draft.path))
