"""What an outside audit of the Chat/Completions surface found (issue 49), fixed: logprobs `bytes` are the token's own
bytes and completions' `text_offset` stays inside the text when tokens split a UTF-8 character; llama-server's
`response_format: {"type": "json_object", "schema": ...}` and its top-level `json_schema` constrain the output (or
are a 400), never silently ignored; the OpenAPI document says what the server refuses."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import BOUNDED_SCHEMA
from test_api import ScriptedEngine
from test_server import LiveServer, assert_openai_error, load

from tandem.config import EngineConfig, ServerConfig
from tandem.engine.generation import TokenLogprob
from tandem.server.app import create_app

jsonschema = pytest.importorskip("jsonschema")

# Byte-level BPE splits the crab and the é over several tokens, each holding part of a character.
TEXT = "x 🦀 é"


class ScriptedWithLogprobs(ScriptedEngine):
    """Writes TEXT's tokens, each with a logprob (and itself as its one alternative)."""

    def step(self):
        events = super().step()
        for _, chunk in events:
            chunk.logprobs = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in chunk.tokens]
        return events


@pytest.fixture(scope="module")
def scripted(tiny_model_path):
    target = load(tiny_model_path(seed=0))
    app = create_app(target, None, engine=EngineConfig(slots=2), server=ServerConfig(model_name="tiny"))
    app.state.server.scheduler.attach(ScriptedWithLogprobs(target.tokenizer, TEXT))
    with LiveServer(app) as live:
        yield live


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_bytes_are_the_tokens_own_and_join_to_the_text(scripted, stream):
    client = scripted.client()
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=1)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        entries, text = choice.logprobs.content, choice.message.content
    assert text == TEXT and len(entries) > len(TEXT)  # more tokens than characters: some hold a character's part
    assert b"".join(bytes(e.bytes) for e in entries) == TEXT.encode()
    assert all(e.top_logprobs[0].bytes == e.bytes for e in entries)
    assert b"\xef\xbf\xbd" not in b"".join(bytes(e.bytes) for e in entries)  # no replacement character's bytes


def test_completions_text_offset_counts_characters_of_the_text(scripted):
    for stream in (False, True):
        answer = scripted.client().completions.create(model="tiny", prompt="hi", logprobs=1, stream=stream)
        if stream:
            offsets = [o for c in answer if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
        else:
            offsets = answer.choices[0].logprobs.text_offset
        # x, space, the crab's 4 bytes (its character counted once it is complete), space, the é's 2 bytes
        assert offsets == [0, 1, 2, 2, 2, 2, 3, 4, 4], offsets
        assert max(offsets) < len(TEXT)


@pytest.fixture(scope="module")
def live(tiny_model_path):
    with LiveServer(create_app(load(tiny_model_path(seed=0)), None, engine=EngineConfig(slots=2),
                               server=ServerConfig(model_name="tiny"))) as server:
        yield server


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_object", "schema": BOUNDED_SCHEMA}},  # llama-server's form
    {"json_schema": BOUNDED_SCHEMA},  # llama-server's top-level field
])
def test_llamacpp_schema_forms_constrain_the_output(live, constraint):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "A person as JSON."}]}),
                       ("/v1/completions", {"prompt": "JSON:"})):
        r = httpx.post(f"{live.url}{path}", json={**body, **constraint, "max_tokens": 400, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_object", "schema": 123}}, "response_format.schema"),
    ({"response_format": {"type": "json_object", "schema": {"type": "nope"}}}, "response_format"),
    ({"json_schema": 123}, "json_schema"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "grammar"),
    ({"json_schema": {"type": "object"}, "response_format": {"type": "json_object"}}, "json_schema"),
])
def test_schema_forms_that_cannot_be_honoured_are_400s(live, body, param):
    r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
    assert_openai_error(r, 400, param)


def test_the_document_says_what_is_refused(live):
    schemas = httpx.get(f"{live.url}/openapi.json").json()["components"]["schemas"]
    chat, text = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1
    assert set(schemas["ChatMessage"]["properties"]["role"]["enum"]) == {"system", "developer", "user", "assistant",
                                                                         "tool"}
    assert {"minLength": 1, "type": "string"} in text["prompt"]["anyOf"]
    assert text["best_of"]["enum"] == [1, None] and chat["store"]["enum"] == [False, None]
    assert "json_schema" in chat and "schema" in schemas["ResponseFormat"]["properties"]
    document = httpx.get(f"{live.url}/openapi.json").json()
    responses = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"403", "415"} <= set(responses)
