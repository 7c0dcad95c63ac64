"""Head drafts on llama.cpp (docs/decisions/0004-head-drafts.md): a random gemma4-assistant GGUF that llama.cpp's own
loader takes, its MTP context over a gemma4 target's, the hidden-state hand-off, and speculation with it exact
(greedy == plain alone and batched; sampled against the target's distribution, with wrong residuals caught).

A random head agrees with a random target on nothing: the tests that need accepted drafts give both a logit bias
onto a few tokens (a request's logit_bias applies to the draft's rows as to the target's), so that each picks among
them by its own logits and they agree part of the time."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

from conftest import (  # noqa: E402
    HEAD_BIAS,
    HEAD_PROMPTS,
    assert_speculated,
    check_adaptive_head_is_plain,
    check_head_greedy_catches_a_kept_rejection,
    check_head_greedy_is_plain,
    sample_with_drafts,
)
from sampling_reference import exact_distribution  # noqa: E402
from test_lossless import chi_square_pvalue, residual_from_target, residual_from_target_after_an_accept  # noqa: E402

import tandem  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.logits.options import logits_settings  # noqa: E402
from tandem.speculative.compat import HeadMismatchError, check_head  # noqa: E402
from tandem.speculative.verify import verify_sampled  # noqa: E402
from tandem.synthetic.heads import write_eagle3, write_gemma4_assistant  # noqa: E402

TARGET = dict(arch="gemma4", layout="dense", n_layers=3, qtype="Q8_0", seed=5, tie_embeddings=True)  # d_model 64
THREE_TOKENS = {300: 30.0, 301: 30.0, 302: 30.0}


@pytest.fixture(scope="module")
def head_path(tmp_path_factory):
    return write_gemma4_assistant(tmp_path_factory.mktemp("head") / "assistant.gguf", target_d_model=64, seed=7)


@pytest.fixture(scope="module")
def pair(tiny_model_path, head_path):
    target = tandem.load(tiny_model_path(**TARGET), backend="llama.cpp", n_ctx=128, n_threads=1)
    head = tandem.load(head_path, backend="llama.cpp", n_ctx=128, n_threads=1)
    yield target, head
    head.close()
    target.close()


EAGLE_TARGET = dict(arch="llama", n_layers=4, qtype="Q8_0", seed=3)  # d_model 64, the tiny byte-level vocabulary


@pytest.fixture(scope="module")
def eagle_pair(tiny_model_path, tmp_path_factory):
    """A llama target and a random EAGLE-3 drafter reading its layers 0, 2 and 3."""
    path = write_eagle3(tmp_path_factory.mktemp("eagle3") / "eagle3.gguf", target_d_model=64, target_layers=(0, 2, 3),
                        seed=4)
    target = tandem.load(tiny_model_path(**EAGLE_TARGET), backend="llama.cpp", n_ctx=128, n_threads=1)
    head = tandem.load(path, backend="llama.cpp", n_ctx=128, n_threads=1)
    yield target, head
    head.close()
    target.close()


@pytest.fixture(scope="module", params=["gemma4-assistant", "eagle3"])
def both(request):
    """Each layout's (target, head)."""
    return request.getfixturevalue("pair" if request.param == "gemma4-assistant" else "eagle_pair")


def test_llamacpp_loads_the_head_and_reads_it_as_one(pair):
    import llama_cpp.llama_cpp as llc

    _, head = pair
    assert head.config.architecture == "gemma4-assistant" and head.config.head_input_width == 64
    assert llc.llama_model_n_layer_nextn(head.weights.model) == head.config.n_layers == 3


def test_llamacpp_rejects_a_head_without_its_target_width(tmp_path):
    bad = write_gemma4_assistant(tmp_path / "bad.gguf", metadata={"gemma4-assistant.embedding_length_out": None})
    with pytest.raises(ValueError, match="embedding_length_out"):
        tandem.load(bad, backend="llama.cpp", n_ctx=64, n_threads=1)
    with pytest.raises(ValueError, match="must differ"):
        write_gemma4_assistant(tmp_path / "same.gguf", target_d_model=32, d_model=32)


