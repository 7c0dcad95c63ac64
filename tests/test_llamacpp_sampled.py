"""Sampled speculation on the llama.cpp backend (the CPU default) end to end: a Q8_0 target and its Q4_0 draft, both on
llama.cpp, 4 sequences verified per step, against the target's distribution enumerated independently (its own
logits through the numpy reference, tests/sampling_reference.py); a wrong residual must fail the same test.

What this covers that the torch tests cannot: the target's rows read from llama.cpp's buffers, sampled verifies of
several sequences in one batched llama.cpp forward, and draft probabilities from a llama.cpp draft."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

from conftest import load_llamacpp_pair, sample_with_drafts  # noqa: E402
from sampling_reference import exact_distribution  # noqa: E402
from test_lossless import chi_square_pvalue, residual_from_target, residual_from_target_after_an_accept  # noqa: E402

from tandem.engine import Engine  # noqa: E402
from tandem.speculative.verify import verify_sampled  # noqa: E402

# Seed 9's Q8_0 target on this prompt, with the same weights in Q4_0 as its draft: about 0.75 of drafts accepted
# at this setting, so every (k, accepted) outcome of drafts of 2-4 happens dozens of times in N_SAMPLES.
SEED, PROMPT = 9, "The quick brown fox"
SAMPLING = dict(temperature=0.15, top_k=3)  # top-k keeps the enumerated tree at 3**6 sequences
N_GENERATED = 6  # the prefill's token, then room for a 4-token draft and its bonus token
DRAFT_LENGTHS = [4, 3, 2]  # cycled; each capped at the room left, so shorter drafts happen too
N_SAMPLES = 1200
SLOTS = 4


@pytest.fixture(scope="module")
def llamacpp_setup(tiny_model_path):
    target, draft = load_llamacpp_pair(tiny_model_path, SEED, n_ctx=64)
    prompt_ids = target.tokenizer.encode(PROMPT)
    dist, _ = exact_distribution(lambda ids: target.logits(ids)[-1].numpy(), prompt_ids, N_GENERATED, **SAMPLING)
    yield target, draft, prompt_ids, dist
    target.close()
    draft.close()


def sample_sequences(target, draft, prompt_ids, monkeypatch, verify=verify_sampled):
    """N_SAMPLES generations, SLOTS at a time on one engine (each request its own seed), drafts from the llama.cpp
    draft, verified by `verify`: ({sequence: count}, {(k, n_accepted): verifies}, [verifies with drafts per step])."""
    engine = Engine(target, draft, slots=SLOTS, draft_max=max(DRAFT_LENGTHS), measure_costs=False,
                    prompt_lookup=False)
    per_step, step = [], engine.step

    def counted_step():
        per_step.append(0)
        return step()

    def counted_verify(draft_tokens, *args):
        per_step[-1] += draft_tokens.shape[0] > 0
        return verify(draft_tokens, *args)

    monkeypatch.setattr(engine, "step", counted_step)
    counts, outcomes = sample_with_drafts(engine, prompt_ids, SAMPLING, N_SAMPLES, N_GENERATED, DRAFT_LENGTHS,
                                          monkeypatch, counted_verify)
    return counts, outcomes, per_step


def test_sampled_speculation_on_llamacpp_matches_the_targets_distribution(llamacpp_setup, monkeypatch):
    target, draft, prompt_ids, dist = llamacpp_setup
    counts, outcomes, per_step = sample_sequences(target, draft, prompt_ids, monkeypatch)
    # Every outcome of drafts of 2-4: rejection at each row (the residual after 0..k-1 accepted) and all accepted.
    assert all(outcomes.get((k, n), 0) >= 10 for k in (2, 3, 4) for n in range(k + 1)), sorted(outcomes.items())
    # Verified together: most drafted verifies ran in a step with all SLOTS sequences drafting.
    drafted = sum(per_step)
    assert max(per_step) == SLOTS and sum(n for n in per_step if n == SLOTS) > drafted / 2, per_step
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p > 1e-3, f"sampled speculation on llama.cpp departs from the target's distribution (p={p:.3g})"


@pytest.mark.parametrize("wrong_rule", [residual_from_target, residual_from_target_after_an_accept])
def test_the_llamacpp_distribution_test_catches_a_wrong_residual(llamacpp_setup, monkeypatch, wrong_rule):
    target, draft, prompt_ids, dist = llamacpp_setup
    counts, _, _ = sample_sequences(target, draft, prompt_ids, monkeypatch, verify=wrong_rule)
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p < 1e-4, f"{wrong_rule.__name__} went unnoticed on llama.cpp (p={p:.3g})"

