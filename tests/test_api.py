"""The OpenAI API surface of `tandem serve`, with the official openai client on tiny random models: the described API
(/openapi.json), whole-number floats, served names, /v1/models/{id}, n choices, echo, the parameters that are a 400,
and tools end to end (rendered into the prompt; the model's tool-call text parsed, streamed as deltas)."""

from __future__ import annotations

import itertools
import json
import re
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from conftest import assert_speculated
from test_server import CHAT, PROMPTS, LiveServer, assert_openai_error, health, load, metric, metrics_of, wait_for
from test_tools import (
    CALC_CONVERSATION,
    CALC_TOOL,
    HERMES_TEMPLATE,
    LLAMA3_TEMPLATE,
    PYTHON_TOOL,
    TEST_TOOL,
    WEATHER_TOOL,
)

import tandem
from tandem.config import EngineConfig, ServerConfig
from tandem.engine import GenerationChunk
from tandem.loading.tokenizer import StreamDecoder, Tokenizer
from tandem.server.app import create_app
from tandem.speculative.stats import GenerationStats

# A Gemma-4-style template written for these tests: tools declared in the system turn, an assistant's calls in
# Gemma 4's <|tool_call>call:name{...}<tool_call|> notation.
GEMMA4_TEMPLATE = (
    "{% if tools %}<|turn>system\n{% for t in tools %}<|tool>declaration:{{ t.function.name }}<tool|>{% endfor %}"
    "<turn|>\n{% endif %}{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{}<tool_call|>{% endfor %}"
    "{{ m.content or '' }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def paths(tiny_model_path):
    return tiny_model_path(seed=0), tiny_model_path(qtype="Q4_0", seed=0)


@pytest.fixture(scope="module")
def server(paths):
    """Speculative (fixed k, so every request drafts), 4 slots: n choices decode in one batch."""
    app = create_app(load(paths[0]), load(paths[1]), engine=EngineConfig(draft_max=3, draft_policy="fixed", slots=4),
                     server=ServerConfig(model_name="tiny", aliases=("tiny-alias",)))
    with LiveServer(app) as live:
        yield live


def post(live: LiveServer, path: str, **body) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=120)


# --- the described API ----------------------------------------------------------------------------------------