def _first_draft(target, head, ids: list[int], verify_from: int | None = None, others: list[list[int]] = (),
                 state_at: int | None = None, catch_up: bool = True) -> np.ndarray:
    """The head's logits [V] for the token after ids[-1] (slot 0 of a fresh batched target cache that took ids[:-1]:
    as a prompt, or up to verify_from as a prompt and the rest as a verify's rows, two drafts past them rewound).
    others: other slots' prompts, drafted for in the same head forward. state_at: draft from the target's hidden
    state at that position instead of the one before the pending token; catch_up=False: EAGLE-3 without its
    catch-up on the verify's rows (controls)."""
    kv = target.new_batched_cache(1 + len(others), 64)
    head_kv = kv.attach_head(head)
    try:
        start = verify_from if verify_from is not None else len(ids) - 1
        entries = [(0, ids[:start])] + [(s, p[:-1]) for s, p in enumerate(others, 1)]
        kv.forward(entries, [True] * len(entries))
        if verify_from is not None:
            if not catch_up:  # an EAGLE-3 drafter's hook on the target's decodes, off (a control)
                kv._rows.on_rows = None
            kv.forward([(0, ids[start:] + [7, 8])], [False])
            kv.rewind(0, len(ids) - 1)
        if state_at is not None:
            return head_kv._drafts.head.step([(0, ids[-1], len(ids) - 1, kv._rows.hidden(0, state_at))])[0][0]
        fed = [(0, ids[-1:])] + [(s, p[-1:]) for s, p in enumerate(others, 1)]
        return head_kv.forward(fed, [True] * len(fed))[0][0].numpy()
    finally:
        head_kv.close()
        kv.close()


def test_the_head_drafts_from_the_targets_hidden_state_at_the_position_before(pair):
    target, head = pair
    ids = target.tokenizer.encode(HEAD_PROMPTS[0]) + [300, 301, 302]
    from_prompt = _first_draft(target, head, ids)
    assert np.isfinite(from_prompt).all() and from_prompt.shape == (target.vocab_size,)
    # the state of the row before the pending token, read out of a verify's rows, gives the same draft
    np.testing.assert_allclose(_first_draft(target, head, ids, verify_from=len(ids) - 3), from_prompt, atol=1e-4)
    # control: the hand-off matters (a draft from the state one position earlier is another draft)
    off_by_one = _first_draft(target, head, ids, verify_from=len(ids) - 3, state_at=len(ids) - 3)
    assert np.abs(off_by_one - from_prompt).max() > 1e-2


def test_a_sequences_draft_is_the_same_alone_and_beside_others(pair):
    target, head = pair
    ids, *others = (target.tokenizer.encode(p) for p in (HEAD_PROMPTS[1], HEAD_PROMPTS[0], HEAD_PROMPTS[2]))
    np.testing.assert_allclose(_first_draft(target, head, ids, others=others), _first_draft(target, head, ids),
                               atol=1e-4)


def test_eagle3_drafts_from_the_pairs_its_catch_up_wrote(eagle_pair):
    target, head = eagle_pair
    assert head.config.architecture == "eagle3" and head.config.head_target_layers == (0, 2, 3)
    ids = target.tokenizer.encode(HEAD_PROMPTS[0]) + [300, 301, 302]
    from_prompt = _first_draft(target, head, ids)
    assert np.isfinite(from_prompt).all() and from_prompt.shape == (target.vocab_size,)
    # the pairs a verify's rows wrote (those of the rejected drafts dropped) give the draft a prompt's give
    np.testing.assert_allclose(_first_draft(target, head, ids, verify_from=len(ids) - 3), from_prompt, atol=1e-4)
    # control: without the catch-up after the verify (its pairs and states never written) the draft differs
    without = _first_draft(target, head, ids, verify_from=len(ids) - 3, catch_up=False)
    assert np.abs(without - from_prompt).max() > 1e-2


