"""Confidence stops (Drafter: a draft ends after a token the draft was unsure of, POLICY.draft_confidence): greedy
output stays the target's alone and batched, on torch and llama.cpp; sampled output keeps the target's exact
distribution; drafts do end early where the draft is unsure; and a stop that peeks at the drawn token fails the same
distribution test (the negative control)."""

from __future__ import annotations

import pytest
from conftest import K_QUANT_SHAPES, assert_speculated
from test_llamacpp_sampled import N_SAMPLES, llamacpp_setup, sample_sequences  # noqa: F401 (a fixture)
from test_lossless import chi_square_pvalue

import tandem
from tandem.config import POLICY
from tandem.engine import Engine, Request, drafter
from tandem.engine.drafter import Drafter, confidence_floor
from tandem.engine.generation import Generation

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "{\"name\": \"tandem\", \"items\": [1, 2,"]


def stopping(monkeypatch, floor: float) -> list[tuple[int, int]]:
    """Every draft (fixed ones too: the tests' k is the cap) stops under `floor`; returns the (planned, drafted)
    lengths of each sequence's draft as the drafter makes them."""
    monkeypatch.setattr(drafter, "confidence_floor", lambda gen: floor)
    lengths, draft = [], Drafter.draft

    def recording(self, drafting, *args, **kwargs):
        proposals, forwards = draft(self, drafting, *args, **kwargs)
        lengths.extend((k, len(proposals[i][0])) for i, (_, k) in drafting.items())
        return proposals, forwards

    monkeypatch.setattr(Drafter, "draft", recording)
    return lengths


def assert_some_stopped(lengths: list[tuple[int, int]]) -> None:
    # Some drafts stopped early and some ran to their cap: the floor splits this draft's confidences.
    assert any(0 < n < k for k, n in lengths) and any(n == k > 1 for k, n in lengths), lengths


def test_only_adaptive_drafts_stop():
    gen = Generation.__new__(Generation)
    for policy, floor in (("adaptive", POLICY.draft_confidence), ("fixed", 0.0)):
        gen.request = Request([1], draft_policy=policy)
        assert confidence_floor(gen) == floor
    assert 0 < POLICY.draft_confidence < 1


@pytest.mark.parametrize("backend", ["torch", "llama.cpp", "llama.cpp-worker"])
def test_greedy_with_confidence_stops_is_plain_alone_and_batched(backend, tiny_model_path, pair64, monkeypatch):
    # Each floor splits its draft's confidences on these prompts: these tiny random drafts give their top token
    # 0.02-0.07. The worker drafts in its process (greedy_drafts), with the floors sent along.
    if backend == "torch":
        (target, draft), floor = pair64, 0.03
    else:
        pytest.importorskip("llama_cpp")
        isolation = "process" if backend == "llama.cpp-worker" else "none"
        target, draft = (tandem.load(tiny_model_path(qtype=qtype, seed=9, **K_QUANT_SHAPES), backend="llama.cpp",
                                     n_ctx=256, n_threads=1, isolation=isolation) for qtype in ("Q8_0", "Q4_0"))
        floor = 0.035
    plain = [tandem.generate(target, prompt=p, max_tokens=24).tokens for p in PROMPTS]
    lengths = stopping(monkeypatch, floor)
    alone = [tandem.generate(target, prompt=p, draft=draft, draft_max=6, draft_policy="fixed", max_tokens=24)
             for p in PROMPTS]
    assert [r.tokens for r in alone] == plain
    assert_speculated(*(r.stats for r in alone), rejected=True)
    engine = Engine(target, draft, slots=3, draft_max=6, measure_costs=False, prompt_lookup=False)
    results = engine.generate([Request(target.tokenizer.encode(p), max_tokens=24, draft_policy="fixed")
                               for p in PROMPTS])
    assert [r.tokens for r in results] == plain
    assert_some_stopped(lengths)


# The sampled test in test_llamacpp_sampled's setting: a Q8_0 target, its Q4_0 draft, the enumerated distribution


def peeking_stop(floor: float):
    """The negative control's drafter: where the drawn token's own probability (not the distribution's largest) is
    below floor, it proposes the draft's likeliest token there instead and stops, its q unchanged: a draft that
    keeps only tokens it is sure of. The proposal is then not q's draw and the distribution breaks. (A stop that
    only cuts the draft, even one reading the draw, stays exact: the target samples the cut position itself.)"""
    draft = Drafter.draft

    def cut(self, drafting, *args, **kwargs):
        proposals, forwards = draft(self, drafting, *args, **kwargs)
        for i, (tokens, probs) in proposals.items():
            unsure = next((j for j, t in enumerate(tokens) if float(probs[j, t]) < floor), None)
            if unsure is not None:
                tokens = tokens[:unsure] + [int(probs[unsure].argmax())]
                proposals[i] = (tokens, probs[: unsure + 1])
        return proposals, forwards

    return cut


@pytest.mark.llamacpp
@pytest.mark.parametrize("rule", ["confidence", "peeking"])
def test_sampled_with_confidence_stops_keeps_the_targets_distribution(rule, llamacpp_setup, monkeypatch):  # noqa: F811
    target, draft, prompt_ids, dist = llamacpp_setup
    floor = 0.9  # at temperature 0.15 this draft gives its likeliest token 0.3-1.0
    if rule == "confidence":
        lengths = stopping(monkeypatch, floor)
    else:
        monkeypatch.setattr(Drafter, "draft", peeking_stop(floor))
    counts, _, _ = sample_sequences(target, draft, prompt_ids, monkeypatch)
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    if rule == "confidence":
        assert_some_stopped(lengths)
        assert p > 1e-3, f"confidence stops depart from the target's distribution (p={p:.3g})"
    else:
        assert p < 1e-4, f"a stop that peeks at the drawn token went unnoticed (p={p:.3g})"


@pytest.mark.parametrize("floor", [0.0, 1.0])
def test_a_stopped_draft_runs_fewer_draft_forwards(pair64, monkeypatch, floor):
    """A lone sequence that stops after its first token (floor 1: never sure) runs one draft forward a step, its
    catch-up; without stops (floor 0) it runs k."""
    target, draft = pair64
    forwards, draft_step = [], Drafter.draft

    def counting(self, drafting, *args, **kwargs):
        proposals, n = draft_step(self, drafting, *args, **kwargs)
        forwards.append((n, [len(proposals[i][0]) for i in drafting]))
        return proposals, n

    monkeypatch.setattr(drafter, "confidence_floor", lambda gen: floor)
    monkeypatch.setattr(Drafter, "draft", counting)
    engine = Engine(target, draft, slots=1, draft_max=4, measure_costs=False, prompt_lookup=False)
    result, = engine.generate([Request(target.tokenizer.encode(PROMPTS[0]), max_tokens=16, draft_policy="fixed")])
    assert result.tokens == tandem.generate(target, prompt=PROMPTS[0], max_tokens=16).tokens
    steady = [(n, drafted) for n, (drafted,) in forwards if n is not None]
    assert len(steady) >= 2 and all(n == drafted for n, drafted in steady), forwards
    assert {drafted for _, drafted in steady} == ({1} if floor else {4}) | ({1, 2, 3} & {d for _, d in steady})
