"""Browser-safe defaults: what a web page must not be able to make a local server do.
More: docs/internals.md."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.server.errors import ANTHROPIC_ROUTES, error_body, shaped_error

JSON_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", *ANTHROPIC_ROUTES})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
ANY_HOST = "*"


def split_host(header: str) -> str:
    """The host part of a `Host` header value, lower case, without port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8080
        return header[1:].split("]", 1)[0]
    if header.count(":") == 1:  # name:port or a.b.c.d:port (a bare IPv6 address has several colons)
        return header.split(":", 1)[0]
    return header


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address or a Host header's host) names this machine's loopback interface."""
    host = split_host(host).rstrip(".")
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):  # RFC 6761: *.localhost is loopback
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(bind_host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The Host values to accept, or None for any: loopback binds check by default, others only when asked.
    extra: `--allowed-hosts` entries (names or addresses, without port; "*" accepts any)."""
    extra = frozenset(split_host(h) for h in extra if h.strip())
    if ANY_HOST in extra or (not extra and not is_loopback(bind_host)):
        return None
    return extra


class BrowserGuard:
    """Raw ASGI middleware: refuse foreign Host headers and non-JSON bodies on the JSON endpoints."""

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str] | None) -> None:
        self.app, self.allowed_hosts = app, allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        refusal = self._check_host(headers.get(b"host", b"").decode("latin-1"))
        if refusal is None and scope["method"] == "POST" and scope["path"] in JSON_ENDPOINTS:
            refusal = self._check_content_type(headers.get(b"content-type", b"").decode("latin-1"))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, body = refusal
        await JSONResponse(shaped_error(scope["path"], status, body), status_code=status)(scope, receive, send)

    def _check_host(self, header: str) -> tuple[int, dict] | None:
        if self.allowed_hosts is None:
            return None
        host = split_host(header)
        if is_loopback(host) or host in self.allowed_hosts:
            return None
        return 403, error_body(
            f"Host {header!r} is not allowed: this server listens on loopback and answers loopback names only "
            "(start it with --allowed-hosts to accept other names)", code="host_not_allowed")

    @staticmethod
    def _check_content_type(header: str) -> tuple[int, dict] | None:
        media_type = header.split(";", 1)[0].strip().lower()
        if media_type == "application/json":
            return None
        shown = repr(header) if header else "none"
        return 415, error_body(f"Content-Type {shown} is not supported: send 'application/json'",
                               code="unsupported_media_type")


def exposure_warning(bind_host: str, api_key: str | None) -> str | None:
    """The warning for a server reachable beyond this machine with no API key, or None."""
    if api_key or is_loopback(bind_host):
        return None
    return (f"tandem is listening on {bind_host}, beyond loopback, WITHOUT an API key: anyone who can reach this "
            "address can run generations on it. Pass --api-key (or bind 127.0.0.1 behind a gateway).")
