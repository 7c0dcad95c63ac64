"""`tandem.generate` and `stream_generate`: one request on an engine kept on the target between calls. A conversation's
next turn reuses the KV of the turn before (reused prefix == recomputed), a stream the caller leaves frees its slot,
a call that finds the engine busy gets one of its own, and the engine's measured costs are kept on disk for the
next start."""

from __future__ import annotations

import os

import pytest
from conftest import assert_speculated

import tandem
from tandem.engine import calibration, cost_store

# The engines' own costs on this machine rarely let a same-size tiny draft pay: where the test is about what happens
# with drafts, they are drafted whatever the costs.
FIXED = dict(draft_policy="fixed")


def fresh(target, **options):
    """What the call gives on an engine built for it (none kept from earlier calls)."""
    target.__dict__.pop("_tandem_engines", None)
    return tandem.generate(target, **options)


def last_used(target):
    """The kept engine the last call ran on."""
    return list(target.__dict__["_tandem_engines"].values())[-1]


def test_a_conversations_next_turn_reuses_the_kv_and_matches_recomputing(pair64):
    target, draft = pair64
    first = fresh(target, prompt="The quick brown fox", draft=draft, **FIXED, max_tokens=12, ignore_eos=True)
    turn = target.tokenizer.encode("The quick brown fox") + first.tokens + target.tokenizer.encode(" and then")
    second = tandem.generate(target, prompt=turn, draft=draft, **FIXED, max_tokens=12, ignore_eos=True)
    assert second.stats.cached_tokens > len(turn) // 2
    recomputed = fresh(target, prompt=turn, draft=draft, **FIXED, max_tokens=12, ignore_eos=True)
    assert recomputed.stats.cached_tokens == 0
    assert second.tokens == recomputed.tokens
    tandem.api.forget_prompts(target)  # what a benchmark does before timing a prompt again
    again = tandem.generate(target, prompt=turn, draft=draft, **FIXED, max_tokens=12, ignore_eos=True)
    assert again.stats.cached_tokens == 0 and again.tokens == recomputed.tokens
    assert_speculated(second.stats, rejected=True)  # drafts on the reused KV, some rejected (its rewinds too)


def test_calls_of_other_settings_share_the_kept_engines(pair64):
    """A plain call runs on the kept engine of a draft (its request does not speculate); a fixed or shorter draft
    length on the same engine; another draft or context gets an engine of its own, at most MAX_KEPT_ENGINES kept."""
    target, draft = pair64
    spec = fresh(target, prompt="abc abc abc abc", draft=draft, max_tokens=16)
    engine = last_used(target).engine
    plain = tandem.generate(target, prompt="abc abc abc abc", max_tokens=16)
    fixed = tandem.generate(target, prompt="abc abc abc abc", draft=draft, draft_max=3, draft_policy="fixed",
                            max_tokens=16)
    assert last_used(target).engine is engine and len(target.__dict__["_tandem_engines"]) == 1
    assert spec.tokens == plain.tokens == fixed.tokens
    assert plain.stats.draft_tokens == 0 and plain.stats.proposer == "none"
    assert fixed.stats.draft_tokens > 0 and max(fixed.stats.draft_len_counts) == 3
    lookup = tandem.generate(target, prompt="abc abc abc abc", draft="ngram", max_tokens=16)
    longer = tandem.generate(target, prompt="abc abc abc abc", draft=draft, draft_max=12, draft_policy="fixed",
                             max_tokens=16)
    assert lookup.tokens == longer.tokens == plain.tokens
    kept = target.__dict__["_tandem_engines"]
    assert len(kept) == tandem.api.MAX_KEPT_ENGINES and last_used(target).engine.draft_max == 12
    assert all(k.engine is not engine for k in kept.values())  # the draft_max 8 engine made way for the 12 one


def test_a_stream_left_early_frees_its_slot(pair64):
    target, draft = pair64
    expected = fresh(target, prompt="def add(a, b):", draft=draft, **FIXED, max_tokens=20, ignore_eos=True).tokens
    stream = tandem.stream_generate(target, prompt="The quick brown fox", draft=draft, **FIXED, max_tokens=20,
                                    ignore_eos=True)
    next(stream)
    stream.close()  # the caller stops reading
    engine = last_used(target).engine
    assert not engine.busy
    again = tandem.generate(target, prompt="def add(a, b):", draft=draft, **FIXED, max_tokens=20, ignore_eos=True)
    assert last_used(target).engine is engine and again.tokens == expected


def test_a_call_that_finds_the_engine_busy_gets_its_own(pair64):
    target, draft = pair64
    expected = fresh(target, prompt="abc abc abc abc", draft=draft, **FIXED, max_tokens=16).tokens
    kept = last_used(target)
    held = tandem.stream_generate(target, prompt="The quick brown fox", draft=draft, **FIXED, max_tokens=16)
    next(held)  # holds the kept engine, as another thread's call would
    assert kept.lock.locked()
    result = tandem.generate(target, prompt="abc abc abc abc", draft=draft, **FIXED, max_tokens=16)
    assert result.tokens == expected and last_used(target) is kept
    held.close()
    assert not kept.lock.locked()


