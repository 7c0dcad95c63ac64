"""bench/serve_load.py end to end on tiny models: a tandem server under load at 1 and 2 clients, its conversation
reusing the chat's prefix, and a server that fails to start reported while the others run. No timings asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

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
