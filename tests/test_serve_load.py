"""bench/serve_load.py end to end on tiny models: a tandem server under load at 1 and 2 clients, its conversation
reusing the chat's prefix, and a server that fails to start reported while the others run; tandem-fixedK's
parsing, command line and place in the table beside plain. No timings asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "serve_load.py")


def load_bench():
    spec = importlib.util.spec_from_file_location("serve_load", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_serve_load_writes_a_row_per_load_and_the_conversation_reuses_its_prefix(tmp_path, tiny_model_path,
                                                                                  monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server subprocess: see conftest's set_num_threads
    target = tiny_model_path(seed=0, context_length=2048)
    draft = tiny_model_path(qtype="Q4_0", seed=0, context_length=2048)
    out = tmp_path / "load.json"
    rc = load_bench().main([
        "--model", target, "--draft", draft, "--configs", "tandem-adaptive,llama-plain", "--clients", "1,2",
        "--max-tokens", "4", "--turns", "3", "--tandem-arg=--backend", "--tandem-arg=torch",
        "--llama-server", "/bin/false", "--json", str(out), "--logs", str(tmp_path / "logs")])
    assert rc == 1  # llama-plain's "server" exits at once: reported, and tandem still measured
    report = json.loads(out.read_text())
    tandem = report["configs"]["tandem-adaptive"]
    assert tandem["errors"] == []
    assert sorted(tandem["loads"]) == ["1", "2"]
    for clients, load in tandem["loads"].items():
        assert load["requests"] == 4 * int(clients) and load["ok"] == load["requests"] and load["failed"] == 0
        assert load["output_tokens_per_s"] > 0
    turns = tandem["conversation"]
    assert len(turns) == 3 and all(t["error"] is None for t in turns)
    reused = [t["cached_tokens"] for t in turns]
    assert reused == [t["cache_n"] for t in turns]  # OpenAI's field and llama-server's agree
    assert reused[1] > reused[0] and reused[2] > reused[1], reused  # each turn reuses the chat before it
    llama = report["configs"]["llama-plain"]
    assert llama["loads"] == {} and len(llama["errors"]) == 2  # one start per load, both failed
    for clients, argv in zip((1, 2), llama["commands"], strict=True):  # -np = clients, a 4096-token context a slot
        assert argv[argv.index("-np") + 1] == str(clients) and argv[argv.index("-c") + 1] == str(4096 * clients)
    assert report["hardware"]


def test_fixed_k_configs_parse_start_with_their_k_and_sit_beside_plain_in_the_table():
    bench = load_bench()
    assert [bench.fixed_k(n) for n in ("tandem-fixed1", "tandem-fixed12", "tandem-fixed0", "tandem-fixedx",
                                       "tandem-fixed", "tandem-adaptive")] == [1, 12, None, None, None, None]
    args = bench.argparse.Namespace(model="t.gguf", draft="d.gguf", device="cpu", tandem_arg=[])
    argv = bench.server_command("tandem-fixed3", args, 8080, 4)
    assert argv[argv.index("--draft") + 1] == "d.gguf"
    assert argv[argv.index("--draft-policy") + 1] == "fixed" and argv[argv.index("--draft-max") + 1] == "3"
    argv = bench.server_command("tandem-adaptive", args, 8080, 4)
    assert argv[argv.index("--draft-policy") + 1] == "adaptive" and "--draft-max" not in argv
    assert "--no-draft" in bench.server_command("tandem-plain", args, 8080, 4)
    assert bench.order(["llama-plain", "tandem-fixed10", "tandem-fixed2", "tandem-adaptive", "tandem-plain"]) == [
        "tandem-plain", "tandem-adaptive", "tandem-fixed2", "tandem-fixed10", "llama-plain"]

    def load(tok_s: float) -> dict:
        return {"ok": 4, "output_tokens_per_s": tok_s, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2,
                "acceptance_rate": 0.5, "draft_n": 8, "mean_completion_tokens": 4.0}

    results = {name: {"loads": {"1": load(v1), "4": load(v4)}}
               for name, v1, v4 in (("tandem-plain", 100, 300), ("tandem-adaptive", 120, 270),
                                    ("tandem-fixed2", 130, 240))}
    lines = bench.table(results, [1, 4]).splitlines()
    head = lines[0].split(" | ")
    assert head[:4] == ["clients", "tandem-plain tok/s", "tandem-adaptive tok/s", "tandem-fixed2 tok/s"]
    assert "adaptive/plain" in head and "fixed2/plain" in head and "adapt/best-llama" not in head  # no llama here
    row4 = dict(zip(head, lines[3].split(" | "), strict=True))
    assert row4["adaptive/plain"] == "0.90" and row4["fixed2/plain"] == "0.80"
    assert "   1 clients: 0.50 (0.50) | 0.50 (0.50)" in lines  # acceptance, drafted a generated token
    goals = {g["goal"]: g for g in bench.goals(results)}
    best = goals["tandem-adaptive >= 0.97x the best of tandem-plain and tandem-fixed2 at 1 clients"]
    assert best["value"] == round(120 / 130, 3) and not best["met"]
    assert goals["tandem-adaptive >= 0.97x the best of tandem-plain and tandem-fixed2 at 4 clients"]["value"] == 0.9


def test_configs_are_checked_before_any_server_starts(capsys):
    bench = load_bench()
    for configs, message in (("tandem-fixed0", "unknown configs"), ("tandem-fixed2", "need --draft")):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--model", "t.gguf", "--configs", configs])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
