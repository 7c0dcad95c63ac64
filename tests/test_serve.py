"""`tandem serve` as a process: it listens while loading, drains on SIGTERM, and cuts streams at the deadline."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from test_server import wait_value as wait_for

# Slow enough (8 layers, d_model 256: ~100 tokens/s on one CPU thread) that a stream is still running when the
# test's SIGTERM lands right after its first token.
SLOW_SHAPE = dict(d_model=256, d_ffn=1024, n_layers=8, n_heads=4, n_kv_heads=2, context_length=4096)


class ServeProcess:
    """`python -m tandem.cli serve --port 0 ARGS` with its stderr collected; the URL comes from its first line."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--port", "0", *args],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        line = wait_for(lambda: next((x for x in self.lines if "listening on" in x), None) or self._exited())
        self.url = re.search(r"http://[^/ ]+", line).group(0)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def _exited(self) -> None:
        assert self.proc.poll() is None, "tandem serve exited:\n" + "\n".join(self.lines)

    def wait_ready(self) -> None:
        def ready() -> bool:
            self._exited()
            r = httpx.get(f"{self.url}/health")
            assert r.status_code == 200 or r.json()["status"] in ("loading", "warming"), r.text
            return r.status_code == 200

        wait_for(ready)

    def stderr(self) -> str:
        self.reader.join(30)
        return "\n".join(self.lines)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def slow_model(tiny_model_path):
    return tiny_model_path(seed=0, **SLOW_SHAPE)


def open_stream(client: httpx.Client, max_tokens: int):
    """(response, line iterator) of a streamed completion, after its first token arrived."""
    request = client.build_request("POST", "/v1/completions", json={
        "prompt": "hi", "max_tokens": max_tokens, "temperature": 0, "stream": True})
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    lines = (line for line in response.iter_lines() if line)
    assert next(lines).startswith("data: {")
    return response, lines


def test_sigterm_finishes_the_streams_in_flight_then_exits_0(slow_model):
    with ServeProcess("--model", slow_model, "--no-draft", "--backend", "torch", "--slots", "2",
                      "--shutdown-timeout", "120") as serve:
        serve.wait_ready()
        with httpx.Client(base_url=serve.url, timeout=120) as client:
            streams = [open_stream(client, 120) for _ in range(2)]
            serve.proc.send_signal(signal.SIGTERM)

            def refused() -> bool:  # the listener closes: new clients go elsewhere (a gateway retries them)
                try:
                    r = httpx.get(f"{serve.url}/health", timeout=5)
                except httpx.TransportError:
                    return True
                assert r.status_code == 503 and r.json()["status"] == "draining", r.text
                return False

            wait_for(refused)
            for response, lines in streams:
                rest = list(lines)
                response.close()
                assert rest[-1] == "data: [DONE]"
                last = json.loads(rest[-2][len("data: "):])
                assert last["choices"][0]["finish_reason"] == "length" and last["timings"]["predicted_n"] == 120
        assert serve.proc.wait(120) == 0
        log = serve.stderr()
        finished = [m.start() for m in re.finditer(r"POST /v1/completions 200", log)]
        assert len(finished) == 2 and log.index("Shutting down") < min(finished), log  # in flight at SIGTERM


def test_streams_past_the_deadline_are_cut(slow_model):
    with ServeProcess("--model", slow_model, "--no-draft", "--backend", "torch", "--shutdown-timeout", "0.5") as serve:
        serve.wait_ready()
        with httpx.Client(base_url=serve.url, timeout=120) as client:
            response, lines = open_stream(client, 3000)  # ~30 s of tokens: far past the deadline
            serve.proc.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.RemoteProtocolError):  # the connection closes mid-stream
                list(lines)
            response.close()
        assert serve.proc.wait(120) == 0
        assert "timeout graceful shutdown exceeded" in serve.stderr()


def test_a_malformed_model_exits_2_with_one_error_line(tmp_path, tiny_model_path):
    data = bytearray(open(tiny_model_path(seed=0), "rb").read())
    data[8:16] = (int.from_bytes(data[8:16], "little") - 1).to_bytes(8, "little")  # one tensor short
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with ServeProcess("--model", str(bad), "--no-draft", "--backend", "torch") as serve:
        assert serve.proc.wait(120) == 2
        errors = [line for line in serve.stderr().splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith(f"tandem: error: {bad}: "), errors
        assert "the count is short" in errors[0]


def test_the_announced_socket_already_listens():
    """`tandem serve` prints its address once the socket listens: a client that connects before uvicorn has started
    (the models still loading) is queued, not refused."""
    import socket

    from tandem.server.serve import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass  # accepted by the kernel's backlog, with no accept() yet
    finally:
        sock.close()
