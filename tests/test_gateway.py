"""Two `tandem serve` replicas behind SGLang Model Gateway (`sglang-router` from PyPI), all on loopback.

The deployment docs/deployment.md describes, with the gateway at its defaults: a burst of requests naming an unknown
model leaves the fleet up (the replicas run with --accept-any-model: the gateway counts every non-2xx answer,
client errors included, against the replica), and a replica killed mid-load loses no request.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_serve import ServeProcess
from test_server import wait_value as wait_for

pytest.importorskip("sglang_router", reason="sglang-router (SGLang Model Gateway) is not installed on this platform")

API_KEY = "sk-fleet"  # checked by the replicas; the gateway passes the client's Authorization header on
UNKNOWN_MODEL_BURST = 50  # the gateway opens a replica's circuit after 10 consecutive failures (its default)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """`python -m sglang_router.launch_router` at its defaults, but on loopback ports of its own."""

    def __init__(self, worker_urls: list[str], log_path: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--host", "127.0.0.1",
             "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})

        def up() -> bool:
            assert self.proc.poll() is None, open(log_path).read()
            try:
                return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def fleet(tiny_model_path, tmp_path_factory):
    """(gateway, [replica, replica]): replicas as a gateway deployment runs them (docs/deployment.md)."""
    model = tiny_model_path(seed=0)
    replicas = [ServeProcess("--model", model, "--no-draft", "--backend", "torch", "--served-model-name", "tiny",
                             "--accept-any-model", "--api-key", API_KEY) for _ in range(2)]
    try:
        for replica in replicas:
            replica.wait_ready()  # the gateway adds workers once their /health answers 200
        gateway = Gateway([r.url for r in replicas], str(tmp_path_factory.mktemp("gateway") / "gateway.log"))
        try:
            yield gateway, replicas
        finally:
            gateway.close()
    finally:
        for replica in replicas:
            replica.__exit__(None, None, None)


def complete(gateway: Gateway, model: str | None = "tiny", max_tokens: int = 4, key: str = API_KEY) -> httpx.Response:
    body = {"prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{gateway.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)


def test_unknown_model_burst_does_not_take_the_fleet_down(fleet):
    gateway, _ = fleet
    burst = [complete(gateway, model=f"no-such-model-{i}") for i in range(UNKNOWN_MODEL_BURST)]
    assert [r.status_code for r in burst] == [200] * UNKNOWN_MODEL_BURST, burst[-1].text
    assert {r.json()["model"] for r in burst} == {"tiny"}  # the answer says which model it came from
    after = [complete(gateway) for _ in range(8)]
    assert [r.status_code for r in after] == [200] * 8, after[-1].text
    assert complete(gateway, key="sk-wrong").status_code == 401  # the replicas check the client's key


def test_metrics_through_each_replica(fleet):
    _, replicas = fleet
    for replica in replicas:
        text = httpx.get(f"{replica.url}/metrics").text
        assert 'vllm:num_requests_waiting{model_name="tiny"}' in text and "vllm:kv_cache_usage_perc" in text


def test_a_replica_killed_mid_load_loses_no_request(fleet):
    """32 concurrent requests; once the first answers are back, the replica taking the traffic is killed (SIGKILL)
    with requests still queued on it. The gateway retries what failed on the other replica: all 32 are answered."""
    gateway, replicas = fleet
    n_requests, kill_after = 32, 4
    before = [completions_answered(r) for r in replicas]  # earlier tests' requests
    with ThreadPoolExecutor(n_requests) as pool:
        futures = [pool.submit(complete, gateway, "tiny", 24) for _ in range(n_requests)]
        wait_for(lambda: sum(f.done() for f in futures) >= kill_after)
        answered = [completions_answered(r) - b for r, b in zip(replicas, before, strict=True)]
        victim = replicas[answered.index(max(answered))]  # the cache-aware policy sends one prompt to one replica
        victim.proc.kill()
        assert sum(answered) < n_requests  # work was left on it
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200] * n_requests, [r.text for r in responses if r.status_code != 200]
    survivor = replicas.index(next(r for r in replicas if r is not victim))
    assert completions_answered(replicas[survivor]) - before[survivor] > answered[survivor]  # it took over
    assert complete(gateway).status_code == 200


def completions_answered(replica: ServeProcess) -> float:
    text = httpx.get(f"{replica.url}/metrics").text
    line = next((x for x in text.splitlines()
                 if x.startswith('tandem_requests_total{endpoint="/v1/completions",status="200"}')), None)
    return float(line.split()[-1]) if line else 0.0