def test_openapi_describes_every_endpoint_and_body(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id}", "/health",
            "/metrics"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]

    def resolve(schema: dict) -> dict:
        return schemas[schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema

    for path, model, fields in (("/v1/chat/completions", "ChatCompletionRequest", {"messages", "tools", "n"}),
                                ("/v1/completions", "CompletionRequest", {"prompt", "echo", "n", "max_tokens"})):
        operation = doc["paths"][path]["post"]
        body = resolve(operation["requestBody"]["content"]["application/json"]["schema"])
        assert body is schemas[model] and fields <= set(body["properties"]), (path, sorted(body["properties"]))
        assert set(operation["responses"]) >= {"200", "400"} and "422" not in operation["responses"]
        assert resolve(operation["responses"]["400"]["content"]["application/json"]["schema"])["title"] == (
            "ErrorResponse")
    message = schemas["ChatMessage"]["properties"]
    assert {"role", "content", "tool_calls", "tool_call_id"} <= set(message)
    # Integer fields are JSON Schema integers, which is why 8.0 is accepted (test below).
    max_tokens = schemas["ChatCompletionRequest"]["properties"]["max_tokens"]
    assert {"type": "integer", "minimum": 1} in max_tokens["anyOf"]
    assert "422" not in json.dumps(doc["paths"]) and "HTTPValidationError" not in schemas
    # No /docs page: FastAPI's loads its scripts from a CDN (a blank page offline, a third party's code on this origin).
    assert httpx.get(f"{server.url}/docs").status_code == 404


def test_whole_number_floats_are_integers(server):
    body = {"prompt": PROMPTS[0], "temperature": 0}
    ints = post(server, "/v1/completions", **body, max_tokens=8, n=2, top_k=5, seed=3).json()
    floats = post(server, "/v1/completions", **body, max_tokens=8.0, n=2.0, top_k=5.0, seed=3.0).json()
    assert [c["text"] for c in floats["choices"]] == [c["text"] for c in ints["choices"]]
    assert floats["usage"]["completion_tokens"] == ints["usage"]["completion_tokens"]
    for field, value in (("max_tokens", 8.5), ("n", 2.5), ("top_k", 1e-3), ("seed", 0.5)):
        assert_openai_error(post(server, "/v1/completions", **body, **{field: value}), 400, field)
    assert_openai_error(post(server, "/v1/completions", **body, max_tokens=True), 400, "max_tokens")


# --- the model's name ------------------------------------------------------------------------------------------

def test_models_retrieve_by_id_and_alias(server):
    client = server.client()
    assert client.models.retrieve("tiny").id == "tiny"
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    error = assert_openai_error(httpx.get(f"{server.url}/v1/models/org/gpt-4"), 404, "model")
    assert error["code"] == "model_not_found"
    assert client.chat.completions.create(model="tiny-alias", messages=CHAT, max_tokens=2).model == "tiny"


def serve_app(monkeypatch, *args: str):
    """The app `tandem serve ARGS` builds, served by the test (serve()'s own uvicorn server is skipped)."""
    import tandem.server.serve as serve_module
    from tandem.cli import main

    apps = []
    monkeypatch.setattr(serve_module.DrainingServer, "run", lambda self, **kw: apps.append(self.config.app))
    monkeypatch.setattr(serve_module.signal, "signal", lambda *a: None)
    assert main(["serve", "--backend", "torch", "--no-draft", "--port", "0", *args]) == 0
    return apps[0]


def test_served_name_is_the_file_stem_or_served_model_name_never_a_path(paths, monkeypatch):
    stem = paths[0].rsplit("/", 1)[1].removesuffix(".gguf")
    with LiveServer(serve_app(monkeypatch, "--model", paths[0])) as live:
        wait_for(lambda: health(live)["status"] == "ok", "the model to load")
        client = live.client()
        assert [m.id for m in client.models.list().data] == [stem]
        for name in (stem, paths[0], None):  # the path as typed is still accepted; the answer names the stem
            r = post(live, "/v1/completions", prompt="hi", max_tokens=1, **({"model": name} if name else {}))
            assert r.status_code == 200 and r.json()["model"] == stem, (name, r.text)
    with LiveServer(serve_app(monkeypatch, "--model", paths[0], "--served-model-name", "coder",
                              "--served-model-name", "org/coder-v2")) as live:
        wait_for(lambda: health(live)["status"] == "ok", "the model to load")
        client = live.client()
        assert [m.id for m in client.models.list().data] == ["coder"]
        assert client.models.retrieve("org/coder-v2").id == "org/coder-v2"
        answer = client.completions.create(model="org/coder-v2", prompt="hi", max_tokens=1)
        assert answer.model == "coder"
        metrics = httpx.get(f"{live.url}/metrics").text
        assert 'model_name="coder"' in metrics and "/" not in re.findall(r'model_name="([^"]*)"', metrics)[0]


# --- n ----------------------------------------------------------------------------------------------------------

def test_n_greedy_choices_are_identical_and_batched(server):
    client = server.client()
    one = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
    before = metrics_of(server)
    three = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0, n=3)
    after = metrics_of(server)
    # Decoded together: every engine step of the request ran its three sequences (tandem_batch_size observes the
    # sequences in each step; nothing else runs meanwhile).
    steps, sequences = (metric(after, name) - metric(before, name)
                        for name in ("tandem_batch_size_count", "tandem_batch_size_sum"))
    assert steps > 0 and sequences == 3 * steps, (steps, sequences)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    per_choice = [c.model_extra["timings"] for c in three.choices]
    assert_speculated(*per_choice)
    assert sum(t["predicted_n"] for t in per_choice) == three.usage.completion_tokens


