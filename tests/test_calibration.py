"""A server's costs at start-up (tandem.engine.cost_store: the Calibrator and the kept costs):
kept from an earlier start, else estimated in seconds; measured in full while the server is idle; never read for a
changed file. Counted in timed forwards, not seconds."""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import assert_speculated
from test_server import LiveServer, wait_for

import tandem
from tandem.config import EngineConfig, ServerConfig
from tandem.engine import calibration, cost_store
from tandem.server.app import create_app
from tandem.server.state import Server

SLOTS = 2
DRAFT_MAX = 3
TIMING_S = 0.02  # cheap_draft: what each timing takes besides its forwards, so that requests meet the measurement


@pytest.fixture
def files(tiny_model_path, tmp_path):
    """A target and a draft of its weights (Q4_0), copied where a test may change them."""
    paths = []
    for name, path in (("target", tiny_model_path(seed=0)), ("draft", tiny_model_path(qtype="Q4_0", seed=0))):
        paths.append(str(tmp_path / f"{name}.gguf"))
        shutil.copyfile(path, paths[-1])
    return paths


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """The forwards timed (calibration._timed calls), costs kept in tmp_path/costs, a quiet machine (busy[0])."""
    monkeypatch.setenv(cost_store.COSTS_DIR_ENV, str(tmp_path / "costs"))
    busy = [False]
    monkeypatch.setattr(cost_store, "machine_busy", lambda *a: busy[0])
    calls = []
    time_one = calibration._timed
    monkeypatch.setattr(calibration, "_timed", lambda *a, **kw: calls.append(a[2]) or time_one(*a, **kw))
    return calls, busy


@pytest.fixture
def cheap_draft(monkeypatch, timed):
    """As `timed`, each forward run as timed, but its time read as a GPU's where the draft is all but free (the
    planner learning nothing from the loop: conftest.cheap_drafting), so the adaptive policy drafts."""
    time_one = calibration._timed
    target_models = []

    def time_as_cheap(cache, *a, **kw):
        time_one(cache, *a, **kw)
        time.sleep(TIMING_S)
        return 1.0 if cache.model in target_models else 0.01

    monkeypatch.setattr(calibration, "_timed", time_as_cheap)
    for name in ("observe_draft", "observe_iteration", "observe_yield"):
        monkeypatch.setattr(calibration.BatchCosts, name, lambda self, *args: None)
    return timed, target_models


def start(files: list[str]) -> Server:
    """A server's start on new models of the files (a new process, as far as the costs go)."""
    server = Server(EngineConfig(slots=SLOTS, draft_max=DRAFT_MAX), ServerConfig(max_queue=8), "tiny")
    server.attach(tandem.load(files[0], dtype="float64"), tandem.load(files[1], dtype="float64"))
    return server


def refine(server: Server) -> int:
    """Run the calibrator's idle work to its end (or to a wait for a quiet machine); the steps it took."""
    steps = 0
    while server.calibrator.step() == 0.0:
        steps += 1
    return steps


def test_a_restart_on_kept_costs_times_nothing(files, timed):
    calls, _ = timed
    first = start(files)
    estimated = len(calls)
    # 3 target sizes, the draft's step and a catch-up, ESTIMATE_RUNS each: a second or two, not the full measurement
    assert first.calibrator.source == "estimate" and estimated == 5 * calibration.ESTIMATE_RUNS
    assert first.engine.costs is not None and first.calibrator.pending
    assert refine(first) > 1 and len(calls) > 2 * estimated
    assert first.calibrator.source == "measured" and not first.calibrator.pending
    assert first.calibrator.step() is None  # nothing left to do
    measured = first.engine.costs.measured()
    calls.clear()
    again = start(files)
    assert calls == [] and again.calibrator.source == "kept" and again.calibrator.step() is None and calls == []
    assert again.engine.costs.measured() == measured


def test_an_estimate_kept_at_a_start_is_used_and_measured_on(files, timed):
    """A server stopped before its costs were measured in full starts on its estimate, and measures on."""
    calls, _ = timed
    start(files)
    calls.clear()
    again = start(files)
    assert calls == [] and again.calibrator.source == "estimate (kept)" and again.calibrator.pending
    assert refine(again) > 1 and again.calibrator.source == "measured"