def test_an_engine_whose_step_failed_is_kept_no_longer(pair64, monkeypatch):
    target, draft = pair64
    expected = fresh(target, prompt="abc abc abc abc", draft=draft, **FIXED, max_tokens=16).tokens
    broken = last_used(target).engine

    steps = []

    def failing_step():
        steps.append(1)
        raise RuntimeError("a device error")
    monkeypatch.setattr(broken, "step", failing_step)
    with pytest.raises(RuntimeError, match="device error"):
        tandem.generate(target, prompt="abc abc abc abc", draft=draft, **FIXED, max_tokens=16)
    assert steps == [1]  # not stepped again to clean up
    assert all(k.engine is not broken for k in target.__dict__["_tandem_engines"].values())
    assert tandem.generate(target, prompt="abc abc abc abc", draft=draft, **FIXED, max_tokens=16).tokens == expected


def test_invalid_settings_are_errors_before_anything_runs(pair64):
    target, _ = pair64
    with pytest.raises(ValueError, match="draft policy"):
        tandem.generate(target, prompt="abc", draft="ngram", draft_policy="greedy")
    with pytest.raises(ValueError, match="draft_max"):
        tandem.generate(target, prompt="abc", draft="ngram", draft_max=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        tandem.generate(target, prompt="abc", max_tokens=0)


def test_logprobs_come_back_one_per_token(pair64):
    target, draft = pair64
    result = tandem.generate(target, prompt="abc abc abc", draft=draft, **FIXED, max_tokens=8, logprobs=2,
                             ignore_eos=True)
    assert len(result.logprobs) == len(result.tokens) == 8
    assert_speculated(result.stats)  # accepted drafts get the target's logprobs too
    assert [lp.token for lp in result.logprobs] == result.tokens and all(len(lp.top) == 2 for lp in result.logprobs)
    assert tandem.generate(target, prompt="abc abc abc", max_tokens=4).logprobs is None


@pytest.mark.no_drafts_expected("about the costs kept on disk: whether they let the tiny draft pay is beside it")
def test_the_engines_costs_are_kept_on_disk_for_the_next_start(tiny_model_path, monkeypatch, tmp_path):
    """A second process (here: new models of the same files) reads what the first measured; --recalibrate
    (TANDEM_RECALIBRATE) measures afresh."""
    monkeypatch.setenv(cost_store.COSTS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(cost_store, "machine_busy", lambda *a: False)  # busy: measured again when quiet
    measured = []
    measure = calibration.measure
    monkeypatch.setattr(calibration, "measure", lambda *a, **kw: measured.append(1) or measure(*a, **kw))

    def start():
        target = tandem.load(tiny_model_path(seed=0))
        draft = tandem.load(tiny_model_path(qtype="Q4_0", seed=0))
        return tandem.generate(target, prompt="abc abc abc", draft=draft, max_tokens=4).tokens

    first = start()
    assert measured == [1] and len(os.listdir(tmp_path)) == 1
    assert start() == first and measured == [1]
    monkeypatch.setenv(cost_store.RECALIBRATE_ENV, "1")
    start()
    assert measured == [1, 1]


def dear_drafts(monkeypatch, tmp_path) -> None:
    """Costs as a 2-core CPU's with the default pair: a verify of 2 tokens 1.8 plain steps, a draft step 0.4."""
    from tandem.engine.costs import BatchCosts, CostModel

    def measure(target, draft, k_max, synchronize):
        batches = calibration.batch_sizes(target.slots)
        return BatchCosts(
            verify={b: CostModel(0.0, {b: 40.0 * b, 2 * b: 72.0 * b, b * (k_max + 1): 40.0 * b * (k_max + 1)})
                    for b in batches}, draft_step={b: 16.0 * b for b in batches}, catch_up_ms_per_token=8.0)

    monkeypatch.setenv(cost_store.COSTS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(calibration, "measure", measure)


@pytest.mark.no_drafts_expected(reason="the costs say drafting never pays; the test is the line saying so")
def test_a_generation_that_drafted_nothing_says_why(pair64, monkeypatch, tmp_path, capsys, tiny_model_path):
    target, draft = pair64
    dear_drafts(monkeypatch, tmp_path)
    result = fresh(target, prompt="The quick brown fox", draft=draft, max_tokens=8, ignore_eos=True)
    assert result.stats.draft_tokens == 0
    line = tandem.api.why_no_drafts(target, result.stats)
    assert "a verify of 2 tokens takes 1.8x a plain step (72 vs 40 ms) and a draft step 16 ms" in line
    assert "no acceptance pays" in line or "drafting pays only where over" in line
    assert line.endswith("see `tandem doctor`")
    assert tandem.api.why_no_drafts(target, fresh(target, prompt="abc", max_tokens=4).stats) is None  # no draft
    from tandem.cli import main

    assert main(["generate", "--model", tiny_model_path(seed=0), "--draft", tiny_model_path(qtype="Q4_0", seed=0),
                 "--dtype", "float64", "--prompt", "abc", "--max-tokens", "4"]) == 0
    assert "why nothing was drafted: here a verify of 2 tokens takes 1.8x" in capsys.readouterr().err


def test_least_paying_acceptance_is_where_the_planner_starts_drafting():
    from tandem.engine import planner
    from tandem.engine.costs import BatchCosts, CostModel

    costs = BatchCosts(verify={1: CostModel(0.0, {1: 10.0, 2: 11.0, 9: 18.0})}, draft_step={1: 1.0})
    floor = tandem.api.least_paying_acceptance(costs, 8)
    assert 0.0 < floor < 0.5
    assert planner.plan([planner.Candidate(floor, 8)], costs)[0] > 0
    assert planner.plan([planner.Candidate(floor - 0.02, 8)], costs)[0] == 0
    dear = BatchCosts(verify={1: CostModel(0.0, {1: 10.0, 2: 20.0, 9: 90.0})}, draft_step={1: 10.0})
    assert tandem.api.least_paying_acceptance(dear, 8) == 1.0
