"""The draft side of structured output, checked directly (issue 51, item 5; docs/structured-output.md): every token a
draft model proposes under a request's JSON schema is one the grammar allows at its prefix, and prompt-lookup
proposals are cut exactly at the first token the grammar forbids.

The check is a fresh llguidance matcher a proposal, built here from the grammar's source (not the engine's Matcher
with its tentative advance and rollback): it consumes the tokens generated so far, then must accept the drafts one
by one. Negative controls: a draft model proposing without the request's processor, and lookup without the cut
(`LogitsProcessor.usable` returning the full length), must fail the same checks.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from conftest import assert_speculated

import tandem
from tandem.engine import Engine, Request
from tandem.engine import drafter as drafter_module
from tandem.logits.grammar import COMPACT_JSON
from tandem.logits.options import logits_settings
from tandem.logits.processor import LogitsProcessor
from tandem.sampling import SamplingParams
from tandem.speculative.proposer import NgramProposer

llguidance = pytest.importorskip("llguidance")

SEED = 3
MAX_TOKENS = 40
# Free structure for a random model to fill (a string, an integer, an array), under the default bounded whitespace.
DRAFT_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                 "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                                 "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                          "maxItems": 2}},
                "required": ["name", "n", "tags"], "additionalProperties": False}
# The same, compact (no free whitespace): a random model's output then reaches the integer and the array.
DRAFT_SCHEMAS = [DRAFT_SCHEMA, {**DRAFT_SCHEMA, "x-guidance": COMPACT_JSON}]
DRAFT_PROMPTS = ["Describe it as JSON:", "{\"name\": \"tandem\", \"items\": [1, 2,"]
# Lookup copies the prompt's JSON, which this schema accepts only in part: "tandem" is too long for the name, the
# id too large, "tags" not a property. Compact JSON (no free whitespace) keeps the output close to the prompt's.
LOOKUP_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                                  "id": {"type": "integer", "maximum": 99}},
                 "required": ["name", "id"], "additionalProperties": False, "x-guidance": COMPACT_JSON}
LOOKUP_PROMPT = 'Reply {"name": "tandem", "id": 12345, "tags": ["a"]} or {"name": "tango", "id": 7}.'
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, seed=5)]


class FreshMatchers:
    """A new llguidance matcher for every prefix, over its own view of the model's vocabulary."""

    def __init__(self, model) -> None:
        tokenizer = model.tokenizer
        self.stop_token_ids = frozenset(tokenizer.eos_token_ids)
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=model.vocab_size,
                                                   eos_token=list(tokenizer.eos_token_ids))

    def at(self, source: str, generated: list[int]):
        """A matcher of grammar `source` that has consumed `generated`."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, source, log_level=0)
        assert matcher.consume_tokens(generated), f"the target's own tokens {generated} leave the grammar"
        return matcher

    def allowed(self, source: str, generated: list[int], tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows after `generated`: up to the first it forbids or the first
        stop token (a proposal never holds one: the engine ends a sequence there)."""
        n = self.at(source, generated).validate_tokens(tokens)
        return next((i for i, t in enumerate(tokens[:n]) if t in self.stop_token_ids), n)


def record_proposals(engine: Engine, monkeypatch) -> list[tuple[str, list[int], list[int], list[int] | None]]:
    """Records, for every proposal the engine makes: (its request's grammar source, tokens generated before it, the
    drafts given to the verifier, the lookup's uncut continuation or None for a draft model's drafts)."""
    records, continuations, propose = [], [], engine.proposers.propose

    def continuation(self, tokens, k, original=NgramProposer.continuation):
        out = original(self, tokens, k)
        continuations.append(list(out))
        return out

    def recording(decoding, ks, keep_on_device, timed):
        start = len(continuations)
        proposals, drafted = propose(decoding, ks, keep_on_device, timed)
        raw = iter(continuations[start:])  # one a sequence that looked up, in the order of decoding
        for gen, k in zip(decoding, ks, strict=True):
            drafts = proposals[gen.id][0]
            drafts = drafts.tolist() if isinstance(drafts, torch.Tensor) else list(drafts)
            looked_up = k and gen.draft_source != drafter_module.DRAFT_MODEL
            if drafts or looked_up:
                records.append((gen.request.logits.grammar.source, gen.tokens[gen.prompt_len :], drafts,
                                next(raw) if looked_up else None))
        return proposals, drafted

    monkeypatch.setattr(engine.proposers, "propose", recording)
    monkeypatch.setattr(NgramProposer, "continuation", continuation)
    return records


@pytest.fixture(scope="module")
def pair(tiny_model_path):
    target = tandem.load(tiny_model_path(seed=SEED), dtype="float32")
    draft = tandem.load(tiny_model_path(qtype="Q4_0", seed=SEED), dtype="float32")
    return target, draft