def test_greedy_with_the_head_is_the_target_alone_and_batched(both):
    check_head_greedy_is_plain(*both)


def test_the_greedy_comparison_catches_a_rule_that_keeps_a_rejected_draft(pair, monkeypatch):
    check_head_greedy_catches_a_kept_rejection(*pair, monkeypatch)


def test_the_adaptive_policy_drafts_with_a_head_where_it_pays_and_stays_exact(both, monkeypatch, tmp_path):
    check_adaptive_head_is_plain(*both, monkeypatch, tmp_path)

def test_a_head_that_does_not_fit_its_target_is_a_clear_error(pair, tiny_model_path, tmp_path):
    target, head = pair
    wider = write_gemma4_assistant(tmp_path / "wider.gguf", target_d_model=96, seed=1)
    qwen = tandem.load(tiny_model_path(qtype="Q8_0"), backend="llama.cpp", n_ctx=64, n_threads=1)
    wide = tandem.load(wider, backend="llama.cpp", n_ctx=64, n_threads=1)
    try:
        with pytest.raises(HeadMismatchError, match="hidden states of 96 values, the target's are 64"):
            check_head(target, wide)
        with pytest.raises(HeadMismatchError, match="drafts for gemma4 targets, not qwen2"):
            tandem.generate(qwen, prompt="hi", max_tokens=2, draft=head)
    finally:
        wide.close()
        qwen.close()
    check_head(target, head)


def test_a_head_drafts_through_the_worker_process_as_in_this_one(pair, tiny_model_path, head_path):
    """The CUDA build's way (llama.cpp in a worker process): the head's context there over the target's, one round
    trip a draft step; the output is the target's, as in process."""
    in_process, _ = pair
    plain = [tandem.generate(in_process, prompt=p, max_tokens=20, logit_bias=HEAD_BIAS).tokens for p in HEAD_PROMPTS]
    target = tandem.load(tiny_model_path(**TARGET), backend="llama.cpp", n_ctx=64, threads=1, isolation="process")
    try:
        results = tandem.generate(target, prompts=HEAD_PROMPTS, max_tokens=20, logit_bias=HEAD_BIAS, draft=head_path,
                                  draft_policy="fixed", draft_max=3)
        assert [r.tokens for r in results] == plain
        assert_speculated(*(r.stats for r in results), rejected=True)
        with pytest.raises(ValueError, match="in its target's worker process"):
            Engine(target, pair[1], slots=1, measure_costs=False)  # a head loaded in this process
    finally:
        target.close()


def test_eagle3_drafts_through_the_worker_process_as_in_this_one(eagle_pair, tiny_model_path):
    in_process, head = eagle_pair
    plain = [tandem.generate(in_process, prompt=p, max_tokens=16, logit_bias=HEAD_BIAS).tokens for p in HEAD_PROMPTS]
    target = tandem.load(tiny_model_path(**EAGLE_TARGET), backend="llama.cpp", n_ctx=64, threads=1,
                         isolation="process")
    try:
        results = tandem.generate(target, prompts=HEAD_PROMPTS, max_tokens=16, logit_bias=HEAD_BIAS, draft=head.path,
                                  draft_policy="fixed", draft_max=3)
        assert [r.tokens for r in results] == plain
        assert_speculated(*(r.stats for r in results), rejected=True)
    finally:
        target.close()


