"""Prompt lookup mixed with a draft model (the engine picks a source per sequence and iteration), and costs kept on
disk."""

import json
import os
from dataclasses import replace

import pytest
from conftest import assert_speculated, cheap_drafting, exact_distribution
from test_lossless import N_SAMPLES, TARGET_SAMPLING, chi_square_pvalue, skewed_draft_probs

import tandem
from tandem.config import POLICY
from tandem.engine import Engine, Request, calibration, cost_store
from tandem.engine import drafter as drafter_module
from tandem.engine import engine as engine_module
from tandem.engine.costs import CostModel
from tandem.sampling import SamplingParams
from tandem.speculative.proposer import NgramProposer

PROMPTS = ["abc abc abc abc xyz def abc", "def add(a, b):\n    return a + b\n\ndef add(", "The quick brown fox"]


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_mixed_greedy_equals_plain(pair64, policy, monkeypatch, tmp_path):
    target, draft = pair64
    if policy == "adaptive":  # costs under which it drafts on acceptance alone, whatever this machine's timing
        cheap_drafting(monkeypatch, tmp_path)
    target.__dict__.pop("_tandem_engines", None)  # engines built under these costs, and none kept after
    stats = []
    for prompt in PROMPTS:
        plain = tandem.generate(target, prompt=prompt, max_tokens=32)
        mixed = tandem.generate(target, prompt=prompt, draft=draft, draft_max=4, draft_policy=policy,
                                prompt_lookup=True, max_tokens=32)
        assert mixed.tokens == plain.tokens, (policy, prompt)
        # a fixed draft length is the draft model's; the adaptive policy picks a source per iteration
        assert mixed.stats.proposer == ("mixed" if policy == "adaptive" else "draft-model")
        stats.append(mixed.stats)
    target.__dict__.pop("_tandem_engines", None)
    assert_speculated(*stats, rejected=True)


def test_mixed_uses_both_sources(pair64, monkeypatch):
    """An adaptive request beside prompt lookup, drafting whatever the costs (none measured): lookup where the text
    repeats and its estimate leads, the draft model elsewhere; the output is plain decoding's. No confidence stops:
    the tiny random draft is never sure, and its one-token drafts would always lead."""
    monkeypatch.setattr("tandem.engine.drafter.POLICY", replace(POLICY, draft_confidence=0.0))
    target, draft = pair64
    ids = target.tokenizer.encode(PROMPTS[0])
    engine = Engine(target, draft, slots=1, draft_max=3, measure_costs=False)
    result = engine.generate([Request(ids, max_tokens=48)])[0]
    assert result.tokens == tandem.generate(target, prompt=ids, max_tokens=48).tokens
    stats = result.stats
    lookup = sum(v["iterations"] for s, v in stats.sources.items() if s.startswith("ngram"))
    assert stats.proposer == "mixed" and lookup > 0 and stats.sources["draft-model"]["iterations"] > 0, stats.sources


def test_lookup_hindsight():
    proposer = NgramProposer(max_ngram=2)
    proposer.start([5, 6, 7])
    proposer.match([5, 6, 7, 5, 6, 7, 9, 1])
    # generated positions 3..6: 5 (1-gram 7 never seen before it: no match), 6 (after (7, 5)? no; 5 -> 6: right),
    # 7 ((5, 6) -> 7: right), 9 ((6, 7) -> 5: wrong)
    assert proposer.hindsight() == {"ngram1": [True], "ngram2": [True, False]}
    assert proposer.hindsight() == {}


def test_mixing_deterministic_and_sampled_drafts_keeps_the_target_distribution(tiny_model_path, monkeypatch):
    # Each iteration verifies one source's proposal against that source's own q (one-hot for the lookup, the
    # draft's distribution otherwise), chosen from the past alone: the output must follow p exactly. Four tokens,
    # so that a request drafts twice (never on its last token), one source after the other, either order: the
    # lookup "matches" at every other length of the text (odd lengths for even seeds' requests, even for odd ones)
    # and proposes the target's second choice, so that its drafts are often rejected and the residual decides.
    n_generated = 4
    target = tandem.load(tiny_model_path(seed=11), dtype="float32")
    ids = target.tokenizer.encode("Once upon")
    dist = exact_distribution(target, ids, SamplingParams(**TARGET_SAMPLING), n_generated)
    parity = [0]
    monkeypatch.setattr(NgramProposer, "match",
                        lambda self, tokens: ("ngram3", 1) if len(tokens) % 2 == parity[0] else (None, 0))
    monkeypatch.setattr(NgramProposer, "continuation",
                        lambda self, tokens, k: target.logits(tokens)[-1].topk(2).indices[1:2].tolist())
    monkeypatch.setattr(engine_module.DraftPolicy, "_lookup_beats_draft", lambda self, *args: True)
    monkeypatch.setattr(drafter_module, "probs_from_logits", skewed_draft_probs)
    engine = Engine(target, target, slots=1, draft_max=2, measure_costs=False)  # the target drafts for itself
    counts, by_source, mixed = {}, {}, 0
    for seed in range(N_SAMPLES):
        parity[0] = seed % 2
        stats = engine.generate([Request(ids, SamplingParams(seed=seed, **TARGET_SAMPLING), max_tokens=n_generated,
                                         ignore_eos=True)])[0]
        tokens, stats = stats.tokens, stats.stats
        mixed += len(stats.sources) == 2
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
        for source, entry in stats.sources.items():
            by_source[source] = by_source.get(source, 0) + entry["iterations"]
    assert mixed > N_SAMPLES / 4 and by_source.get("ngram3", 0) > N_SAMPLES / 2, (mixed, by_source)
    assert by_source.get("draft-model", 0) > N_SAMPLES / 2, by_source
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p > 1e-3, f"mixed speculative sampling departs from the target's distribution (p={p:.3g})"


