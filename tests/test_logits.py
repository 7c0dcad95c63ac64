"""Logits processing (tandem.logits): structured output, logit_bias and penalties, exact under speculation and
batching, on tiny random models (so a structured answer can only come from constrained decoding), and through the
server with the official openai client."""

from __future__ import annotations

import json
import math

import httpx
import jsonschema
import llguidance
import pytest
import torch
from conftest import BOUNDED_SCHEMA, assert_speculated
from scipy.stats import chisquare
from test_server import LiveServer, assert_openai_error, load, stream_text

import tandem
from tandem.config import EngineConfig, ServerConfig
from tandem.engine import Engine, Request
from tandem.logits import adjust
from tandem.logits.grammar import GrammarError, json_grammar, ll_tokenizer, response_format_grammar, text_grammar
from tandem.logits.options import logits_settings
from tandem.logits.processor import LogitsError, LogitsSettings
from tandem.sampling import SamplingParams, probs_from_logits
from tandem.server.app import create_app

SCHEMA = BOUNDED_SCHEMA
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
PENALTIES = dict(frequency_penalty=0.7, presence_penalty=0.4, repeat_penalty=1.3, repeat_last_n=16)
PROMPTS = ["Tell me about Ada.", "def add(a, b):\n    return", "The quick brown fox"]
MAX_TOKENS = 400  # > the longest SCHEMA document: 16 blanks a gap between ~20 tokens of content


