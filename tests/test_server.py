"""`tandem serve` end to end: real uvicorn servers on loopback, tiny random models, the official openai client."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from conftest import assert_speculated

import tandem
from tandem.config import EngineConfig, ServerConfig
from tandem.server.app import create_app

CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", '{"name": "tandem", "items": [1, 2,']
API_KEY = "sk-test-key"


class LiveServer:
    """A uvicorn server for `app` on a free loopback port, in a background thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    """Poll until condition() holds. The timeout only keeps a broken server from hanging the suite; no assertion
    depends on how long anything took."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def health(server: LiveServer) -> dict:
    return httpx.get(f"{server.url}/health").json()


def metric(text: str, name: str) -> float:
    """A sample's value in Prometheus text (0 when absent): name may carry labels, as the exposition writes them."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def metrics_of(server: LiveServer, headers: dict | None = None) -> str:
    return httpx.get(f"{server.url}/metrics", headers=headers).text


def gate_generations(monkeypatch) -> threading.Event:
    """Once an engine step has handed out a chunk (a generation's first), every later step waits for the returned
    event: a test decides the order of events instead of racing the decode loop."""
    from tandem.engine import Engine

    gate, real, started = threading.Event(), Engine.step, threading.Event()

    def gated(self):
        if started.is_set():
            gate.wait(60)
        events = real(self)
        if events:
            started.set()
        return events

    monkeypatch.setattr(Engine, "step", gated)
    return gate


def watch_cancel(monkeypatch, server: LiveServer) -> threading.Event:
    """An event set once the server cancels a job (a client disconnect seen)."""
    scheduler, called = server.server.config.app.state.server.scheduler, threading.Event()
    real = scheduler.cancel

    def cancel(job):
        real(job)
        called.set()

    monkeypatch.setattr(scheduler, "cancel", cancel)
    return called


def load(path: str, **kw):
    # float64 keeps batched-verify numerics from flipping a near-tie, so greedy texts compare exactly.
    return tandem.load(path, backend="torch", dtype="float64", **kw)


@pytest.fixture(scope="module")
def paths(tiny_model_path):
    """A target, and a draft that mostly agrees with it (the same weights quantized to Q4_0)."""
    return tiny_model_path(seed=0), tiny_model_path(qtype="Q4_0", seed=0)


@pytest.fixture(scope="module")
def spec_server(paths):
    """Speculative, 4 slots (round-robin), fixed k so drafting always happens."""
    target, draft = load(paths[0]), load(paths[1])
    app = create_app(target, draft, engine=EngineConfig(draft_max=4, draft_policy="fixed", slots=4),
                     server=ServerConfig(model_name="tiny", aliases=("tiny-alias",), max_queue=64))
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def plain_server(paths):
    """Plain decoding, strictly serial (slots=1), with an API key."""
    app = create_app(load(paths[0]), None, engine=EngineConfig(slots=1),
                     server=ServerConfig(model_name="tiny", api_key=API_KEY, max_queue=64))
    with LiveServer(app) as server:
        yield server


def stream_text(client: openai.OpenAI, **kw) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model="tiny", stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def assert_openai_error(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


# --- the openai client ---------------------------------------------------------------------------------------

def test_chat_usage_and_timings(spec_server, paths):
    client = spec_server.client()
    response = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert response.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    expected = tandem.generate(load(paths[0]), messages=CHAT, max_tokens=12)
    assert choice.message.content == expected.text
    assert response.usage.completion_tokens == len(expected.tokens)
    assert response.usage.prompt_tokens == expected.stats.prompt_tokens
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    timings = response.model_extra["timings"]
    for key in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second",
                "draft_n", "draft_n_accepted", "draft_ms", "verify_ms", "acceptance_rate", "iterations"):
        assert key in timings, key
    assert timings["predicted_n"] == response.usage.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == response.usage.prompt_tokens


