"""A start's progress (tandem.loading.progress): the loaders' steps reach the server's log and /health's stage."""

from __future__ import annotations

import logging
import os
import threading

import tandem
from tandem.config import EngineConfig, ServerConfig
from tandem.loading import progress
from tandem.loading.gguf import dequantiser, open_gguf
from tandem.loading.weights import expected_tensors
from tandem.server.state import Server


def _load_reports(path: str) -> list[tuple[str, int | None, int | None]]:
    heard: list[tuple[str, int | None, int | None]] = []
    with progress.listening(lambda *report: heard.append(report)):
        tandem.load(path, backend="torch", device="cpu")
    return heard


def test_a_load_reports_each_step_and_how_far(tiny_model_path):
    path = tiny_model_path("qwen2", "Q4_0")
    name = os.path.basename(path)
    heard = _load_reports(path)
    steps = list(dict.fromkeys(what for what, _, _ in heard))
    dequantising = f"dequantising {name} by {dequantiser()}"
    assert steps == [f"reading {name}'s header and vocabulary", dequantising, f"building {name}'s layers"]
    counts = [(done, total) for what, done, total in heard if what == dequantising]
    total = len(expected_tensors(open_gguf(path).config))
    assert counts == [(done, total) for done in range(total + 1)]  # 0/N when it begins, then one a tensor


def test_reports_reach_only_the_listening_thread(tiny_model_path):
    """A server listens on the thread that loads; another thread's load (another server's) is not its news, and
    nobody listening means no output at all."""
    path = tiny_model_path("qwen2", "Q4_0")
    heard: list = []
    with progress.listening(lambda *report: heard.append(report)):
        other = threading.Thread(target=tandem.load, args=(path,), kwargs=dict(backend="torch", device="cpu"))
        other.start()
        other.join()
    assert heard == []
    tandem.load(path, backend="torch", device="cpu")  # no listener: nothing to hear, nothing raised
    assert heard == []


def _server() -> Server:
    return Server(EngineConfig(slots=2), ServerConfig(), "tiny")


def test_a_counted_step_is_one_log_line_and_health_shows_how_far(caplog):
    server = _server()
    with caplog.at_level(logging.INFO, logger="tandem.server"):
        server.set_stage("loading the models")
        for done in range(11):
            server.set_step("dequantising a.gguf", done, 10)
        assert server.health()["stage"] == "loading the models: dequantising a.gguf 10/10"
        server.set_step("building a.gguf's layers")
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" (")[0] for line in lines] == [
        "loading the models", "loading the models: dequantising a.gguf", "loading the models: building a.gguf's layers"]
    assert "the step before took" in lines[-1]
    assert server.health()["stage"] == "loading the models: building a.gguf's layers"
    assert server.health()["stage_s"] >= 0


def test_a_served_start_logs_its_steps(tiny_model_path, caplog):
    """prepare() listens while it loads: the log names the loader's steps and the engine's, in order."""
    path = tiny_model_path("qwen2", "Q4_0")
    name = os.path.basename(path)
    server = _server()
    with caplog.at_level(logging.INFO, logger="tandem.server"):
        server.prepare(lambda: (tandem.load(path, backend="torch", device="cpu"), None), warm_up=None)
    assert server.status == "ready", server.load_error
    steps = [r.getMessage().split(" (")[0] for r in caplog.records]
    wanted = ["loading the models", f"loading the models: reading {name}'s header and vocabulary",
              f"loading the models: dequantising {name} by {dequantiser()}",
              f"loading the models: building {name}'s layers", "making the engine"]
    assert [s for s in steps if s in wanted] == wanted
    assert any(s.startswith("ready after") for s in steps)
