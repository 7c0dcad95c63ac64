"""OpenAI's Responses API and Anthropic's Messages API on `tandem serve`, with the official openai and anthropic clients
on tiny random models: text, JSON-schema output and a two-step tool round-trip, streamed and not, with and without
a draft (greedy: the same answer); previous_response_id and its store; the 400s in each API's own error shape; the
recorded request bodies of Codex CLI and Claude Code (tests/fixtures/)."""

from __future__ import annotations

import json
import pathlib

import anthropic
import httpx
import openai
import pytest
from conftest import BOUNDED_SCHEMA, assert_speculated
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_api import CALL_TEXTS, EXPECTED_CALLS, ScriptedEngine
from test_server import API_KEY, LiveServer, assert_openai_error, load, metric, metrics_of
from test_tools import HERMES_TEMPLATE, PYTHON_TOOL, WEATHER_TOOL

from tandem.config import EngineConfig, ServerConfig
from tandem.server.app import create_app
from tandem.server.openai_responses import ResponseStore

jsonschema = pytest.importorskip("jsonschema")

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
QUESTION = "Write a function that adds two numbers."
MAX_TOKENS = 400  # room for a bounded JSON document or a forced call from a random-weight model
UNIT_SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "loud": {"type": "boolean"}},
               "required": ["unit", "loud"], "additionalProperties": False}
# The same function in each API's tool shape.
RESPONSES_TOOL = {"type": "function", "name": "set_unit", "description": "Set the unit", "parameters": UNIT_SCHEMA}
MESSAGES_TOOL = {"name": "set_unit", "description": "Set the unit", "input_schema": UNIT_SCHEMA}
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                        | st.text(max_size=8),
                        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids,
                                                                                   max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def paths(tiny_model_path):
    """A target whose template renders tools (hermes), and a draft that mostly agrees with it."""
    meta = {"tokenizer.chat_template": HERMES_TEMPLATE}
    return (tiny_model_path(seed=0, context_length=2048, metadata=meta),
            tiny_model_path(qtype="Q4_0", seed=0, context_length=2048, metadata=meta))


@pytest.fixture(scope="module")
def servers(paths):
    """(speculative: fixed k, 2 slots; plain: one slot, so a conversation's next turn finds its prefix, an API key)."""
    spec = create_app(load(paths[0]), load(paths[1]), engine=EngineConfig(draft_max=3, draft_policy="fixed", slots=2),
                      server=ServerConfig(model_name="tiny"))
    plain = create_app(load(paths[0]), None, engine=EngineConfig(slots=1),
                       server=ServerConfig(model_name="tiny", api_key=API_KEY))
    with LiveServer(spec) as spec_server, LiveServer(plain) as plain_server:
        yield spec_server, plain_server


def openai_client(server: LiveServer) -> openai.OpenAI:
    return server.client(api_key=API_KEY, timeout=120)


def anthropic_client(server: LiveServer, api_key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=120)


GREEDY = {"extra_body": {"temperature": 0}}  # the anthropic client no longer has sampling arguments; the API does