def test_a_changed_model_file_is_measured_again_never_read_stale(files, timed, tmp_path):
    calls, _ = timed
    first = start(files)
    refine(first)
    kept = os.listdir(tmp_path / "costs")
    with open(files[1], "r+b") as f:  # the draft file changes (its size and time, here: a byte appended)
        f.seek(0, os.SEEK_END)
        f.write(b"\0")
    calls.clear()
    again = start(files)
    assert again.calibrator.source == "estimate" and calls  # timed afresh
    assert len(os.listdir(tmp_path / "costs")) == len(kept) + 1
    # A kept file for other files, found under this pair's name (a reused name, a copied home), is not read either.
    old, new = (str(tmp_path / "costs" / name) for name in (kept[0], again.calibrator.path))
    shutil.copyfile(old, new)
    assert cost_store.read_kept(new, calibration.BatchCosts.from_measured, again.engine.target,
                               again.engine.draft_model) is None


def test_costs_measured_on_a_busy_machine_wait_for_a_quiet_one(files, timed):
    calls, busy = timed
    busy[0] = True
    first = start(files)
    assert first.calibrator.source == "estimate"
    refine(first)  # an estimate is measured in full even while busy ...
    assert first.calibrator.source == "measured (busy machine)" and first.calibrator.pending
    calls.clear()
    assert first.calibrator.step() == cost_store.REMEASURE_WAIT_S and calls == []  # ... then waits for quiet
    again = start(files)
    assert calls == [] and again.calibrator.source == "kept (busy machine)"
    assert again.calibrator.step() == cost_store.REMEASURE_WAIT_S and calls == []
    assert again.calibrator.progress() == {"source": "kept (busy machine)", "measuring": "waiting for a quiet machine"}
    busy[0] = False
    assert refine(again) > 1 and again.calibrator.source == "measured" and not again.calibrator.pending
    calls.clear()
    assert start(files).calibrator.source == "kept" and calls == []


