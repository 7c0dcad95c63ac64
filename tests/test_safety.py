"""tandem.server.safety: Host and Content-Type checks, CORS off by default, the exposure warning."""

from __future__ import annotations

import httpx
import pytest
from test_server import LiveServer, load

from tandem.config import EngineConfig, ServerConfig
from tandem.server.app import create_app
from tandem.server.safety import allowed_hosts_for, exposure_warning, is_loopback, split_host

BODY = b'{"prompt": "hi", "max_tokens": 1, "temperature": 0}'


@pytest.mark.parametrize("header, host", [("127.0.0.1:8080", "127.0.0.1"), ("[::1]:80", "::1"), ("::1", "::1"),
                                          ("LocalHost", "localhost"), ("evil.example:80", "evil.example")])
def test_split_host(header, host):
    assert split_host(header) == host


def test_loopback_names_and_addresses():
    assert all(map(is_loopback, ["localhost", "127.0.0.1", "127.3.2.1", "::1", "[::1]:8080", "app.localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "evil.example", "localhost.evil.example", ""]))


def test_allowed_hosts_follow_the_bind():
    assert allowed_hosts_for("127.0.0.1") == frozenset()  # loopback only
    assert allowed_hosts_for("127.0.0.1", ["box.lan:8080", " "]) == {"box.lan"}
    assert allowed_hosts_for("127.0.0.1", ["*"]) is None
    assert allowed_hosts_for("0.0.0.0") is None  # reachable from elsewhere: names are the operator's business
    assert allowed_hosts_for("0.0.0.0", ["api.example"]) == {"api.example"}


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("localhost", None) is None
    assert exposure_warning("0.0.0.0", "sk-key") is None
    assert "WITHOUT an API key" in exposure_warning("0.0.0.0", None)
    assert "WITHOUT an API key" in exposure_warning("::", None)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load(tiny_model_path(seed=0))


@pytest.fixture(scope="module")
def loopback_server(model):
    """A loopback server with the defaults `tandem serve --host 127.0.0.1` gets."""
    config = ServerConfig(model_name="tiny", allowed_hosts=allowed_hosts_for("127.0.0.1"))
    with LiveServer(create_app(model, None, engine=EngineConfig(slots=1), server=config)) as s:
        yield s


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "attacker.com.", "10.0.0.1"])
def test_foreign_host_is_refused_on_a_loopback_bind(loopback_server, host):
    """DNS rebinding: the page's own name resolves to 127.0.0.1 and its requests carry that name as Host."""
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/health")):
        r = httpx.request(method, loopback_server.url + path, content=BODY, headers={
            "Host": host, "Content-Type": "application/json"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (method, path, r.text)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "localhost:1234", "[::1]:9"])
def test_loopback_hosts_are_answered(loopback_server, host):
    r = httpx.post(loopback_server.url + "/v1/completions", content=BODY,
                   headers={"Host": host, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_non_json_bodies_get_415(loopback_server, content_type):
    """What a browser sends cross-site without a CORS preflight never starts a generation."""
    headers = {"Content-Type": content_type} if content_type else {}
    before = prompt_tokens(loopback_server)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(loopback_server.url + path, content=BODY, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    assert prompt_tokens(loopback_server) == before


def prompt_tokens(server) -> float:
    """The server's count of prompt tokens prefilled so far."""
    line = next(line for line in httpx.get(server.url + "/metrics").text.splitlines()
                if line.startswith("tandem_prompt_tokens_total "))
    return float(line.split()[1])


def test_json_with_charset_is_fine(loopback_server):
    r = httpx.post(loopback_server.url + "/v1/completions", content=BODY,
                   headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_cors_is_off_by_default(loopback_server):
    preflight = httpx.options(loopback_server.url + "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in preflight.headers
    r = httpx.post(loopback_server.url + "/v1/completions", content=BODY,
                   headers={"Origin": "https://evil.example", "Content-Type": "application/json"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_origin_and_allowed_hosts_widen(model):
    app = create_app(model, None, engine=EngineConfig(slots=1),
                     server=ServerConfig(model_name="tiny", allowed_hosts=allowed_hosts_for("127.0.0.1", ["box.lan"]), cors_origins=("http://localhost:3000",)))
    with LiveServer(app) as server:
        ok = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
              "Access-Control-Request-Headers": "content-type"}
        preflight = httpx.options(server.url + "/v1/completions", headers=ok)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = httpx.options(server.url + "/v1/completions", headers={**ok, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = httpx.post(server.url + "/v1/completions", content=BODY, headers={
            "Host": "box.lan:8080", "Origin": "http://localhost:3000", "Content-Type": "application/json"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert httpx.get(server.url + "/health", headers={"Host": "evil.example"}).status_code == 403


def test_serve_warns_loudly_beyond_loopback_without_a_key(monkeypatch, caplog):
    """`tandem serve --host 0.0.0.0` without --api-key: the warning comes before anything is bound or loaded."""
    from tandem.cli import build_parser
    from tandem.server import serve as serve_module

    class Bound(Exception):
        pass

    def bind(host, port):  # stop where the socket would be bound: nothing leaves loopback in a test
        raise Bound(host)

    monkeypatch.setattr(serve_module, "bind_socket", bind)
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--model", "x.gguf", "--allowed-hosts", "a,b"])
    assert args.allowed_hosts == ["a", "b"]
    with pytest.raises(Bound):
        serve_module.serve(args)
    assert "WITHOUT an API key" in caplog.text
    caplog.clear()
    with pytest.raises(Bound):
        serve_module.serve(build_parser().parse_args(["serve", "--host", "0.0.0.0", "--api-key", "k"]))
    assert "WITHOUT an API key" not in caplog.text


def test_accepted_connections_send_without_delay():
    """tandem serve's socket makes asyncio set TCP_NODELAY on each accepted connection (uvicorn writes a response's
    head and body separately; with Nagle on, a kept-alive connection's next request waited ~40 ms for an ACK)."""
    import asyncio
    import socket

    from tandem.server import serve as serve_module

    async def accept_one() -> int:
        sock = serve_module.bind_socket("127.0.0.1", 0)
        accepted = asyncio.get_running_loop().create_future()

        def handler(reader, writer):
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handler, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        nodelay = await asyncio.wait_for(accepted, 10)
        writer.close()
        server.close()
        return nodelay

    assert asyncio.run(accept_one()) != 0