def test_completion_prompt_forms(spec_server):
    client = spec_server.client()
    text = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert text.object == "text_completion" and text.choices[0].logprobs is None
    ids = load_tokenizer_ids(spec_server, PROMPTS[0])
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    as_list = client.completions.create(model="tiny-alias", prompt=[PROMPTS[0]], max_tokens=8, temperature=0)
    assert text.choices[0].text == by_ids.choices[0].text == as_list.choices[0].text
    assert text.usage.prompt_tokens == len(ids)


def load_tokenizer_ids(server: LiveServer, text: str) -> list[int]:
    return server.server.config.app.state.server.target.tokenizer.encode(text)


def test_streaming_equals_non_streaming(spec_server):
    client = spec_server.client()
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
        streamed, chunks = stream_text(client, messages=messages, max_tokens=20, temperature=0,
                                       stream_options={"include_usage": True})
        assert streamed == whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
        finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finish) == 1 and finish[0].model_extra["timings"]["predicted_n"] == whole.usage.completion_tokens
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    text = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=15, temperature=0)
    pieces = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=15, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == text.choices[0].text


def test_sse_wire_format(spec_server):
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{spec_server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["object"] == "chat.completion.chunk" and last["choices"][0]["finish_reason"] == "length"
    assert last["timings"]["predicted_n"] == 5


def test_models_list(spec_server):
    models = spec_server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_stop_and_sampling_fields(spec_server):
    client = spec_server.client()
    greedy = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0)
    text = greedy.choices[0].message.content
    assert len(text) > 4 and greedy.choices[0].finish_reason == "length", text  # room for a stop string inside
    stop = text[3:5]
    stopped = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0, stop=stop)
    assert stopped.choices[0].message.content == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    seeded = [client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0.9, top_p=0.9,
                                             seed=7, extra_body={"top_k": 20, "min_p": 0.01}).choices[0].message.content
              for _ in range(2)]
    assert seeded[0] == seeded[1]


# --- speculative vs plain ------------------------------------------------------------------------------------

def test_speculative_equals_plain_and_drafts(spec_server, plain_server):
    spec, plain = spec_server.client(), plain_server.client(api_key=API_KEY)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        a = spec.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
        b = plain.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
        assert a.choices[0].message.content == b.choices[0].message.content
        assert_speculated(a.model_extra["timings"])
        assert b.model_extra["timings"]["draft_n"] == 0


def test_per_request_draft_override(spec_server):
    client = spec_server.client()
    off = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                         extra_body={"speculative": False})
    off2 = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                          extra_body={"speculative": {"enabled": False}})
    k1 = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                        extra_body={"speculative": {"draft_max": 1}})
    assert off.model_extra["timings"]["draft_n"] == off2.model_extra["timings"]["draft_n"] == 0
    assert 0 < k1.model_extra["timings"]["draft_n"] <= k1.model_extra["timings"]["iterations"]
    assert off.choices[0].message.content == k1.choices[0].message.content


# --- concurrency ---------------------------------------------------------------------------------------------

def test_16_concurrent_streams_equal_serial(spec_server):
    client = spec_server.client(timeout=60)
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(16)]

    def serial(prompt: str) -> str:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=16, temperature=0)
        return r.choices[0].message.content

    expected = [serial(p) for p in prompts]

    def streamed(prompt: str) -> str:
        return stream_text(client, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0)[0]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(streamed, prompts))
    assert got == expected
    health = httpx.get(f"{spec_server.url}/health").json()
    assert health | {"elapsed_s": 0, "stage_s": 0} == {"status": "ok", "queue_depth": 0, "active": 0,
                                                       "stage": "serving", "elapsed_s": 0, "stage_s": 0}


def sse_events(body: str) -> list:
    """A stream's events, what differs between runs (ids, times, timings, the prefix cache) masked, the rest as
    sent, byte for byte."""
    assert body.endswith("data: [DONE]\n\n")
    events = []
    for raw in body.split("\n\n")[:-1]:
        raw = re.sub(r'"(id|created|cached_tokens)":("[^"]*"|\d+)', r'"\1":0', raw)
        events.append({k: v for k, v in json.loads(raw[len("data: "):]).items() if k != "timings"}
                      if '"timings"' in raw else raw)
    return events