def test_n_seeded_sampling_is_reproducible_and_choices_differ(server):
    client = server.client()
    kw = dict(model="tiny", messages=CHAT, max_tokens=8, temperature=1.0, seed=11)
    first = [c.message.content for c in client.chat.completions.create(n=3, **kw).choices]
    again = [c.message.content for c in client.chat.completions.create(n=3, **kw).choices]
    assert first == again
    assert len(set(first)) == 3, first  # each choice its own seed (fixed by the request seed: no flakiness)
    assert client.chat.completions.create(n=1, **kw).choices[0].message.content == first[0]
    streamed = {i: "" for i in range(3)}
    for chunk in client.chat.completions.create(n=3, stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == first


def test_n_streamed_completions_carry_their_index_and_usage(server):
    client = server.client()
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0.8, seed=2, n=2)
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0.8, seed=2,
                                           n=2, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert set(finishes) == {0, 1} and usage.completion_tokens == whole.usage.completion_tokens


def test_n_is_bounded(server):
    for n in (0, 17, -1):
        error = assert_openai_error(post(server, "/v1/chat/completions", messages=CHAT, n=n), 400, "n")
        assert "n" in error["message"]


# --- echo --------------------------------------------------------------------------------------------------------

def test_echo_prepends_the_prompt_streamed_and_not(server):
    client = server.client()
    plain = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=6, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[2] + plain.choices[0].text
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (plain.usage.prompt_tokens,
                                                                            plain.usage.completion_tokens)
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=6, temperature=0, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_openai_does(server, paths):
    target = load(paths[0])
    ids = target.tokenizer.encode(PROMPTS[0])
    client = server.client()
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    n_prompt, n_new = len(ids), r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + n_new
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    expected = torch.log_softmax(target.logits(ids), dim=-1)  # row i predicts token i + 1
    for i in range(1, n_prompt):
        assert lp.token_logprobs[i] == pytest.approx(float(expected[i - 1, ids[i]]), abs=1e-6)
        best = expected[i - 1].topk(2).values.tolist()  # a dict: pieces that decode alike ("\ufffd") merge
        assert 1 <= len(lp.top_logprobs[i]) <= 2
        assert all(any(abs(v - b) < 1e-6 for b in best) for v in lp.top_logprobs[i].values())
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == list(itertools.accumulate([0] + [len(t) for t in lp.tokens[:-1]]))
    # The completion's own logprobs follow, as without echo.
    alone = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    assert lp.token_logprobs[n_prompt:] == pytest.approx(alone.choices[0].logprobs.token_logprobs, abs=1e-9)
    # max_tokens 0: score the prompt, generate nothing (how evaluation harnesses ask for log-likelihoods).
    scored = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n_prompt], abs=1e-9)
    assert scored.usage.completion_tokens == 0 and scored.choices[0].finish_reason == "length"
    stream = list(client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0,
                                            stream=True))
    assert [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == (
        lp.tokens[:n_prompt])


# --- what is a 400 -------------------------------------------------------------------------------------------

UNSUPPORTED = [  # (path, extra fields, param)
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "}"}, "suffix"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    # The tiny models' template (ChatML without tools) would drop the tools: a 400, not silence.
    ("/v1/chat/completions", {"tools": [TEST_TOOL]}, "tools"),
]


@pytest.mark.parametrize("messages", [  # llama.cpp's test_invalid_chat_completion_req (it allows a 500; we do not)
    None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
    [{"role": "system", "content": "test"}, {}],
    [{"role": "assistant", "content": None}], [{"role": "tool", "content": None, "tool_call_id": "x"}],
    [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}],
])
def test_invalid_messages_are_400s(server, messages):
    assert_openai_error(post(server, "/v1/chat/completions", messages=messages), 400)