def test_costs_are_kept_on_disk_and_refreshed(pair64, tmp_path, monkeypatch):
    target, draft = pair64
    monkeypatch.setenv("TANDEM_COSTS", str(tmp_path))
    measured = []

    def measure(t, d, k_max):
        measured.append(k_max)
        return CostModel(1.0 + len(measured), {1: 3.0, 2: 3.5, k_max + 1: 6.0}, 0.25)

    monkeypatch.setattr(calibration, "measure_costs", measure)
    monkeypatch.setattr(cost_store, "machine_busy", lambda *a: False)
    target.__dict__.pop("_tandem_costs", None)
    first = cost_store.cached_costs(target, draft, 5)
    assert measured == [5] and first.draft_step_ms == 2.0
    path = cost_store.costs_path(target, draft, 5)
    assert path.startswith(str(tmp_path)) and json.load(open(path))["costs"]["draft_step_ms"] == 2.0
    target.__dict__.pop("_tandem_costs")  # a new start of the process
    assert cost_store.cached_costs(target, draft, 5).draft_step_ms == 2.0 and measured == [5]
    target.__dict__.pop("_tandem_costs")
    monkeypatch.setenv(cost_store.RECALIBRATE_ENV, "1")
    assert cost_store.cached_costs(target, draft, 5).draft_step_ms == 3.0 and measured == [5, 5]
    monkeypatch.delenv(cost_store.RECALIBRATE_ENV)
    target.__dict__.pop("_tandem_costs")
    assert cost_store.cached_costs(target, draft, 5).draft_step_ms == 3.0  # the refreshed measurement was kept
    target.__dict__.pop("_tandem_costs")


def test_costs_measured_on_a_busy_machine_are_kept_marked_so(pair64, tmp_path, monkeypatch):
    """Contention distorts the ratios the policy decides on (a 2-token verify read at 2.4 steps, 1.3 on a quiet
    machine), but measuring again at every start on a busy machine is what kept a server from answering for minutes:
    such costs are kept marked as a busy machine's, a start on a busy machine uses them, and a start on a quiet one
    measures again and keeps that."""
    target, draft = pair64
    monkeypatch.setenv("TANDEM_COSTS", str(tmp_path))
    measured = []

    def measure(t, d, k_max):
        measured.append(k_max)
        return CostModel(float(len(measured)), {1: 3.0, 2: 3.5, k_max + 1: 6.0}, 0.25)

    monkeypatch.setattr(calibration, "measure_costs", measure)
    monkeypatch.setattr(cost_store, "machine_busy", lambda *a: True)
    path = cost_store.costs_path(target, draft, 5)
    target.__dict__.pop("_tandem_costs", None)
    cost_store.cached_costs(target, draft, 5)
    cost_store.cached_costs(target, draft, 5)  # the same process: measured once
    assert measured == [5] and json.load(open(path))["quiet"] is False
    target.__dict__.pop("_tandem_costs")  # a new start, busy still: what was kept, nothing measured
    assert cost_store.cached_costs(target, draft, 5).draft_step_ms == 1.0 and measured == [5]
    target.__dict__.pop("_tandem_costs")  # a new start on a quiet machine: measured again, and kept as quiet
    monkeypatch.setattr(cost_store, "machine_busy", lambda *a: False)
    assert cost_store.cached_costs(target, draft, 5).draft_step_ms == 2.0 and measured == [5, 5]
    assert json.load(open(path))["quiet"] is True
    target.__dict__.pop("_tandem_costs")
    assert cost_store.cached_costs(target, draft, 5).draft_step_ms == 2.0 and measured == [5, 5]
    target.__dict__.pop("_tandem_costs")


def test_measure_costs_repeats_until_stable(pair64, monkeypatch):
    target, draft = pair64
    rounds = iter([1.0, 2.0, 1.5, 1.52, 9.0])
    monkeypatch.setattr(calibration, "_measure_once",
                        lambda t, d, k: CostModel(next(rounds), {1: 3.0, 2: 3.0, k + 1: 4.0}, 0.1))
    costs = calibration.measure_costs(target, draft, 4)
    assert costs.draft_step_ms == 1.5  # four rounds (the last two agree), each figure the lower of those two
    assert next(rounds) == 9.0


@pytest.mark.no_drafts_expected("the prompt that fits is 'hi': nothing for prompt lookup to copy")
def test_bench_skips_a_prompt_that_does_not_fit(tiny_model_path, tmp_path, capsys):
    from tandem.cli import main

    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps([{"name": "short", "prompt": "hi"}, {"name": "long", "prompt": "word " * 400}]))
    out = tmp_path / "bench.json"
    model = tiny_model_path(seed=0, context_length=128)
    assert main(["bench", "--model", model, "--draft", "ngram", "--ctx", "128", "--suite", str(suite),
                 "--max-tokens", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [p["name"] for p in result["prompts"]] == ["short"]
    assert "long" in result["meta"]["skipped_prompts"][0]
    assert "skipping long" in capsys.readouterr().err


def test_costs_dir_follows_the_environment(pair64, tmp_path, monkeypatch):
    target, draft = pair64
    monkeypatch.setenv("TANDEM_COSTS", str(tmp_path / "elsewhere"))
    assert os.path.dirname(cost_store.costs_path(target, draft, 8)) == str(tmp_path / "elsewhere")