@pytest.mark.parametrize("path,body", [
    ("chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}),
    ("completions", {"prompt": PROMPTS[0], "n": 2})])
def test_a_lagging_stream_catches_up_in_one_write_with_the_same_bytes(spec_server, monkeypatch, path, body):
    # The events queued behind a stream's next one go out in one write; the client reads exactly what a write per
    # event sends. The test holds each read back until several events wait, so batches really form.
    from tandem.server.completion import Responder

    real, sizes = Responder.waiting_events, []

    async def one_at_a_time(jobs):  # the reference: a write per event
        return [await jobs[0].events.get()]

    async def lagging(jobs):
        for _ in range(200):
            if jobs[0].events.qsize() >= 3 or all(j.cancelled.is_set() for j in jobs):
                break
            await asyncio.sleep(0.01)
        batch = await real(jobs)
        sizes.append(len(batch))
        return batch

    def streamed() -> str:
        request = {"model": "tiny", "max_tokens": 24, "temperature": 0, "stream": True, **body}
        r = httpx.post(f"{spec_server.url}/v1/{path}", json=request, timeout=60)
        assert r.status_code == 200
        return r.text

    monkeypatch.setattr(Responder, "waiting_events", staticmethod(one_at_a_time))
    reference = streamed()
    monkeypatch.setattr(Responder, "waiting_events", staticmethod(lagging))
    coalesced = streamed()
    assert max(sizes) > 1
    assert sse_events(coalesced) == sse_events(reference)
    assert len(sse_events(reference)) > 4


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_slot(plain_server, monkeypatch, stream):
    # The long generation waits (gate) until the server has seen its client go; then it must be closed, not run on
    # to its 400 tokens, and the one slot (slots=1) serves the next request.
    headers = {"Authorization": f"Bearer {API_KEY}"}
    gate, cancelled = gate_generations(monkeypatch), watch_cancel(monkeypatch, plain_server)
    before = metrics_of(plain_server, headers)
    body = {"messages": CHAT, "max_tokens": 400, "temperature": 0, "stream": stream}
    if stream:
        with httpx.Client(timeout=30, headers=headers) as http:
            with http.stream("POST", f"{plain_server.url}/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(4)]  # role chunk, a blank, the first token's chunk, a blank
                assert got[0].startswith("data: ")
    else:  # a raw socket, closed while the server still generates the whole answer
        with socket.create_connection(("127.0.0.1", int(plain_server.url.rsplit(":", 1)[1]))) as sock:
            payload = json.dumps(body).encode()
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                         + payload)
            wait_for(lambda: health(plain_server)["active"] == 1, "the generation to start")
    wait_for(cancelled.is_set, "the server to cancel the job of the client that left")
    gate.set()
    wait_for(lambda: health(plain_server).items() >= {"status": "ok", "queue_depth": 0, "active": 0}.items(),
             "the slot to free")
    with httpx.Client(timeout=30, headers=headers) as http:
        r = http.post(f"{plain_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
        short = r.json()["usage"]["completion_tokens"]
    after = metrics_of(plain_server, headers)
    assert metric(after, "tandem_cancelled_generations_total") == metric(before,
                                                                         "tandem_cancelled_generations_total") + 1
    # Only the short request's tokens were counted: the cancelled generation never finished.
    generated = "tandem_generated_tokens_total"
    assert metric(after, generated) == metric(before, generated) + short


def test_queue_full_gives_503_with_retry_after(paths):
    app = create_app(load(paths[0]), None, engine=EngineConfig(slots=1), server=ServerConfig(max_queue=2))
    with LiveServer(app) as server:
        body = {"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0}

        def post(_):
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

        with ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(post, range(12)))
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(200) >= 3 and statuses.count(503) >= 1, statuses
        for r in responses:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1"
                assert assert_openai_error(r, 503)["code"] == "queue_full"
        assert post(0).status_code == 200


# --- bad input -----------------------------------------------------------------------------------------------

def test_api_key(plain_server):
    url = f"{plain_server.url}/v1/chat/completions"
    body = {"messages": CHAT, "max_tokens": 2}
    assert_openai_error(httpx.post(url, json=body), 401)
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
    assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        plain_server.client(api_key="wrong").models.list()
    assert plain_server.client(api_key=API_KEY).models.list().data[0].id == "tiny"
    for path in ("/health", "/metrics"):  # open: probes, routers and scrapers carry no key
        assert httpx.get(f"{plain_server.url}{path}").status_code == 200
    assert_openai_error(httpx.get(f"{plain_server.url}/openapi.json"), 401)  # the rest needs it, in either header
    for headers in ({"Authorization": f"Bearer {API_KEY}"}, {"x-api-key": API_KEY}):
        assert httpx.get(f"{plain_server.url}/openapi.json", headers=headers).status_code == 200


def chat_body(**fields) -> dict:
    return {"messages": CHAT, "max_tokens": 4, **fields}


BAD_INPUTS = [  # (path, body: dict or raw bytes, status, param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"\xff\xfe\x00", 400, None),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", chat_body(temperature=2.5), 400, "temperature"),
    ("/v1/chat/completions", chat_body(temperature=-1), 400, "temperature"),
    ("/v1/chat/completions", chat_body(temperature="hot"), 400, "temperature"),
    ("/v1/chat/completions", chat_body(top_p=0), 400, "top_p"),
    ("/v1/chat/completions", chat_body(top_p=1.5), 400, "top_p"),
    ("/v1/chat/completions", chat_body(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(max_tokens=-5), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(max_tokens="10"), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("/v1/chat/completions", chat_body(top_k=-1), 400, "top_k"),
    ("/v1/chat/completions", chat_body(min_p=2), 400, "min_p"),
    ("/v1/chat/completions", chat_body(stream="yes"), 400, "stream"),
    ("/v1/chat/completions", chat_body(n=17), 400, "n"),
    ("/v1/chat/completions", chat_body(n=0), 400, "n"),
    ("/v1/chat/completions", chat_body(max_tokens=8.5), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("/v1/chat/completions", chat_body(stop=[1]), 400, "stop[0]"),
    ("/v1/chat/completions", chat_body(seed=2**70), 400, "seed"),
    ("/v1/chat/completions", chat_body(speculative={"draft_max": -1}), 400, "speculative.draft_max"),
    ("/v1/chat/completions", chat_body(model="gpt-4"), 404, "model"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
]


def test_bad_inputs_then_a_good_request(spec_server):
    with httpx.Client(base_url=spec_server.url, timeout=30) as http:
        for path, body, status, param in BAD_INPUTS:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert_openai_error(r, status, param)
        assert_openai_error(http.get("/no/such/route"), 404)
        assert_openai_error(http.delete("/v1/chat/completions"), 405)
        ok = http.post("/v1/chat/completions", json=chat_body(temperature=0))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_prompt_longer_than_context_says_by_how_much(spec_server):
    n_ctx = spec_server.server.config.app.state.server.target.n_ctx
    r = httpx.post(f"{spec_server.url}/v1/completions", json={"prompt": [1] * (n_ctx + 9), "max_tokens": 4})
    error = assert_openai_error(r, 400, "prompt")
    assert error["code"] == "context_length_exceeded" and "10 tokens too many" in error["message"]
    # max_tokens beyond the room left is clamped: the generation stops with "length" at the context's end.
    r = httpx.post(f"{spec_server.url}/v1/completions",
                   json={"prompt": [1] * (n_ctx - 3), "max_tokens": 100, "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_body_size_limit(paths):
    app = create_app(load(paths[0]), None, engine=EngineConfig(slots=1), server=ServerConfig(max_body_bytes=1000))
    with LiveServer(app) as server:
        big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
        assert_openai_error(httpx.post(f"{server.url}/v1/completions", content=big), 413)

        def chunked():  # no Content-Length: the limit must hold on the streamed body too
            for _ in range(10):
                yield b" " * 500

        r = httpx.post(f"{server.url}/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
        assert_openai_error(r, 413)
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_metrics_count_each_request(spec_server):
    # Every series exists from start-up, so each is checked by how much one request moves it.
    client = spec_server.client()
    before = metrics_of(spec_server)
    response = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    after = metrics_of(spec_server)
    timings, usage = response.model_extra["timings"], response.usage
    assert_speculated(timings)
    moved = {
        'tandem_requests_total{endpoint="/v1/chat/completions",status="200"}': 1,
        "tandem_prompt_tokens_total": usage.prompt_tokens,
        "tandem_generated_tokens_total": usage.completion_tokens,
        "tandem_draft_tokens_total": timings["draft_n"],
        "tandem_draft_accepted_tokens_total": timings["draft_n_accepted"],
        "tandem_request_acceptance_rate_count": 1,
        "tandem_request_draft_ms_count": 1,
        "tandem_request_verify_ms_count": 1,
        "tandem_request_prefill_ms_count": 1,
    }
    for name, delta in moved.items():
        assert metric(after, name) - metric(before, name) == delta, name
    assert metric(after, "tandem_request_draft_ms_sum") - metric(before, "tandem_request_draft_ms_sum") == (
        pytest.approx(timings["draft_ms"]))
    assert metric(after, "tandem_queue_depth") == metric(after, "tandem_active_requests") == 0
    # What load-aware gateways read, under vLLM's names (llm-d's model-server protocol).
    for line in ('vllm:num_requests_waiting{model_name="tiny"} 0.0', 'vllm:num_requests_running{model_name="tiny"} 0.0',
                 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.0', "tandem_kv_cache_usage_ratio 0.0"):
        assert line in httpx.get(f"{spec_server.url}/metrics").text.splitlines(), line


ENGINE_PARTS = ("admit", "plan", "draft", "forward", "read", "draft_prefill", "bookkeeping")


def part(text: str, name: str, which: str, suffix: str) -> float:
    return metric(text, f'{name}_{suffix}{{part="{which}"}}')


def test_step_parts_move_with_each_step(paths, caplog):
    """Where served steps' time goes: every engine step the worker runs counts once in the step wall time and once in
    each engine part (the parts lie within it), each step after the first of a busy stretch once between steps, the
    draft's prompt chunks in their counter; the log sums them up at shutdown."""
    import logging

    app = create_app(load(paths[0]), load(paths[1]), engine=EngineConfig(draft_max=4, draft_policy="fixed", slots=2),
                     server=ServerConfig(model_name="tiny"))
    with caplog.at_level(logging.INFO, logger="tandem.server"), LiveServer(app) as server:
        before = metrics_of(server)
        server.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
        after = metrics_of(server)
    moved = {name: metric(after, name) - metric(before, name) for name in (
        "tandem_engine_step_seconds_count", "tandem_engine_step_seconds_sum", "tandem_draft_prefill_chunks_total")}
    steps = moved["tandem_engine_step_seconds_count"]
    assert steps >= 2 and moved["tandem_draft_prefill_chunks_total"] == 1
    parts = {p: part(after, "tandem_step_part_seconds", p, "sum") - part(before, "tandem_step_part_seconds", p, "sum")
             for p in ENGINE_PARTS + ("add", "between", "wait")}
    for p in ENGINE_PARTS:
        assert part(after, "tandem_step_part_seconds", p, "count") - \
            part(before, "tandem_step_part_seconds", p, "count") == steps, p
    for p in ("add", "between", "wait"):  # the first step followed an idle worker: no gap of a step's
        assert part(after, "tandem_step_part_seconds", p, "count") - \
            part(before, "tandem_step_part_seconds", p, "count") == steps - 1, p
    assert all(s >= 0.0 for s in parts.values()) and parts["forward"] + parts["read"] > 0.0
    assert parts["draft_prefill"] > 0.0 and parts["between"] > 0.0
    cpu = "tandem_engine_step_cpu_seconds_count"
    assert metric(after, cpu) - metric(before, cpu) == steps
    assert sum(parts[p] for p in ENGINE_PARTS) <= moved["tandem_engine_step_seconds_sum"]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("steps served: ")]
    assert len(logged) == 1 and "draft prefills: " in logged[0] and "between" in logged[0]


def test_step_clock_parts_sum_to_the_step():
    """StepClock's engine parts partition a step (admission to bookkeeping), also where a lone sequence's drafts were
    timed on the device, past the host's queuing of the forward."""
    from tandem.engine.generation import StepTimes
    from tandem.server.metrics import StepClock

    clock = StepClock()
    clock.engine_step(StepTimes(1.0, admitting=0.5, planned=2.0, drafted=3.0, forwarded=4.5, finished=6.0,
                                prefilled=8.0, ended=8.5, draft_prefills=2))
    clock.engine_step(StepTimes(11.0, admitting=10.0, planned=12.0, drafted=14.0, forwarded=13.0, finished=15.0,
                                prefilled=15.0, ended=16.0))
    assert clock.seconds == {"admit": 1.5, "plan": 2.0, "draft": 3.0, "forward": 1.5, "read": 2.5,
                             "draft_prefill": 2.0, "bookkeeping": 1.5, "add": 0.0, "between": 0.0,
                             "wait": 0.0}
    assert clock.draft_prefills == 2 and clock.counts["plan"] == 2
    clock.stepped((0.0, 0.0), (1.0, 0.5))
    clock.added(0.25)
    clock.stepped((2.0, 1.0), (3.0, 1.5))  # 1 s between the steps: a quarter adding a job, a quarter else at work
    clock.paused()
    clock.stepped((10.0, 2.0), (11.0, 3.0))  # after a pause: no gap of a step's
    assert (clock.steps, clock.step_seconds, clock.step_cpu_seconds) == (3, 3.0, 2.0)
    assert [clock.seconds[p] for p in ("add", "between", "wait")] == [0.25, 0.25, 0.5]
    assert clock.counts["between"] == clock.counts["wait"] == 1


def test_kv_usage_is_the_slots_running_sequences_hold(paths):
    """Slots are reserved whole (a context each): KV usage is the fraction of slots running sequences hold, what
    admission waits on, until they finish or are cancelled."""
    from tandem.engine import Request
    from tandem.server.state import Server

    server = Server(EngineConfig(slots=2, draft_max=4, draft_policy="fixed"), ServerConfig(max_queue=4), "tiny")
    server.attach(load(paths[0]), None)
    engine = server.engine
    assert server.kv_usage() == 0.0
    first = engine.add(Request([1, 2, 3], max_tokens=5))
    second = engine.add(Request([4, 5, 6], max_tokens=50))
    assert server.kv_usage() == 0.0  # queued, not admitted: nothing held yet
    engine.step()
    assert server.kv_usage() == 1.0
    while first.finish_reason is None:
        engine.step()
    assert server.kv_usage() == 0.5
    engine.cancel(second)
    engine.step()
    assert server.kv_usage() == 0.0


def test_the_engine_may_supply_kv_usage(paths):
    """Another measure of KV usage can be given to the app: the gauges export it."""
    app = create_app(load(paths[0]), None, kv_usage=lambda: 0.25, engine=EngineConfig(slots=1),
                     server=ServerConfig(model_name="tiny"))
    with LiveServer(app) as server:
        text = httpx.get(f"{server.url}/metrics").text.splitlines()
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.25' in text and "tandem_kv_cache_usage_ratio 0.25" in text


def test_health_is_503_until_loaded_and_warm(paths):
    """/health: 503 "loading", then 503 "warming", then 200 "ok"; generations wait for "ok" (503 + Retry-After)."""
    release_load, release_warm = threading.Event(), threading.Event()

    def load_models():
        assert release_load.wait(60)
        return load(paths[0]), None

    def warm_up(engine):
        assert engine.target.n_ctx > 0 and engine.draft_model is None
        assert release_warm.wait(60)

    app = create_app(load=load_models, warm_up=warm_up, engine=EngineConfig(slots=1),
                     server=ServerConfig(model_name="tiny"))
    with LiveServer(app) as server:
        def health() -> tuple[int, str]:
            r = httpx.get(f"{server.url}/health")
            return r.status_code, r.json()["status"]

        assert health() == (503, "loading")
        for path in ("/v1/models", "/v1/completions"):
            r = httpx.request("GET" if path == "/v1/models" else "POST", server.url + path,
                              json={"prompt": "hi", "max_tokens": 1})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "not_ready"
        release_load.set()
        assert wait_value(lambda: (h := health()) != (503, "loading") and h) == (503, "warming")
        release_warm.set()
        assert wait_value(lambda: health()[0] == 200) and health() == (200, "ok")
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_a_failed_load_stays_503(paths):
    def load_models():
        raise ValueError("bad.gguf: truncated")

    failures = []
    app = create_app(load=load_models, engine=EngineConfig(slots=1), server=ServerConfig(model_name="tiny"))
    app.state.server.on_load_error = failures.append
    with LiveServer(app) as server:
        assert wait_value(lambda: failures)
        r = httpx.get(f"{server.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert str(failures[0]) == "bad.gguf: truncated"


def test_accept_any_model(paths):
    app = create_app(load(paths[0]), None, engine=EngineConfig(slots=1),
                     server=ServerConfig(model_name="tiny", accept_any_model=True))
    with LiveServer(app) as server:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "no-such-model", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "tiny"  # the response says which model answered


def wait_value(condition, timeout: float = 60.0):
    """Poll `condition` until it returns something truthy (returned); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
    return value


def test_unexpected_errors_are_generic_500s_and_the_server_survives(paths, monkeypatch):
    from tandem.engine import Engine

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    app = create_app(load(paths[0]), None, engine=EngineConfig(slots=1))
    with LiveServer(app) as server:
        monkeypatch.setattr(Engine, "step", broken)  # a step fails: the batch's requests fail, the server lives
        for stream in (False, True):
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": stream})
            text = r.text
            assert "secret" not in text and "Traceback" not in text
            if stream:  # headers were sent already: the error arrives as an event, then [DONE]
                assert r.status_code == 200 and '"type":"server_error"' in text and text.endswith("data: [DONE]\n\n")
            else:
                assert assert_openai_error(r, 500)["message"] == "internal server error"
        monkeypatch.undo()
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_second_turn_reports_reused_prompt_tokens_and_batched_streams_match(paths):
    """A conversation's next turn reuses the KV of the first (OpenAI's cached_tokens, llama-server's cache_n), with
    the text a fresh computation gives; concurrent requests share the batch and each gets its text alone."""
    target = load(paths[0])
    app = create_app(target, load(paths[1]), engine=EngineConfig(slots=4, draft_policy="fixed", draft_max=3),
                     server=ServerConfig(model_name="tiny"))
    with LiveServer(app) as server:
        client = server.client()
        first = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        turn2 = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "Now in one line."}]
        second = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=12, temperature=0)
        first_prompt = len(target.tokenizer.encode_chat(CHAT))
        assert second.usage.prompt_tokens_details.cached_tokens >= first_prompt
        assert second.model_extra["timings"]["cache_n"] == second.usage.prompt_tokens_details.cached_tokens
        assert second.choices[0].message.content == tandem.generate(target, messages=turn2, max_tokens=12).text
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=16,
                                                                      temperature=0).choices[0].text, PROMPTS))
        assert texts == [tandem.generate(target, prompt=p, max_tokens=16).text for p in PROMPTS]
        metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(f"{server.url}/metrics").text
                   .splitlines() if line and not line.startswith("#")}
        assert metrics["vllm:prefix_cache_hits_total"] >= first_prompt
        assert metrics["tandem_batch_size_count"] > 0 and metrics["tandem_batch_size_sum"] > metrics[
            "tandem_batch_size_count"]  # some steps ran more than one sequence


def test_logprobs_chat_and_completions_streamed_and_not(spec_server, paths):
    """The target's raw log-probabilities for every returned token (drafted ones included), with alternatives;
    a stream carries the same as the whole response."""
    target = load(paths[0])
    client = spec_server.client()
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0, logprobs=True,
                                           top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    ids = target.tokenizer.encode_chat(CHAT)
    generated = tandem.generate(target, messages=CHAT, max_tokens=10).tokens
    expected = torch.log_softmax(target.logits(ids + generated[:-1])[len(ids) - 1 :], dim=-1)
    for i, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(expected[i, generated[i]]), abs=1e-6)
        assert entry.token == target.tokenizer.decode([generated[i]]) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy: the top one
    streamed = [e for c in client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                                          logprobs=True, top_logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 9)) for e in streamed] == [(e.token, round(e.logprob, 9)) for e in content]
    text = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == text.usage.completion_tokens
    assert "".join(lp.tokens) == text.choices[0].text and lp.text_offset[0] == 0
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # a dict: pieces that decode alike merge
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None
    with httpx.Client(base_url=spec_server.url) as http:
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "top_logprobs": 2})
        assert_openai_error(r, 400, "top_logprobs")
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "logprobs": True, "top_logprobs": 21})
        assert_openai_error(r, 400, "top_logprobs")


def test_a_request_without_max_tokens_runs_to_the_end_of_the_context(spec_server):
    # OpenAI's rule: no max_tokens means until the context is full. The room left (300) is past any usual default
    # (16 for completions, tandem.generate's 256), so a default would show.
    n_ctx = spec_server.server.config.app.state.server.target.n_ctx
    ids = [(i * 37) % 200 + 1 for i in range(n_ctx - 300)]
    r = httpx.post(f"{spec_server.url}/v1/completions", json={"prompt": ids, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 300
    assert_speculated(body["timings"])


def test_serve_draft_max_caps_a_requests_draft_max(paths, monkeypatch):
    # `tandem serve --draft-max 2`: a request asking for 8-token drafts gets at most 2 a verify.
    import tandem.server.serve as serve_module
    from tandem.cli import main

    apps = []  # the app `tandem serve` built, served here instead of by serve()'s own uvicorn server
    monkeypatch.setattr(serve_module.DrainingServer, "run", lambda self, **kw: apps.append(self.config.app))
    monkeypatch.setattr(serve_module.signal, "signal", lambda *args: None)
    assert main(["serve", "--model", paths[0], "--draft", paths[1], "--backend", "torch", "--draft-max", "2",
                 "--draft-policy", "fixed", "--port", "0"]) == 0
    with LiveServer(apps[0]) as server:
        wait_for(lambda: health(server)["status"] == "ok", "the models to load")
        client = server.client()
        for asked, cap in ((8, 2), (1, 1)):
            response = client.completions.create(model=paths[0], prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                                 extra_body={"speculative": {"draft_max": asked}})
            timings = response.model_extra["timings"]
            assert_speculated(timings)
            # Fixed k drafts `cap` tokens every iteration but the last few (capped by the tokens left to emit).
            assert timings["iterations"] * (cap - 1) < timings["draft_n"] <= timings["iterations"] * cap, timings


def test_shutdown_fails_queued_and_running_jobs_with_503(paths, monkeypatch):
    gate = gate_generations(monkeypatch)
    app = create_app(load(paths[0]), None, engine=EngineConfig(slots=1), server=ServerConfig(max_queue=4))
    scheduler = app.state.server.scheduler
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    with LiveServer(app) as server, ThreadPoolExecutor(2) as pool:
        def post():
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

        running = pool.submit(post)
        wait_for(lambda: health(server)["active"] == 1, "the first job to take the slot")
        queued = pool.submit(post)
        wait_for(lambda: health(server)["queue_depth"] == 1, "the second job to queue")
        scheduler.stop(timeout=0)  # what the app's lifespan does at shutdown, without waiting for the worker
        refused = post()
        gate.set()
        for r in (running.result(), queued.result(), refused):
            assert assert_openai_error(r, 503)["code"] == "shutting_down"
        assert refused.headers["retry-after"] == "1"