def test_draft_auto_finds_the_head_beside_the_target_and_models_heads_says_which_fit(tmp_path, capsys):
    from tandem.api import load_pair
    from tandem.cli import main
    from tandem.speculative.compat import find_head
    from tandem.synthetic.tiny_gguf import write_tiny_gguf

    target = write_tiny_gguf(tmp_path / "target.gguf", **TARGET)
    with pytest.raises(ValueError, match="no head draft"):
        find_head(target)
    write_gemma4_assistant(tmp_path / "a-wider.gguf", target_d_model=96)
    fits = write_gemma4_assistant(tmp_path / "b-assistant.gguf", target_d_model=64)
    assert find_head(target) == fits
    assert main(["models", "heads", target]) == 0
    out = capsys.readouterr().out
    assert f"{fits}: fits" in out and "a-wider.gguf: does not fit: it reads hidden states of 96 values" in out
    loaded, head = load_pair(target, "auto", backend="llama.cpp", n_ctx=64, threads=1)
    try:
        assert head.path == fits and head.config.architecture == "gemma4-assistant"
    finally:
        head.close()
        loaded.close()


def test_the_doctor_and_the_costs_time_a_head_beside_its_target(tiny_model_path, head_path, capsys):
    import json

    from tandem.cli import main

    target = tiny_model_path(**TARGET)
    assert main(["doctor", "--json", "--repeats", "2", "--model", target, "--draft", head_path, "--backend",
                 "llama.cpp", "--threads", "1", "--slots", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["draft_kind"] == "head" and d["draft_step_ms_standalone"] is None  # a head has no step alone
    assert d["draft_step_ms_paired"] > 0 and d["draft_step_ms_target_idle"] > 0
    assert all(row["draft_step_ms"] > 0 for row in d["batched"].values())


def test_the_one_request_costs_price_a_head_with_no_catch_up(pair):
    from tandem.engine.calibration import measure_costs

    target, head = pair
    costs = measure_costs(target, head, 3)
    assert costs.draft_step_ms > 0 and costs.catch_up_ms_per_token == 0.0


# --- sampled: the target's distribution, drafts of 2-3 tokens, 4 sequences a verify ---------------------------------
SAMPLING = dict(temperature=1.0, top_k=3)  # the biased three, each model weighing them by its own logits
N_GENERATED = 5
N_SAMPLES = 3600  # at 1200 the residual wrong after an accept went unnoticed (p = 0.06)
SLOTS = 4


@pytest.fixture(scope="module")
def sampled_setup(both):
    target, head = both
    prompt_ids = target.tokenizer.encode(HEAD_PROMPTS[1])
    bias = np.zeros(target.vocab_size)
    bias[list(THREE_TOKENS)] = list(THREE_TOKENS.values())
    dist, _ = exact_distribution(lambda ids: target.logits(ids)[-1].numpy() + bias, prompt_ids, N_GENERATED,
                                 **SAMPLING)
    return target, head, prompt_ids, dist


def sample_with_head(target, head, prompt_ids, monkeypatch, verify=verify_sampled):
    engine = Engine(target, head, slots=SLOTS, draft_max=3, measure_costs=False, prompt_lookup=False)
    logits = logits_settings(logit_bias=THREE_TOKENS, vocab=target.vocab_size)
    return sample_with_drafts(engine, prompt_ids, SAMPLING, N_SAMPLES, N_GENERATED, [2, 3], monkeypatch, verify,
                              logits=logits)


def test_sampled_speculation_with_the_head_matches_the_targets_distribution(sampled_setup, monkeypatch):
    target, head, prompt_ids, dist = sampled_setup
    counts, outcomes = sample_with_head(target, head, prompt_ids, monkeypatch)
    assert all(outcomes.get((k, n), 0) >= 10 for k in (2, 3) for n in range(k + 1)), sorted(outcomes.items())
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p > 1e-3, f"sampled speculation with a head departs from the target's distribution (p={p:.3g})"


@pytest.mark.parametrize("wrong_rule", [residual_from_target, residual_from_target_after_an_accept])
def test_the_head_distribution_test_catches_a_wrong_residual(sampled_setup, monkeypatch, wrong_rule):
    target, head, prompt_ids, dist = sampled_setup
    counts, _ = sample_with_head(target, head, prompt_ids, monkeypatch, verify=wrong_rule)
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p < 1e-4, f"{wrong_rule.__name__} went unnoticed with a head (p={p:.3g})"