def test_the_server_answers_on_an_estimate_and_measures_between_requests(files, cheap_draft):
    """Requests that arrive while the costs are measured run between two timings (which fill and empty the slots
    they run in), speculatively, and their output is what the target gives alone; the measurement then finishes
    while the server is idle. /health says where it is."""
    (calls, _), target_models = cheap_draft
    target, draft = tandem.load(files[0], dtype="float64"), tandem.load(files[1], dtype="float64")
    target_models.append(target)
    prompts = ["def add(a, b):", "The quick brown fox", "abc abc abc abc"]
    expected = [tandem.generate(target, prompt=p, max_tokens=12).text for p in prompts]
    app = create_app(target, draft, engine=EngineConfig(slots=SLOTS, draft_max=DRAFT_MAX),
                     server=ServerConfig(model_name="tiny"))
    server: Server = app.state.server
    assert server.calibrator.source == "estimate"

    stats, timed_before = [], []  # each reply's timings, and the forwards timed when it came

    def complete(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        reply = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
        stats.append(reply["timings"])
        timed_before.append(len(calls))
        return reply["choices"][0]["text"]

    with LiveServer(app) as live:
        first = httpx.get(f"{live.url}/health")
        assert first.status_code == 200 and first.json()["costs"]["source"] in ("estimate", "measured")
        with ThreadPoolExecutor(3) as pool:
            for _ in range(3):
                assert list(pool.map(complete, prompts)) == expected
        assert_speculated(*stats)
        wait_for(lambda: httpx.get(f"{live.url}/health").json()["costs"] == {"source": "measured"},
                 "the costs to be measured in full")
    assert min(timed_before) < len(calls)  # some requests ran before timings still to come: between them
    kept = json.load(open(server.calibrator.path))
    assert kept["quiet"] is True and kept["estimate"] is False and len(calls) > 10


def test_a_forward_on_fewer_threads_keeps_costs_of_its_own(files, monkeypatch):
    pytest.importorskip("llama_cpp")
    one, two = (tandem.load(files[1], threads=n) for n in (1, 2))
    assert (one.backend, one.n_threads, two.n_threads) == ("llama.cpp", 1, 2)
    assert cost_store.costs_path(one, None, 4) != cost_store.costs_path(two, None, 4)


def test_a_waiting_request_cuts_a_timing_to_the_runs_it_has(files, timed):
    """Each timing runs a warm-up and REPEATS timed forwards; with a request waiting (hurry), one timed forward."""
    def forwards(hurried: bool) -> int:
        server = start(files)
        forward, counted = server.engine.target_kv.forward, []
        server.engine.target_kv.forward = lambda *a, **kw: counted.append(1) or forward(*a, **kw)
        while server.calibrator.step(hurry=lambda: hurried) == 0.0:
            pass
        os.remove(server.calibrator.path)  # the next start estimates and measures again
        return len(counted)

    assert forwards(True) < forwards(False) * 0.7


def test_an_estimate_errs_towards_plain_decoding(monkeypatch):
    """Two timings a size on a busy machine: V(1) read above V(2) once. The estimate keeps V(1)'s least and the
    others' most, and reads the larger batches off the batch-1 line."""
    class Cache:
        slots, capacity = 4, 64

        def forward(self, rows, logits):
            pass

        def rewind(self, slot, length):
            pass

    target, draft = Cache(), Cache()
    readings = {target: {9: [200.0, 260.0], 2: [70.0, 40.0], 1: [80.0, 35.0]}, draft: {1: [9.0, 10.0], 8: [40.0, 48.0]}}
    monkeypatch.setattr(calibration, "_timed", lambda cache, slots, rows, sync, last_only=False:
                        readings[cache][rows].pop(0))
    costs = calibration.estimate(target, draft, 8, lambda: None)
    assert costs.verify[1].verify_ms == {1: 35.0, 2: 70.0, 9: 260.0}
    assert costs.verify[4].verify_ms == {4: costs.verify[1].verify(4), 8: costs.verify[1].verify(8),
                                         36: costs.verify[1].verify(36)}
    assert costs.draft_step == {1: 10.0, 2: 16.0, 4: 28.0} and costs.catch_up_ms_per_token == 6.0


@pytest.mark.no_drafts_expected("prompt reuse across a cost timing: whether the policy drafts on this machine's costs "
                                 "is beside the point")
def test_a_timing_between_turns_keeps_the_conversation(files, timed, monkeypatch):
    """Cost timings run in the free slots used longest ago: a conversation's next turn, after a timing while the
    server was idle, still reuses its prompt (a timing of every slot is the one that overwrites it)."""
    from tandem.engine import Request

    server = Server(EngineConfig(slots=4, draft_max=DRAFT_MAX), ServerConfig(max_queue=8), "tiny")
    target, draft = tandem.load(files[0], dtype="float64"), tandem.load(files[1], dtype="float64")
    server.attach(target, draft)
    engine, tokens = server.engine, target.tokenizer.encode
    turn = tokens("The quick brown fox")
    for _ in range(2):
        first = engine.generate([Request(turn, max_tokens=6)])[0]
        assert server.calibrator.step() == 0.0  # one timing, of one slot: not the conversation's
        turn = turn + first.tokens + tokens(" and then")
        again = engine.generate([Request(turn, max_tokens=6)])[0]
        assert again.stats.cached_tokens >= len(turn) - len(tokens(" and then")) - 1
        turn = turn + again.tokens + tokens(" and then")
    # Negative control: the slots timed most recently used first, the conversation's among them
    monkeypatch.setattr(engine.kv, "scratch_slots", lambda: engine.kv.table.by_age()[::-1])
    server.calibrator.step()
    assert engine.generate([Request(turn, max_tokens=6)])[0].stats.cached_tokens < len(turn) - 4


def test_a_gpu_server_measures_its_costs_before_its_first_request(files, timed, monkeypatch):
    """Off the CPU the whole measurement runs at start (seconds there): a server loaded from its start is never idle
    and would plan from the estimate throughout. On the CPU it starts on the estimate (the test above)."""
    calls, _ = timed
    server = Server(EngineConfig(slots=SLOTS, draft_max=DRAFT_MAX), ServerConfig(max_queue=8), "tiny")
    target, draft = tandem.load(files[0], dtype="float64"), tandem.load(files[1], dtype="float64")
    monkeypatch.setattr(target, "device", "cuda:0")
    server.attach(target, draft)
    assert server.calibrator.source == "measured" and not server.calibrator.pending and len(calls) > 10
