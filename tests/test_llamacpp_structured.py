"""Structured output and log-probabilities under speculation on the llama.cpp backend (the CPU default), end to end
(issue 51, item 1): a Q8_0 target and its Q4_0 draft, both on llama.cpp, alone and 3 sequences to a step.

- Greedy under a JSON schema: speculative output is plain decoding's, token for token, and a document valid against
  the schema (checked by the jsonschema package, not the engine's grammar).
- Log-probabilities: each emitted token's, and its top alternatives, are log-softmax (numpy, float64) of the target's
  logits over the whole prefix, evaluated in a fresh llama.cpp sequence; speculative logprobs are plain ones. Two
  planted errors must fail the same comparison: rows scored one position late, and the draft's rows scored.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

from conftest import BOUNDED_SCHEMA, K_QUANT_SHAPES, assert_speculated, count_batches, load_llamacpp_pair  # noqa: E402

import tandem  # noqa: E402
from tandem.engine import Engine, Request  # noqa: E402
from tandem.engine import engine as engine_module  # noqa: E402
from tandem.engine import outcomes as outcomes_module  # noqa: E402
from tandem.logits.grammar import COMPACT_JSON  # noqa: E402
from tandem.logits.options import logits_settings  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402

# Seed 9's Q8_0 target with the same weights in Q4_0 as its draft: about half its drafts accepted here, and every
# document below closes well within MAX_TOKENS (~150 tokens with free whitespace, ~60 compact).
SEED = 9
SCHEMA = BOUNDED_SCHEMA
SCHEMAS = [SCHEMA, {**SCHEMA, "x-guidance": COMPACT_JSON}]  # bounded free whitespace, and none
PROMPTS = ["Tell me about Ada.", "def add(a, b):\n    return", "The quick brown fox"]
MAX_TOKENS = 300
DRAFT_MAX = 4
LOGPROB_TOKENS = 30
TOLERANCE = 1e-5  # float32 log-softmax against float64's: measured 4e-7 apart


@pytest.fixture(scope="module")
def pair(tiny_model_path):
    target, draft = load_llamacpp_pair(tiny_model_path, SEED, n_ctx=512)
    yield target, draft
    target.close()
    draft.close()


def run(target, draft, requests: list[Request], slots: int) -> tuple[list, list[int]]:
    """The requests through one engine, `slots` at a time: (results in order, sequences in each target forward)."""
    engine = Engine(target, draft, slots=slots, draft_max=DRAFT_MAX, measure_costs=False, prompt_lookup=False)
    sizes = count_batches(engine)
    results = []
    for start in range(0, len(requests), slots):
        results += engine.generate(requests[start : start + slots])
    return results, sizes


# --- greedy under a JSON schema --------------------------------------------------------------------------------

def schema_requests(target) -> list[Request]:
    return [Request(target.tokenizer.encode(prompt), max_tokens=MAX_TOKENS, draft_policy="fixed",
                    logits=logits_settings(json_schema=schema))
            for schema in SCHEMAS for prompt in PROMPTS]


@pytest.fixture(scope="module")
def plain_schema_results(pair):
    target, _ = pair
    results, _ = run(target, None, schema_requests(target), slots=1)
    assert all(r.stats.draft_tokens == 0 for r in results)
    return results


def test_the_schema_is_what_makes_the_output_json(pair, plain_schema_results):
    target, _ = pair
    for result, schema in zip(plain_schema_results, [s for s in SCHEMAS for _ in PROMPTS], strict=True):
        assert result.finish_reason == "stop", result.text  # the grammar completed the document
        jsonschema.validate(json.loads(result.text), schema)
    with pytest.raises(json.JSONDecodeError):  # the random model alone writes no JSON
        json.loads(tandem.generate(target, prompt=PROMPTS[0], max_tokens=40).text)


@pytest.mark.parametrize("slots", [1, 3])
def test_greedy_speculation_under_a_json_schema_is_plain_decoding(pair, plain_schema_results, slots):
    target, draft = pair
    results, sizes = run(target, draft, schema_requests(target), slots)
    schemas = [s for s in SCHEMAS for _ in PROMPTS]
    for spec, plain, schema in zip(results, plain_schema_results, schemas, strict=True):
        assert spec.tokens == plain.tokens
        assert spec.text == plain.text and spec.finish_reason == plain.finish_reason == "stop"
        jsonschema.validate(json.loads(spec.text), schema)
    assert_speculated(*(r.stats for r in results), rejected=True)
    if slots > 1:  # decoded together: most target forwards ran all three sequences
        assert sizes.count(slots) > len(sizes) / 2, sizes


# --- log-probabilities -----------------------------------------------------------------------------------------

def logprob_requests(target) -> list[Request]:
    """Greedy with 3 alternatives; sampled (its rows through the rejection sampler); greedy under a schema (its
    tokens the adjusted argmax, their logprobs the raw rows')."""
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    return [Request(prompts[0], max_tokens=LOGPROB_TOKENS, draft_policy="fixed", logprobs=3),
            Request(prompts[1], SamplingParams(temperature=0.9, seed=5), max_tokens=LOGPROB_TOKENS,
                    draft_policy="fixed", logprobs=2),
            Request(prompts[2], max_tokens=LOGPROB_TOKENS, draft_policy="fixed", logprobs=2,
                    logits=logits_settings(json_schema=SCHEMAS[1]))]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def logprob_error(model, requests: list[Request], results: list) -> float:
    """The largest difference between the results' logprobs (each token's and its alternatives') and log-softmax of
    `model`'s logits over prompt + tokens, evaluated from scratch in a fresh sequence (inf: an alternative that is
    not among the reference's likeliest, in order)."""
    worst = 0.0
    for request, result in zip(requests, results, strict=True):
        assert len(result.logprobs) == len(result.tokens) == LOGPROB_TOKENS
        assert [e.token for e in result.logprobs] == result.tokens
        n = len(request.prompt)
        reference = log_softmax(model.logits(request.prompt + result.tokens[:-1]).numpy()[n - 1 :])  # row i: token i
        for row, entry in zip(reference, result.logprobs, strict=True):
            worst = max(worst, abs(entry.logprob - row[entry.token]))
            assert len(entry.top) == request.logprobs
            best = np.argsort(-row, kind="stable")[: request.logprobs]
            if [t for t, _ in entry.top] != best.tolist():
                return float("inf")
            worst = max([worst] + [abs(v - row[t]) for t, v in entry.top])
    return worst


def check_shape(requests: list[Request], results: list) -> None:
    greedy, sampled, constrained = results
    assert all(e.top[0][0] == e.token for e in greedy.logprobs)  # greedy: the likeliest
    assert any(e.top[0][0] != e.token for e in sampled.logprobs)  # sampled: not always
    assert any(e.logprob < e.top[0][1] for e in constrained.logprobs)  # the grammar overrode the raw argmax


@pytest.fixture(scope="module")
def plain_logprobs(pair):
    target, _ = pair
    requests = logprob_requests(target)
    results, _ = run(target, None, requests, slots=1)
    return requests, results


def test_plain_logprobs_are_the_targets_log_softmax(pair, plain_logprobs):
    target, _ = pair
    requests, results = plain_logprobs
    check_shape(requests, results)
    assert logprob_error(target, requests, results) < TOLERANCE


@pytest.mark.parametrize("slots", [1, 3])
def test_speculative_logprobs_are_the_targets_and_plain_decodings(pair, plain_logprobs, slots):
    target, draft = pair
    requests, plain = plain_logprobs
    results, sizes = run(target, draft, logprob_requests(target), slots)
    assert_speculated(*(r.stats for r in results), rejected=True)
    if slots > 1:
        assert sizes.count(slots) > len(sizes) / 2, sizes
    check_shape(requests, results)
    assert logprob_error(target, requests, results) < TOLERANCE
    # Greedy, the same tokens as plain decoding, and their logprobs bit for bit: llama.cpp gives a token the same row
    # in a verify, a batch and a plain step (NUMERICS in the backend). A seeded sampled reply differs from plain's.
    for i in (0, 2):
        assert results[i].tokens == plain[i].tokens
        assert [(e.token, e.logprob, e.top) for e in results[i].logprobs] == \
            [(e.token, e.logprob, e.top) for e in plain[i].logprobs]


def shifted_rows(monkeypatch, engine, draft_model) -> None:
    """Planted error: each verify's rows scored one position late (row r scores the token at r with row r + 1)."""
    score_rows = outcomes_module.score_rows

    def late(logits, *args):
        return score_rows(logits.roll(-1, dims=0), *args)

    monkeypatch.setattr(outcomes_module, "score_rows", late)


def draft_rows(monkeypatch, engine, draft_model) -> None:
    """Planted error: the rows scored are the draft's at the same positions (verification still reads the
    target's)."""
    swapped, outcomes, score_rows = {}, engine_module.read_outcomes, outcomes_module.score_rows

    def with_draft_rows(decoding, firsts, proposals, *args):
        swapped.clear()
        for gen, rows in decoding + firsts:
            drafts = [int(t) for t in proposals.get(gen.id, ([], None))[0]]
            swapped[id(rows)] = draft_model.logits(gen.tokens + drafts)[-rows.shape[0]:].clone()
        return outcomes(decoding, firsts, proposals, *args)

    monkeypatch.setattr(engine_module, "read_outcomes", with_draft_rows)
    monkeypatch.setattr(outcomes_module, "score_rows", lambda logits, *a: score_rows(swapped[id(logits)], *a))


@pytest.mark.parametrize("plant", [shifted_rows, draft_rows])
def test_the_logprob_comparison_catches_wrong_rows(pair, tiny_model_path, monkeypatch, plant):
    target, draft = pair
    # A draft model of its own for the planted scorer, so its fresh sequences do not share the engine's draft.
    scorer = tandem.load(tiny_model_path(qtype="Q4_0", seed=SEED, **K_QUANT_SHAPES), backend="llama.cpp",
                         n_ctx=512, n_threads=1)
    requests = logprob_requests(target)
    engine = Engine(target, draft, slots=3, draft_max=DRAFT_MAX, measure_costs=False, prompt_lookup=False)
    plant(monkeypatch, engine, scorer)
    try:
        results = engine.generate(requests)
    finally:
        monkeypatch.undo()
        scorer.close()
    assert_speculated(*(r.stats for r in results), rejected=True)
    assert logprob_error(target, requests, results) > 1000 * TOLERANCE, plant.__name__
