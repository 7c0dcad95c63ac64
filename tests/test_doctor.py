"""`tandem doctor` on tiny models: the JSON contract, and the flags and verdict on made-up pathological numbers."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tandem.bench.doctor import break_even_acceptance, diagnose, make_verdict
from tandem.cli import main
from tandem.engine.costs import CostModel

KEYS = {"draft_step_ms_standalone", "draft_step_ms_target_idle", "draft_step_ms_paired", "paired_over_standalone",
        "target_step_ms", "verify_ms",
        "best_draft_len", "predicted_speedup", "flags", "verdict", "device", "backend", "break_even_acceptance",
        "draft_cost_ratio"}


def doctor_json(capsys, *args: str) -> dict:
    assert main(["doctor", "--json", "--repeats", "2", *args]) == 0
    return json.loads(capsys.readouterr().out)


def check_contract(d: dict) -> None:
    assert KEYS <= set(d), KEYS - set(d)
    assert set(d["verify_ms"]) == {str(n) for n in range(1, 17)}
    assert all(v > 0 for v in d["verify_ms"].values())
    assert d["target_step_ms"] == d["verify_ms"]["1"]
    assert set(d["best_draft_len"]) == set(d["predicted_speedup"]) == {"0.5", "0.7", "0.9"}
    assert all(isinstance(k, int) and 0 <= k <= 15 for k in d["best_draft_len"].values())
    assert d["draft_step_ms_standalone"] > 0 and d["draft_step_ms_paired"] > 0 and d["draft_step_ms_target_idle"] > 0
    assert d["paired_over_standalone"] == pytest.approx(d["draft_step_ms_paired"] / d["draft_step_ms_standalone"])
    assert isinstance(d["flags"], list) and all(isinstance(f, str) for f in d["flags"])
    assert isinstance(d["verdict"], str) and d["verdict"]
    # The batched engine's costs (--slots, default 4): B = 1, 2, 4 sequences, 1 / 2 / k+1 rows each
    assert set(d["batched"]) == {"1", "2", "4"}
    for b, row in d["batched"].items():
        assert {int(n) for n in row["verify_ms"]} >= {int(b), 2 * int(b)}
        assert all(ms > 0 for ms in row["verify_ms"].values()) and row["draft_step_ms"] > 0
        assert row["switch_ms"] >= 0
        assert row["ahead_ms"] is None and row["feeds_ahead"] is False  # a CPU runs no feed beside the verify
        assert set(row["draft_len"]) == set(row["predicted_speedup"]) == {"0.5", "0.7", "0.9"}
        assert all(s > 0 for s in row["predicted_speedup"].values())


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_doctor_json(capsys, tiny_model_path, backend):
    if backend == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    d = doctor_json(capsys, "--model", tiny_model_path(seed=0), "--draft", tiny_model_path(seed=0, qtype="Q8_0"),
                    "--backend", backend)
    check_contract(d)
    assert d["backend"] == backend and d["device"] == "cpu"
    assert d["synthetic"] is False


def test_doctor_synthetic_and_text(capsys):
    d = doctor_json(capsys, "--synthetic-shape", "tiny,tiny-draft")
    check_contract(d)
    assert d["synthetic"] is True and d["shapes"] == {"target": "tiny", "draft": "tiny-draft"}
    assert main(["doctor", "--repeats", "1", "--synthetic-shape", "tiny,tiny-draft"]) == 0
    text = capsys.readouterr().out
    assert "SYNTHETIC" in text and "target step" in text and "batched" in text and "B=4" in text


def test_the_batched_lines_say_whether_the_last_drafts_go_beside_the_verify():
    from tandem.bench.doctor import format_batched

    row = {"verify_ms": {1: 10.0, 4: 14.0}, "draft_step_ms": 2.0, "switch_ms": 3.0, "draft_len": {0.8: 3},
           "predicted_speedup": {0.8: 1.5}}
    rows = {1: {**row, "ahead_ms": 0.7, "feeds_ahead": True}, 2: {**row, "ahead_ms": 1.9, "feeds_ahead": False},
            4: {**row, "ahead_ms": None, "feeds_ahead": False}}
    lines = format_batched(rows)
    assert "beside the verify +0.70 ms (fed)" in lines[2] and "+1.90 ms (not fed" in lines[3]
    assert "beside" not in lines[4] and "draft step 2.00 ms; a=0.8: k=3 1.50x" in lines[4]


def test_flags_on_pathological_numbers():
    # The report's case: the draft slowed down next to the target, a 9-token verify costs 6 steps, draft is 0.68.
    verify = {n: 10.0 + 6.25 * (n - 1) for n in range(1, 17)}
    flags = diagnose(paired_over_standalone=3.0, verify_ms=verify, draft_cost_ratio=0.68, weight_bytes_ratio=0.3)
    assert len(flags) == 3
    assert flags[0].startswith("the draft slows down when the target shares the device")
    assert flags[1].startswith("compute-bound: a verify of 9 tokens costs 6.0 plain steps")
    assert flags[2].startswith("draft is launch/overhead-bound") and "0.30" in flags[2]


def test_the_pairing_flag_tells_the_targets_presence_from_its_forwards():
    verify = {n: 10.0 + 0.1 * (n - 1) for n in range(1, 17)}
    (memory,) = diagnose(paired_over_standalone=1.6, verify_ms=verify, draft_cost_ratio=0.1, idle_over_standalone=1.5)
    (forwards,) = diagnose(paired_over_standalone=1.6, verify_ms=verify, draft_cost_ratio=0.1,
                           idle_over_standalone=1.02)
    (unknown,) = diagnose(paired_over_standalone=1.6, verify_ms=verify, draft_cost_ratio=0.1)
    assert "1.50x with the target loaded and idle, so its presence costs" in memory and "memory" in memory
    assert "1.02x with the target loaded and idle, so its forwards cost" in forwards and "host" in forwards
    assert "queue sharing" in unknown and "idle" not in unknown
    assert all(f.startswith("the draft slows down when the target shares the device: a draft step costs 1.60x")
               for f in (memory, forwards, unknown))
    # below the flag's threshold nothing is said, whatever the idle figure
    assert diagnose(paired_over_standalone=1.1, verify_ms=verify, draft_cost_ratio=0.1, idle_over_standalone=1.1) == []


def test_no_flags_on_a_healthy_memory_bound_device():
    verify = {n: 10.0 + 0.1 * (n - 1) for n in range(1, 17)}
    assert diagnose(paired_over_standalone=1.02, verify_ms=verify, draft_cost_ratio=0.1) == []
    costs = CostModel(draft_step_ms=1.0, verify_ms=verify)
    even = break_even_acceptance(costs)
    assert even is not None and even < 0.3
    predicted = {a: costs.predicted_speedup(a, 15) for a in (0.5, 0.7, 0.9)}
    assert predicted[0.9] > 3
    assert "helps" in make_verdict(costs, even, predicted, {a: costs.best_draft_len(a, 15) for a in predicted})


def test_verdict_when_speculation_cannot_pay():
    costs = CostModel(draft_step_ms=9.0, verify_ms={n: 10.0 * n for n in range(1, 17)})
    assert break_even_acceptance(costs) is None
    assert "cannot help" in make_verdict(costs, None, {0.5: 1.0, 0.7: 1.0, 0.9: 1.0}, {0.5: 0, 0.7: 0, 0.9: 0})


def test_paired_draft_is_timed_at_the_length_the_policy_would_draft(monkeypatch):
    # A target whose verify cost jumps past 5 tokens (llama.cpp on an H200's Vulkan driver): the loop never drafts
    # 8 there, so the doctor must not time the draft beside 9-token verifies.
    import time

    from test_policy import VirtualClock, fake_model

    from tandem.bench.doctor import measure

    clock = VirtualClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    target = fake_model(clock, lambda n: 2.4 + 0.5 * (n - 1) if n <= 5 else 14.0 + 2.0 * n)
    draft = fake_model(clock, lambda n: 0.3 * n, is_draft=True)
    report = measure(target, draft, standalone_ms=0.3, k=8, repeats=2)
    assert 1 <= report.draft_len_paired <= 4, report.draft_len_paired
    assert report.best_draft_len[0.9] == report.draft_len_paired
    assert report.paired_over_standalone == pytest.approx(1.0)
    assert report.draft_step_ms_target_idle == pytest.approx(0.3)


def test_a_device_slow_in_one_timing_pass_gets_the_faster_figures_and_a_flag(monkeypatch):
    # A target that runs 3x slower until 1.2 s of its work have passed (a device still warming up past the doctor's
    # warm-up): the first pass is slow, the second is not.
    import time

    from test_policy import VirtualClock, fake_model

    from tandem.bench.doctor import measure

    clock = VirtualClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    target = fake_model(clock, lambda n: (2.0 + 0.1 * (n - 1)) * (3.0 if clock.now < 1.2 else 1.0))
    report = measure(target, None, standalone_ms=None, k=3, repeats=2)
    assert report.target_step_ms == pytest.approx(2.0)
    assert report.verify_ms[16] == pytest.approx(3.5)
    assert any(flag.startswith("timings drifted") for flag in report.flags), report.flags

    steady = fake_model(clock, lambda n: 2.0 + 0.1 * (n - 1))
    report = measure(steady, None, standalone_ms=None, k=3, repeats=2)
    assert not any(flag.startswith("timings drifted") for flag in report.flags), report.flags