def generate(target, prompt, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return tandem.generate(target, prompt=prompt, **kw)


def valid(text: str) -> dict:
    document = json.loads(text)
    jsonschema.validate(document, SCHEMA)
    return document


# --- the adjustments, against their formulas ---------------------------------------------------------------

def test_adjustments_follow_openai_and_llamacpp_formulas():
    torch.manual_seed(0)
    logits = torch.randn(2, 40, dtype=torch.float64)
    biased = adjust.apply_bias(logits, torch.tensor([3, 7]), torch.tensor([5.0, -100.0]))
    assert biased[:, 3].tolist() == (logits[:, 3] + 5).tolist()
    assert biased[:, 7].tolist() == (logits[:, 7] - 100).tolist()
    assert torch.equal(biased[:, :3], logits[:, :3])

    counts = torch.zeros(2, 40, dtype=torch.float64)
    counts[0, 5], counts[1, 9] = 3, 1
    penalized = adjust.apply_frequency_presence(logits, counts, 0.5, 0.25)
    assert penalized[0, 5] == logits[0, 5] - 3 * 0.5 - 0.25 and penalized[1, 9] == logits[1, 9] - 0.5 - 0.25
    assert penalized[0, 9] == logits[0, 9]

    ids = torch.tensor([[1, 2, 2], [4, 4, 4]])
    repeated = adjust.apply_repeat_penalty(logits, ids, 1.5)
    for row, token in [(0, 1), (0, 2), (1, 4)]:
        x = logits[row, token]
        assert repeated[row, token] == (x / 1.5 if x > 0 else x * 1.5)
    assert repeated[0, 4] == logits[0, 4] and repeated[1, 1] == logits[1, 1]

    vocab = 70
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32)
    allowed = [[bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(2)]
    masked = adjust.apply_bitmask(torch.randn(2, vocab), bitmask)
    assert (masked > -math.inf).tolist() == allowed
    assert adjust.unpack_bitmask_torch(bitmask, vocab).tolist() == allowed  # the accelerators' unpacking


def test_settings_and_grammars_refuse_bad_input():
    with pytest.raises(LogitsError, match="logit_bias"):
        LogitsSettings({5: 101.0})
    with pytest.raises(LogitsError, match="frequency_penalty"):
        LogitsSettings(frequency_penalty=2.5)
    with pytest.raises(LogitsError, match="repeat_penalty"):
        LogitsSettings(repeat_penalty=0.0)
    with pytest.raises(LogitsError, match="out of range"):
        LogitsSettings({10**6: 1.0}).check_vocab(1000)
    with pytest.raises(GrammarError, match="nope"):
        json_grammar({"type": "nope"})
    with pytest.raises(GrammarError):
        text_grammar("root ::= (")
    with pytest.raises(GrammarError, match="type"):
        response_format_grammar({"type": "xml"})
    assert response_format_grammar({"type": "text"}) is None
    with pytest.raises(LogitsError, match="not both") as error:
        logits_settings(response_format={"type": "json_object"}, grammar='root ::= "a"')
    assert error.value.param == "grammar"
    assert logits_settings(logit_bias={"7": 1.5}).logit_bias == {7: 1.5}  # JSON's string keys
    assert logits_settings(response_format={"type": "text"}, logit_bias={}) is None
    assert not LogitsSettings().active and LogitsSettings(repeat_penalty=1.1).active


def test_json_grammars_bound_the_free_whitespace(pair64):
    from tandem.logits.grammar import WHITESPACE_BOUND, Matcher

    target, _ = pair64
    tokenizer = target.tokenizer
    brace, space = tokenizer.encode("{")[0], tokenizer.encode(" ")[0]
    for grammar in (json_grammar(), json_grammar(SCHEMA)):
        matcher = Matcher(grammar, tokenizer, target.vocab_size)
        assert matcher.extend([brace] + [space] * (WHITESPACE_BOUND + 5)) == 1 + WHITESPACE_BOUND


# --- structured output on the engine ---------------------------------------------------------------------------

def test_json_schema_output_validates_and_speculation_changes_nothing(pair64):
    target, draft = pair64
    plain = [generate(target, p, response_format=RESPONSE_FORMAT) for p in PROMPTS]
    for result in plain:
        valid(result.text)
        assert result.finish_reason == "stop"  # the grammar completed: the generation ends there
    unconstrained = generate(target, PROMPTS[0], max_tokens=20)
    with pytest.raises(json.JSONDecodeError):
        json.loads(unconstrained.text)  # the random model alone writes no JSON
    for source in (draft, "ngram"):
        spec = [generate(target, p, draft=source, draft_policy="fixed", draft_max=4, response_format=RESPONSE_FORMAT)
                for p in PROMPTS]
        assert [r.tokens for r in spec] == [r.tokens for r in plain]
        assert [r.text for r in spec] == [r.text for r in plain]
        assert_speculated(*(r.stats for r in spec), rejected=source != "ngram")


def test_json_object_and_gbnf_grammar(pair64):
    target, draft = pair64
    # Seeds whose documents close within max_tokens: an empty object, and one with a member (142 tokens).
    for seed, members in ((3, 0), (9, 1)):
        result = generate(target, PROMPTS[0], response_format={"type": "json_object"}, temperature=1.0, seed=seed,
                          max_tokens=200)
        assert result.text.lstrip().startswith("{") and result.finish_reason == "stop", (seed, result.finish_reason)
        document = json.loads(result.text)
        assert isinstance(document, dict) and len(document) == members, (seed, document)
    grammar = 'root ::= "answer: " ("yes" | "no") "."'
    for source in (None, draft):
        result = generate(target, PROMPTS[1], grammar=grammar, draft=source, draft_policy="fixed", max_tokens=20)
        assert result.text in ("answer: yes.", "answer: no.") and result.finish_reason == "stop"


def test_logprobs_of_constrained_tokens_are_the_targets_raw_ones(pair64):
    """Greedy under a schema picks the adjusted argmax, not the raw one: its logprob is that token's raw one."""
    target, draft = pair64
    prompt = target.tokenizer.encode(PROMPTS[0])
    settings = logits_settings(response_format=RESPONSE_FORMAT)
    for source in (None, draft):
        engine = Engine(target, source, draft_max=4)
        result = engine.generate([Request(prompt, max_tokens=30, draft_policy="fixed", logprobs=2,
                                          logits=settings)])[0]
        assert [e.token for e in result.logprobs] == result.tokens
        raw = torch.log_softmax(target.logits(prompt + result.tokens)[len(prompt) - 1 : -1].double(), dim=-1)
        expected = raw[torch.arange(len(result.tokens)), torch.tensor(result.tokens)]
        assert torch.allclose(torch.tensor([e.logprob for e in result.logprobs], dtype=torch.float64), expected)
        assert any(e.logprob < e.top[0][1] for e in result.logprobs)  # the grammar overrode the raw argmax


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
def test_greedy_speculative_equals_plain_with_bias_and_penalties(pair64, draft_kind):
    target, draft = pair64
    bias = {target.tokenizer.encode(" ")[0]: -100.0, target.tokenizer.encode("e")[0]: 3.0}
    # Negative penalties too: they make the output repeat itself, so drafts hold tokens the rows after them count.
    options = [dict(logit_bias=bias), dict(**PENALTIES), dict(logit_bias=bias, **PENALTIES),
               dict(frequency_penalty=-0.6, presence_penalty=-0.5), dict(repeat_penalty=1.5, repeat_last_n=-1)]
    source = draft if draft_kind == "model" else "ngram"
    raw = [generate(target, p, max_tokens=32).tokens for p in PROMPTS]
    stats = []
    for kw in options:
        plain = [generate(target, p, max_tokens=32, **kw) for p in PROMPTS]
        spec = [generate(target, p, max_tokens=32, draft=source, draft_policy="fixed", draft_max=4, **kw)
                for p in PROMPTS]
        assert [r.tokens for r in spec] == [r.tokens for r in plain], kw
        assert [r.tokens for r in plain] != raw, kw  # the adjustments change the output
        stats += [r.stats for r in spec]
    banned = next(iter(bias))
    assert all(banned not in generate(target, p, max_tokens=32, logit_bias=bias).tokens for p in PROMPTS)
    assert_speculated(*stats, rejected=draft_kind == "model")


def test_constrained_request_batched_beside_unconstrained_equals_alone(pair64):
    target, draft = pair64
    asks = [dict(), dict(response_format=RESPONSE_FORMAT), dict(**PENALTIES), dict(response_format=RESPONSE_FORMAT,
                                                                                  **PENALTIES), dict()]
    prompts = PROMPTS + PROMPTS[:2]
    alone = [generate(target, p, max_tokens=48, **kw) for p, kw in zip(prompts, asks, strict=True)]
    engine = Engine(target, draft, slots=3, draft_max=4, prefill_chunk=16)
    reqs = [Request(target.tokenizer.encode(p), max_tokens=48, draft_policy="fixed",
                    logits=logits_settings(**kw)) for p, kw in zip(prompts, asks, strict=True)]
    batched = engine.generate(reqs)
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert_speculated(*(r.stats for r in batched), rejected=True)


# --- the exact distribution under a grammar and penalties --------------------------------------------------

N_GENERATED = 4  # the first token, then a draft of 2 verified at rows 0, 1 and the bonus row 2, then one more
N_SAMPLES = 900
SAMPLING = dict(temperature=0.5, top_k=3)
GRAMMAR = "root ::= [a-f] [a-f] [a-f] [a-f] [a-f] [a-f] [a-f] [a-f]"


def reference_distribution(target, prompt, n_tokens, settings, params):
    """P(t1..tn) enumerated with the formulas written out here and a fresh llguidance matcher per prefix (none of
    tandem.logits' own code): what sequential sampling from the adjusted distribution gives."""
    ll = ll_tokenizer(target.tokenizer, target.vocab_size)
    dist = {(): 1.0}
    for _ in range(n_tokens):
        grown = {}
        for prefix, mass in dist.items():
            logits = target.logits(prompt + list(prefix))[-1].clone()
            for token, bias in settings.logit_bias.items():
                logits[token] += bias
            for token in set(prefix):
                logits[token] -= prefix.count(token) * settings.frequency_penalty + settings.presence_penalty
            for token in set((prompt + list(prefix))[-settings.repeat_last_n:]):
                x = logits[token]
                logits[token] = x / settings.repeat_penalty if x > 0 else x * settings.repeat_penalty
            if settings.grammar is not None:
                matcher = llguidance.LLMatcher(ll, settings.grammar.source, log_level=0)
                assert matcher.consume_tokens(list(prefix))
                if matcher.is_stopped():  # the grammar is complete: the generation ended with this prefix
                    grown[prefix] = mass
                    continue
                for token in range(target.vocab_size):
                    if matcher.validate_tokens([token]) == 0 or token in target.tokenizer.eos_token_ids:
                        logits[token] = -math.inf
            probs = probs_from_logits(logits[None], params)[0]
            for token in torch.nonzero(probs > 0).flatten().tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        dist = grown
    return dist


@pytest.mark.parametrize("constrained", [True, False], ids=["grammar-bias-penalties", "penalties"])
def test_sampled_speculation_matches_the_adjusted_distribution(tiny_model_path, constrained):
    target = tandem.load(tiny_model_path(seed=11), dtype="float32")
    draft = tandem.load(tiny_model_path(qtype="Q4_0", seed=11), dtype="float32")
    prompt = target.tokenizer.encode("Once upon a time abc")
    if constrained:
        settings = logits_settings(grammar=GRAMMAR, logit_bias={target.tokenizer.encode("a")[0]: 0.4}, **PENALTIES)
    else:  # negative penalties too: the rows after a draft then favour repeating it, which counting must follow
        settings = logits_settings(frequency_penalty=-0.8, presence_penalty=0.5, repeat_penalty=1.4,
                                   repeat_last_n=4)
    dist = reference_distribution(target, prompt, N_GENERATED, settings, SamplingParams(**SAMPLING))
    engine = Engine(target, draft, slots=4, draft_max=2)
    counts, stats = {}, []
    mate = target.tokenizer.encode("The quick brown fox")
    for batch in range(N_SAMPLES // 3):
        reqs = [Request(prompt, SamplingParams(seed=3 * batch + i, **SAMPLING), max_tokens=N_GENERATED,
                        ignore_eos=True, draft_policy="fixed", logits=settings) for i in range(3)]
        reqs.append(Request(mate, SamplingParams(temperature=1.0, seed=batch), max_tokens=N_GENERATED + batch % 3,
                            draft_policy="fixed"))
        for r in engine.generate(reqs)[:3]:
            counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
            stats.append(r.stats)
    assert_speculated(*stats, rejected=True)
    assert set(counts) <= set(dist), "sampled a sequence the adjusted distribution gives probability 0"
    cells = sorted(dist)
    observed = [counts.get(c, 0) for c in cells]
    expected = [dist[c] / sum(dist.values()) * N_SAMPLES for c in cells]
    p = chisquare(observed, expected).pvalue
    assert p > 1e-3, f"speculative sampling departs from the adjusted distribution (p={p:.3g})"


# --- the server, with the official openai client -------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tiny_model_path):
    path, draft_path = tiny_model_path(seed=0), tiny_model_path(qtype="Q4_0", seed=0)
    spec = create_app(load(path), load(draft_path), engine=EngineConfig(draft_max=4, draft_policy="fixed", slots=2),
                      server=ServerConfig(model_name="tiny"))
    plain = create_app(load(path), None, engine=EngineConfig(slots=2), server=ServerConfig(model_name="tiny"))
    with LiveServer(spec) as spec_server, LiveServer(plain) as plain_server:
        yield spec_server, plain_server


def test_server_json_schema_with_and_without_a_draft_streaming_too(servers):
    spec_server, plain_server = servers
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    texts = []
    for server in (plain_server, spec_server):
        client = server.client()
        response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, response_format=RESPONSE_FORMAT)
        valid(response.choices[0].message.content)
        assert response.choices[0].finish_reason == "stop"
        streamed, chunks = stream_text(client, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       response_format=RESPONSE_FORMAT)
        assert streamed == response.choices[0].message.content
        texts.append(streamed)
        if server is spec_server:
            assert_speculated(response.model_extra["timings"])
        completion = client.completions.create(model="tiny", prompt="JSON:", max_tokens=MAX_TOKENS, temperature=0.8,
                                               seed=5, extra_body={"response_format": RESPONSE_FORMAT})
        valid(completion.choices[0].text)
    assert texts[0] == texts[1]  # greedy: the draft changes nothing


def test_server_bias_penalties_and_grammar_fields(servers):
    spec_server, plain_server = servers
    client = spec_server.client()
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0)
    raw = client.completions.create(**kw).choices[0].text
    first = spec_server.server.config.app.state.server.target.tokenizer.encode(raw)[0]
    banned = client.completions.create(**kw, logit_bias={str(first): -100}, frequency_penalty=0.5,
                                       presence_penalty=0.5, extra_body={"repeat_penalty": 1.2})
    plain = plain_server.client().completions.create(**kw, logit_bias={str(first): -100}, frequency_penalty=0.5,
                                                     presence_penalty=0.5, extra_body={"repeat_penalty": 1.2})
    assert banned.choices[0].text == plain.choices[0].text != raw
    grammar = client.completions.create(**kw, extra_body={"grammar": 'root ::= "x" [0-9] [0-9] ";"'})
    text = grammar.choices[0].text
    assert len(text) == 4 and text[0] == "x" and text[1:3].isdigit() and text[3] == ";"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
])
def test_server_refuses_bad_schemas_grammars_bias_and_penalties(servers, body, param):
    server = servers[1]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body})
    assert_openai_error(r, 400, param)


def test_cli_generate_takes_a_json_schema_and_a_grammar(tiny_model_path, tmp_path, capsys):
    from tandem.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    base = ["generate", "--model", tiny_model_path(seed=0), "--backend", "torch", "--prompt", "hi", "--json",
            "--max-tokens", str(MAX_TOKENS)]
    assert main(base + ["--json-schema", f"@{schema_file}"]) == 0
    out = json.loads(capsys.readouterr().out)
    valid(out["text"])
    assert main(base + ["--grammar", 'root ::= "yes" | "no"']) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")
