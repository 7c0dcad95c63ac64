"""`tandem serve`: bind at once, load and warm the pair up on a thread while /health answers 503, serve until SIGTERM
or SIGINT, then drain (the lifecycle: docs/internals.md, app.py)."""

from __future__ import annotations

import logging
import os
import signal
import socket

import uvicorn

from tandem.config import EngineConfig, ServerConfig
from tandem.engine import Engine, Request
from tandem.server.app import create_app
from tandem.server.safety import allowed_hosts_for, exposure_warning
from tandem.server.state import Server

log = logging.getLogger("tandem.server")


def warm_up(engine: Engine, draft_policy: str) -> None:
    """One short generation on the engine that will serve: kernels and graphs warm up before any client waits."""
    first = engine.target.tokenizer.bos_token_id or 0
    engine.generate([Request([first], max_tokens=2, draft_policy=draft_policy)])


def grammar_vocabulary(server: Server) -> None:
    """The grammar library's view of the vocabulary (~1 s for 152k tokens), built at the server's first idle moment
    (Scheduler.when_idle), not before it answers: else the first structured request would stall every running
    stream while the engine builds it."""
    from tandem.logits.grammar import ll_tokenizer

    target = server.target
    try:
        ll_tokenizer(target.tokenizer, target.vocab_size)
    except Exception:  # noqa: BLE001  (structured requests then fail with the reason; the rest are unaffected)
        log.warning("the grammar library cannot read this vocabulary: structured output will fail", exc_info=True)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, draining tandem's first when a signal asks it to stop (uvicorn then closes the listener
    and waits up to timeout_graceful_shutdown for the requests in flight)."""

    def __init__(self, config: uvicorn.Config, server: Server) -> None:
        super().__init__(config)
        self.tandem = server

    def handle_exit(self, sig: int, frame) -> None:
        self.tandem.drain()
        super().handle_exit(sig, frame)


LISTEN_BACKLOG = 2048  # uvicorn's default


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one. It listens before the address is announced:
    bound only, it refused the connections a client made between "listening on" and uvicorn's own listen (seen
    in CI while the models loaded on another thread)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then; without it, uvicorn's separate
    # header and body writes meet the client's delayed ACK and every request after a connection's first waits ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    return sock


def engine_config(args) -> EngineConfig:
    """The engine a `tandem serve` command line asks for."""
    return EngineConfig(slots=args.slots, draft_max=args.draft_max, draft_policy=args.draft_policy,
                        prompt_lookup=args.prompt_lookup is not False,
                        kv_budget_bytes=int(args.kv_budget_mib * 2**20) if args.kv_budget_mib else None)


def server_config(args) -> ServerConfig:
    """The server a `tandem serve` command line asks for."""
    # The id clients see: a name, never the server's file path (the path as typed is still accepted).
    served_names = args.served_model_name or [os.path.basename(args.model).removesuffix(".gguf")]
    return ServerConfig(model_name=served_names[0], aliases=(*served_names[1:], args.model),
                        accept_any_model=args.accept_any_model, api_key=args.api_key, max_queue=args.max_queue,
                        max_body_bytes=args.max_body_bytes, cors_origins=tuple(args.cors_origin),
                        allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
                        shutdown_timeout_s=args.shutdown_timeout)


def serve(args) -> int:
    """`tandem serve`: listen at once, load and warm up the pair meanwhile (/health: 503), serve until SIGTERM or
    SIGINT, then drain (docs/internals.md, app.py)."""
    import sys

    from tandem.api import load_pair

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        rule = "!" * 100
        log.warning("\n%s\n%s\n%s", rule, warning, rule)
    sock = bind_socket(args.host, args.port)
    app = create_app(
        load=lambda: load_pair(args.model, args.draft, args.no_draft, args.device, args.dtype, args.backend,
                               args.ctx, args.draft_device, progress=sys.stderr.isatty(),
                               isolation=getattr(args, "llamacpp_isolation", "auto"), threads=args.threads),
        warm_up=lambda engine: warm_up(engine, args.draft_policy),
        engine=engine_config(args), server=server_config(args),
    )
    server: Server = app.state.server
    server.idle_work.append(lambda: grammar_vocabulary(server))
    config = uvicorn.Config(app, log_level="info", access_log=False,
                            timeout_graceful_shutdown=server.config.shutdown_timeout_s)
    http = DrainingServer(config, server)
    server.on_load_error = lambda _: setattr(http, "should_exit", True)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"tandem: listening on http://{shown}:{port}/v1 (loading {args.model}; /health answers 503 until ready)",
          file=sys.stderr, flush=True)
    # uvicorn raises the signal it handled again once its graceful shutdown is over; the drain was the handling,
    # so the process then exits 0 instead of dying by SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: None)
    http.run(sockets=[sock])
    if server.load_error is not None:
        raise server.load_error
    return 0