def test_parameters_that_cannot_be_honoured_are_400s(server):
    for path, extra, param in UNSUPPORTED:
        source = {"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "hi"}
        error = assert_openai_error(post(server, path, **source, **extra), 400, param)
        assert param in error["message"], error
    # Their neutral values ask for nothing, so they pass (clients send them by default).
    neutral = {"best_of": 1, "suffix": "", "store": False, "modalities": ["text"], "parallel_tool_calls": True}
    for path, fields in (("/v1/completions", {"prompt": "hi", "best_of": 1, "suffix": ""}),
                         ("/v1/chat/completions", {"messages": CHAT, **{k: v for k, v in neutral.items()
                                                                         if k not in ("best_of", "suffix")}})):
        assert post(server, path, **fields, max_tokens=1).status_code == 200, (path, fields)


# --- tools end to end -------------------------------------------------------------------------------------------

class ScriptedEngine:
    """Stands in for the engine: every request "generates" the tokens of `text`, two a step, so what the server makes
    of a model's tool-call text is tested on exact texts cut at token boundaries (no random model writes them)."""

    def __init__(self, tokenizer: Tokenizer, text: str, slots: int = 4) -> None:
        self.tokenizer, self.tokens, self.slots = tokenizer, tokenizer.encode(text, add_bos=False), slots
        self.active: list = []
        self.ids = itertools.count()

    def add(self, request):
        gen = SimpleNamespace(id=next(self.ids), request=request, at=0, decoder=StreamDecoder(self.tokenizer))
        self.active.append(gen)
        return gen

    def cancel(self, gen) -> None:
        if gen in self.active:
            self.active.remove(gen)

    def step(self):
        events = []
        for gen in list(self.active):
            new = self.tokens[gen.at:gen.at + 2]
            gen.at += len(new)
            text = "".join(gen.decoder.push(t) for t in new)
            if gen.at < len(self.tokens):
                events.append((gen, GenerationChunk(text, new)))
                continue
            self.active.remove(gen)
            stats = GenerationStats(prompt_tokens=len(gen.request.prompt), generated_tokens=len(self.tokens))
            events.append((gen, GenerationChunk(text + gen.decoder.flush(), new, "stop", stats)))
        return events


@pytest.fixture(scope="module")
def tool_paths(tiny_model_path):
    return {name: tiny_model_path(seed=0, context_length=2048, metadata={"tokenizer.chat_template": template})
            for name, template in (
        ("hermes", HERMES_TEMPLATE), ("llama3", LLAMA3_TEMPLATE), ("gemma4", GEMMA4_TEMPLATE))}


def rendered_prompts(monkeypatch) -> list[str]:
    """Every prompt text a chat template renders from now on."""
    texts, real = [], Tokenizer.apply_chat_template

    def spy(self, *args, **kwargs):
        texts.append(real(self, *args, **kwargs))
        return texts[-1]

    monkeypatch.setattr(Tokenizer, "apply_chat_template", spy)
    return texts


def test_tool_turns_are_accepted_and_rendered(tool_paths, monkeypatch):
    """An agent loop's next step: the assistant's call (content null) and the tool's answer reach the template; the
    prompt the model reads holds the tools, the call and the result."""
    target = load(tool_paths["hermes"])
    prompts = rendered_prompts(monkeypatch)
    with LiveServer(create_app(target, None, engine=EngineConfig(slots=1),
                               server=ServerConfig(model_name="tiny"))) as live:
        client = live.client()
        r = client.chat.completions.create(model="tiny", messages=CALC_CONVERSATION, tools=[CALC_TOOL], max_tokens=4,
                                           temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
        text = prompts[-1]
        assert json.dumps(CALC_TOOL, ensure_ascii=False) in text
        assert '{"name": "calculate", "arguments": {"expression": "sin(30 * pi / 180)"}}' in text
        assert "<tool_response>\n0.55644242476\n</tool_response>" in text
        assert r.usage.prompt_tokens == len(target.tokenizer.encode(text, add_bos=False))
        # tool_choice "none": the tools are not offered (OpenAI: the model calls none); the history still renders.
        client.chat.completions.create(model="tiny", messages=CALC_CONVERSATION, tools=[CALC_TOOL], max_tokens=1,
                                       tool_choice="none")
        assert "<tools>" not in prompts[-1] and "<tool_response>" in prompts[-1]
        # llama.cpp's test_completion_without_tool_call: a model that writes no call gets no tool_calls.
        for tools, choice in (([TEST_TOOL], None), ([PYTHON_TOOL], "none"), ([WEATHER_TOOL], "auto")):
            for stream in (False, True):
                kw = dict(model="tiny", messages=CHAT, tools=tools, max_tokens=12, temperature=0, stream=stream)
                if choice:
                    kw["tool_choice"] = choice
                answer = client.chat.completions.create(**kw)
                if stream:
                    assert not any(c.choices and c.choices[0].delta.tool_calls for c in answer)
                else:
                    assert answer.choices[0].message.tool_calls is None


# Tight parameters, so a random-weight model's constrained call is complete well within max_tokens.
UNIT_TOOL = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "loud": {"type": "boolean"}},
    "required": ["unit", "loud"], "additionalProperties": False}}}