def assert_anthropic_error(response: httpx.Response, status: int, words: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert words in body["error"]["message"], body
    return body["error"]


def post(server: LiveServer, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                      **kw)


# --- the Responses API -------------------------------------------------------------------------------------------

def test_responses_text_streamed_and_not_equals_chat_and_plain(servers):
    texts = []
    for server in servers:
        client = openai_client(server)
        whole = client.responses.create(model="tiny", input=QUESTION, instructions="Be brief.", max_output_tokens=12,
                                        temperature=0)
        chat = client.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
        assert whole.output_text == chat.choices[0].message.content  # the same prompt, the same engine
        assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
        assert whole.usage.output_tokens == 12 and whole.usage.input_tokens == chat.usage.prompt_tokens
        kinds = []
        with client.responses.stream(model="tiny", input=QUESTION, instructions="Be brief.", max_output_tokens=12,
                                     temperature=0) as stream:
            for event in stream:
                kinds.append(event.type)
        # Cut by max_output_tokens: OpenAI's response.incomplete, whose response the client's get_final_response
        # does not take (it waits for response.completed: the JSON test below gets one).
        assert event.type == "response.incomplete" and event.response.output[0].content[0].text == whole.output_text
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.incomplete"]
        assert "response.output_text.delta" in kinds
        if server is servers[0]:
            assert_speculated(whole.model_extra["timings"])
        texts.append(whole.output_text)
    assert texts[0] == texts[1]


def test_responses_json_schema_output(servers):
    answers = []
    for server in servers:
        client = openai_client(server)
        kw = dict(model="tiny", input="Describe a person as JSON.", max_output_tokens=MAX_TOKENS, temperature=0,
                  text={"format": {"type": "json_schema", "name": "person", "schema": BOUNDED_SCHEMA, "strict": True}})
        whole = client.responses.create(**kw)
        jsonschema.validate(json.loads(whole.output_text), BOUNDED_SCHEMA)
        assert whole.status == "completed"
        with client.responses.stream(**kw) as stream:
            assert stream.get_final_response().output_text == whole.output_text
        answers.append(whole.output_text)
    assert answers[0] == answers[1]


def test_responses_tool_round_trip_and_previous_response_id_reuses_the_prefix(servers):
    calls_seen = []
    for server in servers:
        client = openai_client(server)
        first = client.responses.create(model="tiny", input="Set the unit to celsius.", tools=[RESPONSES_TOOL],
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_output_tokens=MAX_TOKENS, temperature=0)
        calls = [item for item in first.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "set_unit", first.output  # parallel_tool_calls false: one
        jsonschema.validate(json.loads(calls[0].arguments), UNIT_SCHEMA)
        calls_seen.append(calls[0].arguments)
        streamed = []
        with client.responses.stream(model="tiny", input="Set the unit to celsius.", tools=[RESPONSES_TOOL],
                                     tool_choice="required", parallel_tool_calls=False, max_output_tokens=MAX_TOKENS,
                                     temperature=0) as stream:
            for event in stream:
                if event.type == "response.function_call_arguments.done":
                    streamed.append(event.arguments)
        assert streamed == [calls[0].arguments]
        # Step two, stateless: the whole conversation again, with the call's output.
        result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "done"}
        replay = [{"role": "user", "content": "Set the unit to celsius."},
                  {"type": "function_call", "call_id": calls[0].call_id, "name": "set_unit",
                   "arguments": calls[0].arguments}, result]
        stateless = client.responses.create(model="tiny", input=replay, tools=[RESPONSES_TOOL],
                                            max_output_tokens=8, temperature=0)
        # Step two through previous_response_id: the same prompt, whose first turn's KV is still in the slot.
        hits = metric(metrics_of(server), "vllm:prefix_cache_hits_total")
        chained = client.responses.create(model="tiny", previous_response_id=first.id, input=[result],
                                          tools=[RESPONSES_TOOL], max_output_tokens=8, temperature=0)
        assert chained.output_text == stateless.output_text and chained.previous_response_id == first.id
        assert chained.usage.input_tokens == stateless.usage.input_tokens
        if server is servers[1]:  # one slot: the chained turn follows its own first turn's prefix
            cached = chained.usage.input_tokens_details.cached_tokens
            assert cached >= first.usage.input_tokens, (cached, first.usage.input_tokens)
            assert metric(metrics_of(server), "vllm:prefix_cache_hits_total") == hits + cached
    assert calls_seen[0] == calls_seen[1]


def test_previous_response_id_with_store_false_or_unknown_is_a_400(servers):
    server = servers[1]
    unstored = openai_client(server).responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    for previous in (unstored.id, "resp_unknown"):
        r = post(server, "/v1/responses", {"input": "again", "previous_response_id": previous})
        assert assert_openai_error(r, 400, "previous_response_id")["code"] == "previous_response_not_found"
    stored = openai_client(server).responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert openai_client(server).responses.retrieve(stored.id).id == stored.id
    # A streamed response is stored as a whole one is, and a streamed one may continue it.
    with openai_client(server).responses.stream(model="tiny", input="hi", max_output_tokens=2, temperature=0,
                                                previous_response_id=stored.id) as stream:
        events = list(stream)
    streamed = events[-1].response
    assert streamed.previous_response_id == stored.id
    assert openai_client(server).responses.retrieve(streamed.id).output[0].content[0].text == (
        streamed.output[0].content[0].text)
    with pytest.raises(openai.NotFoundError):
        openai_client(server).responses.retrieve(unstored.id)


def test_response_store_bounds_its_size_and_forgets_after_its_ttl():
    now = [100.0]
    store = ResponseStore(size=2, ttl_s=10, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        store.put(name, [{"role": "user", "content": name}], {"id": name})
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    now[0] += 10
    assert store.get("b") is None and store.get("c") is None and not store.entries


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "background": True}, "background"),
    ({"input": []}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "model": "gpt-4"}, "model"),
])
def test_responses_refuses_what_it_cannot_honour_in_openais_shape(servers, body, param):
    assert_openai_error(post(servers[1], "/v1/responses", body), 404 if param == "model" else 400, param)


