"""`tandem bench` end to end on tiny models: the JSON contract, the lossless flags, the plot, synthetic runs."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import K_QUANT_SHAPES, assert_speculated, cheap_drafting

from tandem.bench.bench import parse_configs
from tandem.bench.suite import DEFAULT_SUITE, load_suite
from tandem.cli import main

PROMPT_KEYS = {"name", "kind", "prompt_tokens", "primary", "baseline_tps", "spec_tps", "speedup", "acceptance_rate",
               "mean_accepted_len", "draft_ms_per_token", "verify_ms", "lossless", "configs", "peers", "synthetic"}
CONFIG_KEYS = {"config", "tps", "decode_tps", "wall_tps", "wall_s", "speedup", "generated_tokens", "draft_tokens",
               "accepted_tokens", "acceptance_rate", "first_position_acceptance", "mean_accepted_len",
               "draft_ms_per_token", "verify_ms", "k_counts", "lossless", "predicted_speedup"}
META_KEYS = {"device", "device_name", "cpu_model", "cpu_cores", "torch_version", "tandem_commit", "date", "backend",
             "dtype", "target", "draft", "max_tokens", "synthetic_acceptance", "shapes", "weight_bytes"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_bench(tmp_path, *args: str, max_tokens: int = 8) -> dict:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--max-tokens", str(max_tokens), "--json", str(out), "--plot", str(png), *args]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    return json.loads(out.read_text())


def check_contract(result: dict, configs: list[str], max_tokens: int = 8) -> None:
    assert set(result) >= {"synthetic", "meta", "prompts", "summary"}
    assert result["complete"] is True
    assert META_KEYS <= set(result["meta"])
    assert result["prompts"]
    for p in result["prompts"]:
        assert PROMPT_KEYS <= set(p), PROMPT_KEYS - set(p)
        assert list(p["configs"]) == configs
        for c in p["configs"].values():
            assert CONFIG_KEYS <= set(c), CONFIG_KEYS - set(c)
            assert isinstance(c["tps"], float) and c["tps"] > 0
            assert c["generated_tokens"] == max_tokens
        plain_tps = p["configs"]["plain"]["tps"]
        assert p["baseline_tps"] == plain_tps
        assert p["speedup"] == pytest.approx(p["spec_tps"] / p["baseline_tps"])
        for c in p["configs"].values():
            assert c["speedup"] == pytest.approx(c["tps"] / plain_tps)
    assert set(result["summary"]["configs"]) == set(configs)


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_bench_real_files(tmp_path, tiny_model_path, backend, monkeypatch):
    if backend == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    # The adaptive policy on a virtual clock where drafting is all but free: it drafts on acceptance alone, so
    # its "lossless" is about real drafts (a same-size tiny draft never pays on measured costs, and timing on a
    # busy machine must not decide what a test checks).
    from tandem.engine import calibration
    from tandem.engine.costs import CostModel

    cheap_drafting(monkeypatch, tmp_path / "costs")
    monkeypatch.setattr(calibration, "measure_costs", lambda target, draft, k_max: CostModel(  # the predictions'
        draft_step_ms=1e-3, verify_ms={1: 1.0, k_max + 1: 1.0}, catch_up_ms_per_token=1e-3))
    # Quantised weights with 64-wide heads: what llama.cpp computes batch-invariantly (F32/F16 weights are not;
    # see test_llamacpp_backend.py), so greedy drafts of any length are exact on both backends.
    target = tiny_model_path(seed=0, qtype="Q8_0", context_length=2048, **K_QUANT_SHAPES)
    draft = tiny_model_path(seed=0, qtype="Q4_0", context_length=2048, **K_QUANT_SHAPES)
    configs = ["plain", "adaptive", "fixed3", "ngram"]
    result = run_bench(tmp_path, "--model", target, "--draft", draft, "--backend", backend,
                       "--configs", ",".join(configs), "--prompts", "code,code-edit", "--ignore-eos",
                       max_tokens=32)
    check_contract(result, configs, max_tokens=32)
    assert result["synthetic"] is False
    assert result["meta"]["backend"] == backend
    for p in result["prompts"]:
        assert p["configs"]["plain"]["lossless"] is None  # plain is the reference
        for name in ("adaptive", "fixed3", "ngram"):
            assert p["configs"][name]["lossless"] is True, (p["name"], name)
        assert p["configs"]["fixed3"]["predicted_speedup"] > 0
    # "lossless" means something only where speculation ran: drafts proposed, accepted and rejected.
    assert_speculated(*(p["configs"]["fixed3"] for p in result["prompts"]), rejected=True)
    assert_speculated(*(p["configs"]["ngram"] for p in result["prompts"]))
    assert_speculated(*(p["configs"]["adaptive"] for p in result["prompts"]))
    assert result["summary"]["configs"]["fixed3"]["all_lossless"] is True


def test_bench_synthetic_shape_and_acceptance(tmp_path):
    result = run_bench(tmp_path, "--synthetic-shape", "tiny,tiny-draft", "--synthetic-acceptance", "0.8",
                       "--configs", "plain,fixed4", "--prompts", "code,json,summary", "--max-tokens", "48")
    check_contract_synthetic = result["prompts"]
    assert result["synthetic"] is True and result["summary"]["synthetic"] is True
    assert result["meta"]["shapes"] == {"target": "tiny", "draft": "tiny-draft"}
    assert result["meta"]["weight_bytes"]["target"] > result["meta"]["weight_bytes"]["draft"] > 0
    drafted = accepted_first = iterations = 0
    for p in check_contract_synthetic:
        assert p["synthetic"] is True
        assert p["configs"]["fixed4"]["lossless"] is None  # synthetic acceptance is not lossless by design
        assert p["plain_bandwidth_gb_s"] > 0
        c = p["configs"]["fixed4"]
        drafted += c["draft_tokens"]
        n = sum(v for k, v in c["k_counts"].items() if k != "0")
        iterations += n
        accepted_first += c["first_position_acceptance"] * n
        assert c["predicted_speedup"] > 0 and c["fraction_of_prediction"] > 0
    assert drafted > 0
    assert accepted_first / iterations == pytest.approx(0.8, abs=0.15)


def test_a_run_that_dies_leaves_the_prompts_it_finished(tmp_path, monkeypatch):
    from tandem.bench.bench import Bench

    measure, calls = Bench.measure, []

    def dies_on_the_third_prompt(self, prompt, on_run):
        calls.append(prompt.name)
        if len(calls) == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return measure(self, prompt, on_run)

    monkeypatch.setattr(Bench, "measure", dies_on_the_third_prompt)
    out = tmp_path / "bench.json"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        main(["bench", "--synthetic-shape", "tiny,tiny-draft", "--configs", "plain,fixed2", "--max-tokens", "8",
              "--prompts", "code,json,summary", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["complete"] is False
    assert [p["name"] for p in result["prompts"]] == ["code", "json"]
    assert set(result["summary"]["configs"]) == {"plain", "fixed2"}


def test_parse_configs_and_suite():
    class FakeModel:  # parse_configs only asks whether the draft is a Model
        pass

    assert [c.name for c in parse_configs(None, None, 8)] == ["plain", "ngram"]
    with pytest.raises(ValueError, match="needs a draft model"):
        parse_configs("adaptive", None, 8)
    with pytest.raises(ValueError, match="unknown config"):
        parse_configs("plain,turbo", "ngram", 8)
    kinds = {p.kind for p in DEFAULT_SUITE}
    assert {"code", "freeform", "json", "summary", "edit"} <= kinds
    assert [p.name for p in load_suite("default", "json,code")] == ["json", "code"]
    with pytest.raises(ValueError, match="unknown prompt"):
        load_suite("default", "nope")


def test_suite_file(tmp_path):
    path = tmp_path / "suite.json"
    path.write_text(json.dumps([{"name": "a", "prompt": "hi"}, {"messages": [{"role": "user", "content": "yo"}]}]))
    prompts = load_suite(str(path))
    assert [p.name for p in prompts] == ["a", "prompt1"]
    assert prompts[0].messages == ({"role": "user", "content": "hi"},)


def test_bench_hf_peer(tmp_path, tiny_model_path):
    pytest.importorskip("transformers")
    target = tiny_model_path(seed=0, context_length=2048)
    draft = tiny_model_path(seed=0, qtype="Q8_0", context_length=2048)
    result = run_bench(tmp_path, "--model", target, "--draft", draft, "--backend", "torch", "--peer", "hf",
                       "--configs", "plain,fixed3", "--prompts", "json")
    peer = result["prompts"][0]["peers"]["hf"]
    assert peer["plain_tps"] > 0 and peer["assisted_tps"] > 0
    assert peer["speedup"] == pytest.approx(peer["assisted_tps"] / peer["plain_tps"])
    assert peer["lossless"] is True


def test_bench_hf_static_peer(tmp_path, tiny_model_path, capsys):
    pytest.importorskip("transformers")
    target = tiny_model_path(seed=0, context_length=2048)
    result = run_bench(tmp_path, "--model", target, "--no-draft", "--backend", "torch", "--peer", "hf-static",
                       "--configs", "plain", "--prompts", "json", "--max-tokens", "12")
    peer = result["prompts"][0]["peers"]["hf-static"]
    assert peer["plain_tps"] > 0 and peer["plain_tokens"] == 12 and "assisted_tps" not in peer
    assert result["meta"]["peers"]["hf-static"]["cache"].startswith("static")
    assert main(["bench", "--model", target, "--no-draft", "--peer", "vllm", "--configs", "plain"]) != 0
    assert "unknown peer 'vllm'" in capsys.readouterr().err


def test_repeats_interleave_the_configs_and_keep_each_median(monkeypatch):
    # A device that drifts must not favour whichever config runs first: rounds alternate the configs, rotated.
    from tandem.bench.bench import Bench, Run
    from tandem.bench.suite import BenchPrompt
    from tandem.speculative.stats import GenerationStats

    configs = parse_configs("plain,ngram", "ngram", 4)
    order, speeds = [], iter([10.0, 50.0, 40.0, 20.0, 30.0, 60.0])

    def generate(self, prompt, config, max_tokens):
        order.append(config.name)
        stats = GenerationStats(generated_tokens=10, decode_ms=1000.0 / next(speeds))
        return Run([1], stats, 1.0, "length")

    monkeypatch.setattr(Bench, "generate", generate)
    bench = Bench(None, "ngram", configs, 8, None, False, repeats=3)
    runs, speedups = bench.measure(BenchPrompt("p", "code", ({"role": "user", "content": "x"},)))
    assert order == ["plain", "ngram", "ngram", "plain", "plain", "ngram"]
    # plain ran at speeds 10, 20, 30 and ngram at 50, 40, 60: the median runs are 20 and 50
    assert {name: run.stats.decode_ms for name, run in runs.items()} == {"plain": 1000.0 / 20, "ngram": 1000.0 / 50}
    # The speedup compares runs of the same round (5x, 2x, 2x), not the medians of drifting rounds (2.5x)
    assert speedups == {"plain": 1.0, "ngram": 2.0}