MODE_TOOL = {"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "properties": {"mode": {"enum": ["a", "b", "c"]}}, "required": ["mode"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("family", ["hermes", "gemma4"])
def test_forced_tool_choice_is_constrained_to_a_valid_call(family, tool_paths, tiny_model_path):
    """tool_choice "required" and a named function: a random-weight model (which never writes a call by itself)
    answers with calls that match the tools' schemas, whatever the template's call format, with and without a
    draft, streamed as the same deltas; greedy speculative == plain."""
    jsonschema = pytest.importorskip("jsonschema")
    target = load(tool_paths[family])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (UNIT_TOOL, MODE_TOOL)}
    answers = {}
    for draft in (None, load(tiny_model_path(qtype="Q4_0", seed=0, context_length=2048))):
        with LiveServer(create_app(target, draft, engine=EngineConfig(slots=1, draft_policy="fixed", draft_max=3),
                                   server=ServerConfig(model_name="tiny"))) as live:
            client = live.client()
            for choice, parallel in (("required", None), ("required", False),
                                     ({"type": "function", "function": {"name": "set_mode"}}, None)):
                kw = dict(model="tiny", messages=CHAT, tools=[UNIT_TOOL, MODE_TOOL], tool_choice=choice,
                          max_tokens=1000, temperature=0)
                if parallel is not None:
                    kw["parallel_tool_calls"] = parallel
                whole = client.chat.completions.create(**kw).choices[0]
                assert whole.finish_reason == "tool_calls" and not whole.message.content, (choice, parallel, whole)
                calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
                assert calls and (parallel is not False or len(calls) == 1)
                for name, arguments in calls:
                    jsonschema.validate(arguments, schemas[name])
                if isinstance(choice, dict):
                    assert {name for name, _ in calls} == {"set_mode"}
                streamed = {}
                for chunk in client.chat.completions.create(stream=True, **kw):
                    for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                        slot = streamed.setdefault(d.index, ["", ""])
                        slot[0] += d.function.name or ""
                        slot[1] += d.function.arguments or ""
                assert [(n, json.loads(a)) for n, a in (streamed[i] for i in sorted(streamed))] == calls
                answers.setdefault((str(choice), parallel), []).append(calls)
            # A forced call and another constraint on the same reply: a clear 400.
            r = post(live, "/v1/chat/completions", messages=CHAT, tools=[UNIT_TOOL], tool_choice="required",
                     response_format={"type": "json_object"})
            assert "constrains the reply to a tool call" in assert_openai_error(r, 400, "response_format")["message"]
    assert all(plain == spec for plain, spec in answers.values())


CALL_TEXTS = {  # what each family's model writes: two calls (one for llama3, whose calls are the whole reply)
    "hermes": 'I will check.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Istanbul"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "python", "arguments": {"code": "print(\\"é\\")"}}\n</tool_call>',
    "llama3": '{"name": "get_current_weather", "parameters": {"location": "Istanbul"}}; '
              '{"name": "python", "parameters": {"code": "print(\\"é\\")"}}',
    "gemma4": 'I will check.<|tool_call>call:get_current_weather{location:<|"|>Istanbul<|"|>}<tool_call|>'
              '<|tool_call>call:python{code:<|"|>print("é")<|"|>}<tool_call|>',
}
EXPECTED_CALLS = [("get_current_weather", {"location": "Istanbul"}), ("python", {"code": 'print("é")'})]