# --- the Messages API --------------------------------------------------------------------------------------------

def test_messages_text_streamed_and_not_equals_chat_and_plain(servers):
    texts = []
    for server in servers:
        client = anthropic_client(server)
        whole = client.messages.create(model="tiny", max_tokens=12, **GREEDY, system="Be brief.",
                                       messages=[{"role": "user", "content": QUESTION}])
        chat = openai_client(server).chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
        assert whole.content[0].text == chat.choices[0].message.content
        assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
        assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == chat.usage.prompt_tokens
        with client.messages.stream(model="tiny", max_tokens=12, **GREEDY, system="Be brief.",
                                    messages=[{"role": "user", "content": QUESTION}]) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
        count = client.messages.count_tokens(model="tiny", system="Be brief.",
                                             messages=[{"role": "user", "content": QUESTION}])
        assert count.input_tokens == chat.usage.prompt_tokens
        if server is servers[0]:
            assert_speculated(whole.model_extra["timings"])
        texts.append(whole.content[0].text)
    assert texts[0] == texts[1]


def test_messages_stop_sequences(servers):
    client = anthropic_client(servers[1])
    kw = dict(model="tiny", **GREEDY, messages=[{"role": "user", "content": QUESTION}])
    text = client.messages.create(max_tokens=20, **kw).content[0].text
    stop = text[3:5]
    cut = client.messages.create(max_tokens=20, stop_sequences=[stop, "never-written"], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.find(stop)]


def test_messages_json_through_a_forced_tool_and_a_tool_round_trip(servers):
    """Anthropic's structured output is a forced tool: its input matches the input_schema; then the tool's result
    goes back as a tool_result block and the model answers."""
    answers = []
    for server in servers:
        client = anthropic_client(server)
        person = {"name": "record", "description": "Record a person", "input_schema": BOUNDED_SCHEMA}
        kw = dict(model="tiny", max_tokens=MAX_TOKENS, **GREEDY, tools=[person, MESSAGES_TOOL],
                  tool_choice={"type": "tool", "name": "record"},
                  messages=[{"role": "user", "content": "Describe a person."}])
        whole = client.messages.create(**kw)
        assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
        jsonschema.validate(whole.content[0].input, BOUNDED_SCHEMA)
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert final.content[0].input == whole.content[0].input and final.stop_reason == "tool_use"
        answers.append(whole.content[0].input)
        # The API's own structured output: output_config.format.
        kw = dict(model="tiny", max_tokens=MAX_TOKENS, **GREEDY, messages=[{"role": "user", "content": "A person."}],
                  output_config={"format": {"type": "json_schema", "schema": BOUNDED_SCHEMA}})
        structured = client.messages.create(**kw)
        jsonschema.validate(json.loads(structured.content[0].text), BOUNDED_SCHEMA)
        with client.messages.stream(**kw) as stream:
            assert "".join(stream.text_stream) == structured.content[0].text
        answers.append(structured.content[0].text)
        # tool_choice any with parallel calls off: one call to an offered tool; then its result goes back.
        ask = [{"role": "user", "content": "Set the unit."}]
        call = client.messages.create(model="tiny", max_tokens=MAX_TOKENS, **GREEDY, tools=[MESSAGES_TOOL],
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=ask)
        uses = [b for b in call.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].name == "set_unit"
        jsonschema.validate(uses[0].input, UNIT_SCHEMA)
        turn = ask + [{"role": "assistant", "content": call.content},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                    "content": "done"}]}]
        reply = client.messages.create(model="tiny", max_tokens=8, **GREEDY, tools=[MESSAGES_TOOL],
                                       messages=turn)
        assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answers[:2] == answers[2:]