def run_draft_model(pair, monkeypatch, slots: int) -> tuple[list, list, FreshMatchers]:
    """Every prompt under every sampling and both schemas, drafting 4 a step; `slots` at once."""
    target, draft = pair
    engine = Engine(target, draft, slots=slots, draft_max=4, measure_costs=False)
    records = record_proposals(engine, monkeypatch)
    requests = [Request(target.tokenizer.encode(prompt), sampling, max_tokens=MAX_TOKENS, draft_policy="fixed",
                        logits=logits_settings(json_schema=schema))
                for schema in DRAFT_SCHEMAS for prompt in DRAFT_PROMPTS for sampling in SAMPLINGS]
    results = []
    with contextlib.suppress(RuntimeError):  # a control's drafts may leave the grammar: the engine refuses them
        for i in range(0, len(requests), slots):
            results += engine.generate(requests[i : i + slots])
    return records, results, FreshMatchers(target)


def assert_drafts_in_grammar(records, matchers: FreshMatchers) -> None:
    for source, generated, drafts, _ in records:
        n = matchers.allowed(source, generated, drafts)
        assert n == len(drafts), f"draft {n} ({drafts[n]}) of {drafts} is outside the grammar after {generated}"


@pytest.mark.parametrize("slots", [1, 3])
def test_a_draft_models_proposals_stay_in_the_grammar(pair, monkeypatch, slots):
    records, results, matchers = run_draft_model(pair, monkeypatch, slots)
    assert len(results) == len(DRAFT_SCHEMAS) * len(DRAFT_PROMPTS) * len(SAMPLINGS)
    assert_drafts_in_grammar(records, matchers)
    assert sum(len(d) for _, _, d, _ in records) == sum(r.stats.draft_tokens for r in results) > 200
    assert_speculated(*(r.stats for r in results), rejected=True)
    for r, (schema, _, _) in zip(results, itertools.product(DRAFT_SCHEMAS, DRAFT_PROMPTS, SAMPLINGS), strict=True):
        matchers.at(logits_settings(json_schema=schema).grammar.source, r.tokens)  # the output too
    assert any(r.finish_reason == "stop" for r in results)  # some ran to the grammar's end


def test_drafts_without_the_grammar_fail_the_check(pair, monkeypatch):
    # The planted error: the draft model proposes from its raw logits, its sequences' processors hidden from it.
    draft = drafter_module.Drafter.draft

    def unconstrained(self, drafting, keep_on_device=False):
        processors = {i: gen.processor for i, (gen, _) in drafting.items()}
        for gen, _ in drafting.values():
            gen.processor = None
        try:
            return draft(self, drafting, False)
        finally:
            for i, (gen, _) in drafting.items():
                gen.processor = processors[i]

    monkeypatch.setattr(drafter_module.Drafter, "draft", unconstrained)
    records, _, matchers = run_draft_model(pair, monkeypatch, slots=1)
    with pytest.raises(AssertionError, match="outside the grammar"):
        assert_drafts_in_grammar(records, matchers)


def run_lookup(pair, monkeypatch) -> tuple[list, list, FreshMatchers]:
    target, _ = pair
    settings = logits_settings(json_schema=LOOKUP_SCHEMA)
    engine = Engine(target, "ngram", slots=1, draft_max=8, measure_costs=False)
    records = record_proposals(engine, monkeypatch)
    ids = target.tokenizer.encode(LOOKUP_PROMPT)
    results = []
    with contextlib.suppress(RuntimeError):  # uncut proposals (the control): the engine refuses them
        for sampling in SAMPLINGS:
            results += engine.generate([Request(ids, sampling, max_tokens=MAX_TOKENS, draft_policy="fixed",
                                                logits=settings)])
    return records, results, FreshMatchers(target)


def assert_cut_at_first_refusal(records, matchers: FreshMatchers) -> tuple[int, int]:
    """Each lookup proposal is its continuation up to (not including) the first token the grammar refuses.
    Returns (proposals cut short with some tokens left, proposals cut to nothing)."""
    cut, emptied = 0, 0
    for source, generated, drafts, raw in records:
        assert raw is not None
        expected = raw[: matchers.allowed(source, generated, raw)]
        assert drafts == expected, f"lookup proposed {drafts} of {raw} after {generated}; the grammar allows {expected}"
        cut += 0 < len(drafts) < len(raw)
        emptied += len(raw) > 0 and not drafts
    return cut, emptied


def test_lookup_proposals_are_cut_at_the_first_forbidden_token(pair, monkeypatch):
    records, results, matchers = run_lookup(pair, monkeypatch)
    assert len(results) == len(SAMPLINGS)
    cut, emptied = assert_cut_at_first_refusal(records, matchers)
    assert cut >= 3 and emptied >= 1, (cut, emptied)  # the cut happened mid-proposal and at its first token
    assert sum(len(d) for _, _, d, _ in records) == sum(r.stats.draft_tokens for r in results)
    assert_speculated(*(r.stats for r in results))


def test_lookup_without_the_cut_fails_the_check(pair, monkeypatch):
    monkeypatch.setattr(LogitsProcessor, "usable", lambda self, drafts: len(drafts))
    records, _, matchers = run_lookup(pair, monkeypatch)
    with pytest.raises(AssertionError, match="the grammar allows"):
        assert_cut_at_first_refusal(records, matchers)