@pytest.mark.parametrize("family", ["hermes", "llama3", "gemma4"])
def test_tool_calls_parsed_and_streamed_as_deltas(family, tool_paths):
    target = load(tool_paths[family])
    app = create_app(target, None, engine=EngineConfig(slots=2), server=ServerConfig(model_name="tiny"))
    app.state.server.scheduler.attach(ScriptedEngine(target.tokenizer, CALL_TEXTS[family]))
    with LiveServer(app) as live:
        client = live.client()
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Istanbul?"}],
                  tools=[WEATHER_TOOL, PYTHON_TOOL])
        whole = client.chat.completions.create(**kw)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == (None if family == "llama3" else "I will check.")
        calls = choice.message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED_CALLS
        assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
        assert len({c.id for c in calls}) == 2
        # Streamed: OpenAI's deltas, merged by index as clients merge them, give the same answer.
        content, merged, finish = "", {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                slot = merged.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += d.id or ""
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
            assert "tool_call" not in (delta.content or "") and "python_tag" not in (delta.content or "")
        assert finish == "tool_calls" and content == (choice.message.content or "")
        assert [(merged[i]["name"], json.loads(merged[i]["arguments"])) for i in sorted(merged)] == EXPECTED_CALLS
        assert all(m["id"].startswith("call_") for m in merged.values())
        # n choices each parse their own calls; tool_choice "none" leaves the text as it is.
        three = client.chat.completions.create(n=3, **kw)
        assert all(len(c.message.tool_calls) == 2 and c.finish_reason == "tool_calls" for c in three.choices)
        # parallel_tool_calls false: the first call ends the choice (its generation is stopped there).
        for stream in (False, True):
            answer = client.chat.completions.create(parallel_tool_calls=False, stream=stream, **kw)
            if stream:
                chunks = [c.choices[0] for c in answer if c.choices]
                got = [d for c in chunks for d in c.delta.tool_calls or []]
                finish = [c.finish_reason for c in chunks if c.finish_reason]
            else:
                got, finish = answer.choices[0].message.tool_calls, [answer.choices[0].finish_reason]
            assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == EXPECTED_CALLS[:1]
            assert finish == ["tool_calls"]
        assert health(live).items() >= {"status": "ok", "queue_depth": 0, "active": 0}.items()
        raw = client.chat.completions.create(tool_choice="none", **kw).choices[0]
        assert raw.message.content == CALL_TEXTS[family] and raw.message.tool_calls is None
        assert raw.finish_reason == "stop"


@pytest.mark.real
@pytest.mark.parametrize("stream", [False, True])
def test_qwen_calls_the_weather_tool(real_pair, stream):
    """llama.cpp's test_weather on the real Qwen2.5-Coder-1.5B: its own template, its own call, parsed."""
    target = tandem.load(real_pair[0], backend="llama.cpp", n_ctx=2048)
    try:
        app = create_app(target, None, engine=EngineConfig(slots=1), server=ServerConfig(model_name="qwen"))
        with LiveServer(app) as live:
            kw = dict(model="qwen", temperature=0, max_tokens=128, tools=[WEATHER_TOOL], messages=[
                {"role": "system", "content": "You are a chatbot that uses tools/functions. Dont overthink things."},
                {"role": "user", "content": "What is the weather in Istanbul?"}])
            client = live.client(timeout=600)
            if stream:
                name, arguments = "", ""
                for chunk in client.chat.completions.create(stream=True, **kw):
                    for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                        name += d.function.name or ""
                        arguments += d.function.arguments or ""
            else:
                call = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
                name, arguments = call.function.name, call.function.arguments
        assert name == "get_current_weather"
        assert re.match(r"^Istanbul(( |, ?)(TR|Turkey|Türkiye))?$", json.loads(arguments)["location"]), arguments
    finally:
        target.close()


def test_a_requests_choices_queue_together_or_not_at_all():
    """n jobs go in whole (a group larger than max_queue too, while nothing waits), or a 503 refuses them all."""
    import asyncio

    from tandem.engine import Request
    from tandem.server.scheduler import Job, QueueFullError, Scheduler

    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(None, slots=1, max_queue=2)

        def jobs(n: int) -> list[Job]:
            return [Job(request=Request([1]), loop=loop, index=i) for i in range(n)]

        scheduler.submit_all(jobs(3))
        assert scheduler.queue_depth == 3
        with pytest.raises(QueueFullError):
            scheduler.submit_all(jobs(1))
        assert scheduler.queue_depth == 3
        scheduler = Scheduler(None, slots=1, max_queue=4)
        scheduler.submit_all(jobs(2))
        with pytest.raises(QueueFullError):
            scheduler.submit_all(jobs(3))  # 5 would wait: none of them goes in
        scheduler.submit_all(jobs(2))
        assert scheduler.queue_depth == 4
    finally:
        loop.close()


def test_an_idle_server_settles_a_finished_reply_for_the_next_turn(tiny_model_path):
    """While no request runs, the worker recomputes a finished reply's rows as a prompt computes them
    (KVSlots.settler), so that the conversation's next turn may keep all the slot holds (repacked Q4_K weights)."""
    pytest.importorskip("llama_cpp")
    import asyncio
    import time

    from conftest import K_QUANT_SHAPES

    from tandem.engine import Engine, Request
    from tandem.server.scheduler import Job, Scheduler

    target = tandem.load(tiny_model_path(qtype="Q4_K", seed=5, **K_QUANT_SHAPES), backend="llama.cpp", n_ctx=256)
    engine = Engine(target, slots=1)
    loop = asyncio.new_event_loop()
    scheduler = Scheduler(engine)
    scheduler.start()
    try:
        job = Job(request=Request(list(range(1, 31)), max_tokens=20, ignore_eos=True), loop=loop)
        scheduler.submit(job)

        async def finished() -> None:
            while (await job.events.get()).chunk.finish_reason is None:
                pass

        loop.run_until_complete(asyncio.wait_for(finished(), 120))
        deadline = time.monotonic() + 120
        while engine.kv.settler.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        held = engine.target_kv.length(0)  # 30 + 20 tokens (the pending one too), 48 of them by the GEMM
        assert not engine.kv.settler.pending and held == 50 and engine.target_kv.reusable(0, held) == 48
    finally:
        scheduler.stop()
        loop.close()
        target.close()


def test_idle_work_waits_a_quiet_second_from_when_it_is_given():
    """A server hands its idle work (the cost measurement) over at ready and its first request comes at once: the
    work waits QUIET_S from then, not from the last request (none yet), so it does not run ahead of that request."""
    import threading

    from tandem.server import scheduler as sched

    ran = threading.Event()
    scheduler = sched.Scheduler(None, slots=1)
    scheduler.attach(SimpleNamespace(slots=1, busy=False, step=lambda: [], cancel=lambda gen: None))
    scheduler.start()
    try:
        scheduler.when_idle(lambda: ran.set())
        assert not ran.wait(sched.QUIET_S / 2)  # the first request's time: nothing runs yet
        assert ran.wait(sched.QUIET_S + 5)  # then, the server quiet, it runs
    finally:
        scheduler.stop()


def test_model_work_runs_on_the_worker_and_fails_cleanly_at_shutdown():
    """Scheduler.call: fn runs on the worker thread (the models are its alone); a call still pending at shutdown,
    or made after it, gets ShuttingDownError (a 503), never a hang."""
    import asyncio
    import threading

    from tandem.server.scheduler import Scheduler, ShuttingDownError

    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(None, slots=1)
        scheduler.start()
        pending = scheduler.call(lambda: "never run: no engine yet", loop)
        scheduler.stop()
        with pytest.raises(ShuttingDownError):
            loop.run_until_complete(asyncio.wait_for(pending, 10))
        with pytest.raises(ShuttingDownError):
            scheduler.call(lambda: None, loop)
        scheduler = Scheduler(None, slots=1)
        scheduler.attach(SimpleNamespace(slots=1, step=lambda: [], cancel=lambda gen: None))
        scheduler.start()
        try:
            where = loop.run_until_complete(asyncio.wait_for(scheduler.call(
                lambda: threading.current_thread().name, loop), 10))
            failed = scheduler.call(lambda: 1 / 0, loop)
            with pytest.raises(ZeroDivisionError):
                loop.run_until_complete(asyncio.wait_for(failed, 10))
        finally:
            scheduler.stop()
        assert where == "tandem-worker"
    finally:
        loop.close()