def test_messages_api_key_and_errors_in_anthropics_shape(servers):
    server = servers[1]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(server, api_key="wrong").messages.create(model="tiny", max_tokens=2,
                                                                  messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(f"{server.url}/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user",
                                                                                     "content": "hi"}]})
    assert assert_anthropic_error(r, 401)["type"] == "authentication_error"
    headers = {"x-api-key": API_KEY}
    for body, words in (
        ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "images"),
        ({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
        ({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
          "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 2, "messages": []}, "messages"),
        ({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}},
         "needs tools"),
        ({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "output_config": {"effort": "high"}},
         "effort"),
    ):
        r = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers)
        assert assert_anthropic_error(r, 400, words)["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "claude-x", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}]}, headers=headers)
    assert assert_anthropic_error(r, 404)["type"] == "not_found_error"


def test_the_browser_guard_and_body_limit_cover_the_new_routes_in_their_shapes(servers):
    """A page's form post (text/plain, no CORS preflight) or a foreign Host reaches neither API; each says so in
    its own error shape, as the body-size limit does."""
    url = servers[1].url
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(url + path, content=b'{"max_tokens": 2}', headers={"Content-Type": "text/plain"})
        assert assert_anthropic_error(r, 415, "Content-Type")["type"] == "invalid_request_error"
        r = httpx.post(url + path, json={}, headers={"Host": "evil.example"})
        assert assert_anthropic_error(r, 403, "Host")["type"] == "permission_error"
        r = httpx.post(url + path, content=b"{" + b" " * (5 * 2**20) + b"}",
                       headers={"Content-Type": "application/json"})
        assert assert_anthropic_error(r, 413, "exceeds")["type"] == "request_too_large"
    r = httpx.post(url + "/v1/responses", content=b'{"input": "x"}', headers={"Content-Type": "text/plain"})
    assert_openai_error(r, 415)


def test_a_failed_step_is_an_error_event_or_a_500_in_each_apis_shape(paths, monkeypatch):
    """A broken engine step: a non-streamed request gets a generic 500, a stream (headers sent) an `error` event
    as each API defines it; nothing internal leaks, and the server answers afterwards."""
    from tandem.engine import Engine

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    requests = (("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}))
    with LiveServer(create_app(load(paths[0]), None, engine=EngineConfig(slots=1),
                               server=ServerConfig(model_name="tiny"))) as server:
        monkeypatch.setattr(Engine, "step", broken)
        for path, body in requests:
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 500 and "secret" not in r.text, r.text
            with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
                events = sse_events(r)
            name, error = events[-1]
            assert name == "error" and "secret" not in json.dumps(events), events
            if path == "/v1/messages":
                assert error["error"] == {"type": "api_error", "message": "internal server error"}
            else:
                assert error["code"] == "server_error" and error["message"] == "internal server error"
        monkeypatch.undo()
        for path, body in requests:
            assert httpx.post(server.url + path, json=body, timeout=60).status_code == 200


# --- several calls in one reply -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_calls(paths):
    """A server whose every reply is CALL_TEXTS["hermes"] (text, then two calls), written by a scripted engine."""
    target = load(paths[0])
    app = create_app(target, None, engine=EngineConfig(slots=2), server=ServerConfig(model_name="tiny"))
    app.state.server.scheduler.attach(ScriptedEngine(target.tokenizer, CALL_TEXTS["hermes"]))
    with LiveServer(app) as live:
        yield live


def as_responses_tool(tool: dict) -> dict:
    return {"type": "function", **tool["function"]}


def as_messages_tool(tool: dict) -> dict:
    function = tool["function"]
    return {"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_streamed_whole_or_limited_to_one(two_calls, parallel):
    expected = EXPECTED_CALLS if parallel else EXPECTED_CALLS[:1]
    client = two_calls.client()
    kw = dict(model="tiny", input="Weather in Istanbul?", tools=[as_responses_tool(t) for t in (WEATHER_TOOL,
                                                                                             PYTHON_TOOL)],
              parallel_tool_calls=parallel)
    whole = client.responses.create(**kw)
    assert whole.output[0].type == "message" and whole.output_text == "I will check."
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    with client.responses.stream(**kw) as stream:
        done = [e.arguments for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    assert [json.loads(a) for a in done] == [arguments for _, arguments in expected]
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == [("message", None)] + [
        ("function_call", name) for name, _ in expected]
    messages = anthropic_client(two_calls).messages
    kw = dict(model="tiny", max_tokens=100, messages=[{"role": "user", "content": "Weather in Istanbul?"}],
              tools=[as_messages_tool(t) for t in (WEATHER_TOOL, PYTHON_TOOL)],
              tool_choice={"type": "auto", "disable_parallel_tool_use": not parallel})
    message = messages.create(**kw)
    assert message.stop_reason == "tool_use" and message.content[0].text == "I will check."
    assert [(b.name, b.input) for b in message.content[1:]] == expected
    with messages.stream(**kw) as stream:
        final = stream.get_final_message().content

    def shown(blocks):
        return [(b.type, getattr(b, "text", None), getattr(b, "id", None), getattr(b, "input", None)) for b in blocks]

    assert shown(final)[0][:2] == shown(message.content)[0][:2] == ("text", "I will check.")
    assert [(b.name, b.input) for b in final[1:]] == expected


# --- what coding agents send ---------------------------------------------------------------------------------------

def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert data["type"] == name, (name, data)
            events.append((name, data))
    return events


def test_a_codex_cli_request_is_answered(servers):
    """Codex CLI's request (fixtures/codex_responses_request.json: its ResponsesApiRequest, codex-rs
    codex-api/src/common.rs, with its shell tool): streamed events ending in response.completed."""
    body = json.loads((FIXTURES / "codex_responses_request.json").read_text())
    body["max_output_tokens"] = 16  # the recorded body leaves it out (until the context is full)
    with httpx.stream("POST", f"{servers[0].url}/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[0][0] == "response.created" and events[-1][0] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    assert final["usage"]["output_tokens"] > 0 and final["tools"][0]["name"] == "shell"


def test_a_claude_code_request_is_answered(servers):
    """Claude Code's request (fixtures/claude_code_messages_request.json: system blocks with cache_control, its Bash
    tool, metadata.user_id, max_tokens 32000, stream): named events from message_start to message_stop."""
    body = json.loads((FIXTURES / "claude_code_messages_request.json").read_text())
    body["max_tokens"] = 16  # recorded: 32000, which a tiny random model would spend to the end of its context
    body["model"] = "tiny"  # Claude Code names the served model with ANTHROPIC_MODEL (or serve --accept-any-model)
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}
    with httpx.stream("POST", f"{servers[1].url}/v1/messages?beta=true", json=body, headers=headers,
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    count = httpx.post(f"{servers[1].url}/v1/messages/count_tokens", headers=headers, json={
        k: body[k] for k in ("model", "messages", "system", "tools")})
    assert count.status_code == 200 and count.json()["input_tokens"] > 0


# --- fuzzing the new routes from their documented schemas ------------------------------------------------------------

# Free-string fields that name a kind: drawn from the kinds both APIs define, so bodies reach each kind's handling
# (as free text they almost never did: an injected 500 for system blocks without text went unseen)
KINDS = {"type": ["text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking",
                  "input_text", "output_text", "input_image", "refusal", "message", "function_call",
                  "function_call_output", "reasoning", "function", "web_search", "json_schema", "json_object",
                  "auto", "any", "tool", "none", "required", "ephemeral", "enabled"],
         "role": ["user", "assistant", "system", "developer", "tool"]}


def drawn_from(schema: dict, name: str = ""):
    """A hypothesis strategy for JSON matching `schema` (the keywords pydantic writes: type, enum, const, anyOf,
    properties/required, items, bounds), with unknown fields added. hypothesis-jsonschema 0.23 fails on this
    hypothesis ('many' object has no attribute 'more'), so this small one stands in."""
    from hypothesis import strategies as st

    if not schema:
        return ANY_JSON if name not in KINDS else st.sampled_from(KINDS[name]) | ANY_JSON
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    if "anyOf" in schema:
        return st.one_of(*[drawn_from(s, name) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object":
        properties = {**{k: drawn_from(v, k) for k, v in schema.get("properties", {}).items()},
                      "unknown_field": ANY_JSON}
        required = [k for k in properties if k in schema.get("required", [])]
        optional = sorted(set(properties) - set(required))  # a few at a time: most requests set a few fields
        return st.lists(st.sampled_from(optional), max_size=4, unique=True).flatmap(
            lambda keys: st.fixed_dictionaries({k: properties[k] for k in required + keys}))
    if kind == "array":
        return st.lists(drawn_from(schema.get("items", {}), name), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 3), 3))
    if kind == "string":
        text = st.text(min_size=schema.get("minLength", 0), max_size=12)
        return st.sampled_from(KINDS[name]) | text if name in KINDS else text
    if kind == "integer":
        return st.integers(schema.get("minimum", -5), min(schema.get("maximum", 2**40), 2**40))
    if kind == "number":
        return st.floats(schema.get("minimum", -5), schema.get("maximum", 5), allow_nan=False)
    return {"boolean": st.booleans(), "null": st.none()}.get(kind, ANY_JSON)


def inlined(schema, schemas: dict, depth: int = 0):
    """`schema` with its #/components/schemas refs inlined, any JSON past a few levels (Block holds Blocks)."""
    if isinstance(schema, list):
        return [inlined(s, schemas, depth) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        return {} if depth > 3 else inlined(schemas[schema["$ref"].rsplit("/", 1)[1]], schemas, depth + 1)
    return {k: inlined(v, schemas, depth) for k, v in schema.items()}


@pytest.fixture(scope="module")
def fuzzed(paths):
    """A server with a short context (every accepted generation stays short), and the new routes' body schemas."""
    app = create_app(load(paths[0], n_ctx=64), None, engine=EngineConfig(slots=2),
                     server=ServerConfig(model_name="tiny", max_queue=8))
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=120) as http:
        document = http.get("/openapi.json").json()
        schemas = document["components"]["schemas"]
        bodies = {}
        for path in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
            ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            bodies[path] = inlined(ref, schemas)
        yield http, bodies


def answered_well(http, path: str, body) -> None:
    """A 200 or a 4xx in the route's error shape, never a 5xx; a stream ends with its API's last event."""
    with http.stream("POST", path, json=body) as r:
        raw = r.read()
    event(f"{path} {r.status_code}")
    assert r.status_code == 200 or 400 <= r.status_code < 500, (path, r.status_code, raw[:300])
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        last = raw.decode().strip().split("\n\n")[-1]
        assert last.startswith(("event: response.", "event: message_stop", "event: error")), last[:200]
    elif r.status_code != 200:
        error = json.loads(raw)
        if path.startswith("/v1/messages"):
            assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
        else:
            assert set(error["error"]) == {"message", "type", "param", "code"}, error


def test_fuzzed_bodies_of_the_new_routes_get_200_or_their_apis_4xx(fuzzed):
    """Bodies drawn from the document's own schemas (and some with a field replaced by any JSON): a 200 or a 4xx in
    the route's error shape, never a 5xx; the server still answers afterwards."""
    http, schemas = fuzzed
    drawn = st.sampled_from(sorted(schemas)).flatmap(lambda path: st.tuples(st.just(path), drawn_from(
        schemas[path]), st.none() | st.tuples(st.sampled_from(sorted(schemas[path]["properties"])), ANY_JSON)))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(drawn)
    def check(case):
        path, body, swap = case
        if "model" in body:
            body["model"] = "tiny"  # a drawn name is a 404; the swap below may still put any JSON there
        if swap is not None:
            body = {**body, swap[0]: swap[1]}
        answered_well(http, path, body)

    check()
    assert http.get("/health").json()["status"] == "ok"


def places(value, at=()):
    """Every path to a value inside JSON (dict keys and list indexes), the whole body's () first."""
    yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from places(inner, (*at, key))


def replaced(body, at, new):
    if not at:
        return new
    copy = dict(body) if isinstance(body, dict) else list(body)
    copy[at[0]] = replaced(body[at[0]], at[1:], new)
    return copy


def test_valid_bodies_with_one_value_replaced_get_200_or_their_apis_4xx(fuzzed):
    """Schema-drawn bodies mostly fail the first check (a message's role); these start from bodies that work (Codex
    CLI's and Claude Code's recorded ones, a tool round trip) and replace one value anywhere inside, with a kind's
    name, a block, a list or any JSON: every handler behind the first check is reached."""
    http, _ = fuzzed
    bases = {"/v1/responses": [json.loads((FIXTURES / "codex_responses_request.json").read_text()),
                               {"model": "tiny", "input": [{"role": "user", "content": "hi"},
                                                           {"type": "function_call", "call_id": "c1", "name": "f",
                                                            "arguments": "{}"},
                                                           {"type": "function_call_output", "call_id": "c1",
                                                            "output": "ok"}], "max_output_tokens": 4}],
             "/v1/messages": [json.loads((FIXTURES / "claude_code_messages_request.json").read_text()),
                              {"model": "tiny", "max_tokens": 4, "system": [{"type": "text", "text": "be brief"}],
                               "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}]}
    bases["/v1/messages/count_tokens"] = [{k: v for k, v in b.items() if k != "max_tokens"}
                                          for b in bases["/v1/messages"]]
    for bodies in bases.values():
        for body in bodies:
            body["model"] = "tiny"
            for key in ("max_tokens", "max_output_tokens"):
                if key in body:
                    body[key] = 4
    blocks = st.fixed_dictionaries({"type": st.sampled_from(KINDS["type"])},
                                   optional={"text": st.text(max_size=8) | ANY_JSON, "id": st.text(max_size=4),
                                             "content": ANY_JSON, "input": ANY_JSON, "name": st.text(max_size=4)})
    values = st.sampled_from(KINDS["type"] + KINDS["role"]) | blocks | st.lists(blocks, max_size=3) | ANY_JSON
    cases = st.sampled_from(sorted(bases)).flatmap(lambda path: st.sampled_from(bases[path]).flatmap(
        lambda body: st.tuples(st.just(path), st.just(body), st.sampled_from(list(places(body))[1:]), values)))

    @settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases)
    def check(case):
        path, body, at, new = case
        answered_well(http, path, replaced(body, at, new))

    check()
    assert http.get("/health").json()["status"] == "ok"
    r = http.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] <= 2
