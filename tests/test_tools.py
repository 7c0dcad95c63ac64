"""Tool calls: the text formats models write them in, parsed whole and streamed; tools and tool messages rendered by
chat templates as transformers hands them over; the JSON Schema seam for constrained calls."""

from __future__ import annotations

import json

import pytest

from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest, parse_request
from tandem.server.tools import (
    ToolCallParser,
    detect_format,
    gemma4_to_json,
    parse_tool_calls,
    template_supports_tools,
    tool_call_schema,
)

# The tools of llama.cpp's tools/server/tests/unit/test_tool_call.py.
TEST_TOOL = {"type": "function", "function": {"name": "test", "description": "", "parameters": {
    "type": "object", "properties": {"success": {"type": "boolean", "const": True}}, "required": ["success"]}}}
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Runs code in an ipython interpreter and returns the result of the execution.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code to run."}},
                   "required": ["code"]}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}

# A hermes-style template written for these tests (Qwen2.5's structure: tools as JSON lines in the system turn,
# an assistant's calls as <tool_call> JSON with `arguments | tojson`, tool results as <tool_response> in a user turn).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>{% else %}{{ m.content or '' }}"
    "{% endif %}{% for call in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A Llama 3.1-style template written for these tests: `tools` as indented JSON, a call as {"name", "parameters"},
# tool results in an `ipython` turn.
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if tools and loop.first %}{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{% endif %}"
    "{% if m.tool_calls %}{\"name\": \"{{ m.tool_calls[0].function.name }}\", \"parameters\": "
    "{{ m.tool_calls[0].function.arguments | tojson }}}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# An agent loop's second step (llama.cpp's test_calc_result conversation).
CALC_CONVERSATION = [
    {"role": "system", "content": "You are a tools-calling assistant."},
    {"role": "user", "content": "What's the y coordinate of a point on the unit sphere at angle 30 degrees?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_6789", "type": "function", "function": {
        "name": "calculate", "arguments": "{\"expression\":\"sin(30 * pi / 180)\"}"}}]},
    {"role": "tool", "content": "0.55644242476", "tool_call_id": "call_6789"},
]
CALC_TOOL = {"type": "function", "function": {"name": "calculate", "description": "A calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calls_of(text: str, fmt: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, fmt)
    return content, [(c.name, c.arguments) for c in calls]


# --- parsing literal model texts ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Istanbul"}}\n</tool_call>', "",
     [("get_current_weather", {"location": "Istanbul"})]),
    ('Let me look.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(\\"hi\\")"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "test", "arguments": {"success": true}}\n</tool_call>', "Let me look.",
     [("python", {"code": 'print("hi")'}), ("test", {"success": True})]),
    # Models stop at EOS before the closing tag now and then: a whole JSON call still counts.
    ('<tool_call>\n{"name": "test", "arguments": {"success": true}}', "", [("test", {"success": True})]),
    # arguments serialized as a string, as some fine-tunes write them
    ('<tool_call>{"name": "test", "arguments": "{\\"success\\": true}"}</tool_call>', "",
     [("test", {"success": True})]),
    ("No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    # malformed calls stay text, never dropped
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>\n{"name": "test", "argu', '<tool_call>\n{"name": "test", "argu', []),
])
def test_hermes_texts(text, content, calls):
    assert calls_of(text, "hermes") == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    # Qwen2.5-Coder's habit: the call as the whole reply, in a ```json fence or bare; offered names only.
    ('```json\n{\n  "name": "get_current_weather",\n  "arguments": {\n    "location": "Istanbul"\n  }\n}\n```', "",
     [("get_current_weather", {"location": "Istanbul"})]),
    ('{"name": "python", "arguments": {"code": "1"}}', "", [("python", {"code": "1"})]),
    ('```json\n[{"name": "python", "arguments": {}}, {"name": "test", "arguments": {"success": true}}]\n```', "",
     [("python", {}), ("test", {"success": True})]),
    ('{"name": "json_example", "arguments": {}}', '{"name": "json_example", "arguments": {}}', []),  # not offered
    ('```json\n{"name": "python"', '```json\n{"name": "python"', []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
])
def test_hermes_whole_reply_calls_to_offered_tools(text, content, calls):
    got_content, got = parse_tool_calls(text, "hermes", tool_names=["get_current_weather", "python", "test"])
    assert (got_content, [(c.name, c.arguments) for c in got]) == (content, calls)
    assert parse_tool_calls(text, "hermes")[1] == []  # no offered names: no whole-reply calls


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_current_weather", "parameters": {"location": "Istanbul"}}', "",
     [("get_current_weather", {"location": "Istanbul"})]),
    ('<|python_tag|>{"name": "python", "parameters": {"code": "1+1"}}', "", [("python", {"code": "1+1"})]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "", [("a", {"x": 1}), ("b", {})]),
    ('  {"type": "function", "name": "test", "parameters": {"success": true}}', "", [("test", {"success": True})]),
    ("Hello! {\"name\": \"x\"} is JSON.", "Hello! {\"name\": \"x\"} is JSON.", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call is content
    ('{"name": "test", "parameters": {"succ', '{"name": "test", "parameters": {"succ', []),
])
def test_llama3_texts(text, content, calls):
    assert calls_of(text, "llama3") == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('<|tool_call>call:get_current_weather{location:<|"|>Istanbul, TR<|"|>}<tool_call|>', "",
     [("get_current_weather", {"location": "Istanbul, TR"})]),
    ('Sure.<|tool_call>call:f{n:3,ok:true,none:null,xs:[1,<|"|>a, b<|"|>],o:{k:<|"|>{x: "y"}<|"|>}}<tool_call|>',
     "Sure.", [("f", {"n": 3, "ok": True, "none": None, "xs": [1, "a, b"], "o": {"k": '{x: "y"}'}})]),
    ("<|tool_call>call:f{}<tool_call|><|tool_call>call:g{a:-1.5e3}<tool_call|>", "",
     [("f", {}), ("g", {"a": -1500.0})]),
    ("<|tool_call>call:f{a:<|\"|>open<tool_call|>", "<|tool_call>call:f{a:<|\"|>open<tool_call|>", []),
])
def test_gemma4_texts(text, content, calls):
    assert calls_of(text, "gemma4") == (content, calls)


def test_gemma4_notation_to_json():
    expected = {"a": "x:1, y", "b_c": [True, {"d": 2}]}
    assert json.loads(gemma4_to_json('{a:<|"|>x:1, y<|"|>,b_c:[true,{d:2}]}')) == expected


@pytest.mark.parametrize("fmt, text", [
    ("hermes", 'Checking the weather.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": '
               '"Paris, FR"}}\n</tool_call>\n<tool_call>\n{"name": "test", "arguments": {"success": true}}\n'
               "</tool_call>"),
    ("hermes", "plain text with < and <tool and <tool_cal but no call"),
    ("llama3", '<|python_tag|>{"name": "python", "parameters": {"code": "print(1)"}}'),
    ("llama3", "<|python not a tag, just text"),
    ("gemma4", 'A <|tool_call>call:get_current_weather{location:<|"|>Paris<|"|>}<tool_call|> B'),
    ("hermes", '```json\n{"name": "python", "arguments": {"code": "1"}}\n```'),
    ("hermes", '```json\n{"answer": 42}\n```\nand <tool_call>{"name": "test", "arguments": {}}</tool_call>'),
])
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_pieces_reassemble_to_the_whole_parse(fmt, text, piece):
    """Any split of the text (a token is a few characters) gives the whole parse, and no text that belongs to a
    call is ever returned as content."""
    parser, content, calls = ToolCallParser(fmt, ["python", "test"]), [], []
    for i in range(0, len(text), piece):
        out, done = parser.push(text[i:i + piece])
        content.append(out)
        calls += done
    out, done = parser.finish()
    content.append(out)
    calls += done
    whole_content, whole_calls = parse_tool_calls(text, fmt, ["python", "test"])
    assert "".join(content) == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    for out in content:
        assert "<tool_call>" not in out and "<|tool_call>" not in out and "python_tag" not in out or not whole_calls


def test_hermes_holds_back_a_possible_opening_only():
    parser = ToolCallParser("hermes")
    assert parser.push("Hi <tool") == ("Hi", [])  # "<tool" may begin a call; the space waits for what follows
    assert parser.push("box> ok") == (" <toolbox> ok", [])


def test_call_objects_are_openai_shaped():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": "é"}}</tool_call>', "hermes")
    call = calls[0].openai()
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "f", "arguments": '{"a": "é"}'}
    assert calls[0].openai(index=2)["index"] == 2


def test_format_from_template_then_architecture():
    assert detect_format(HERMES_TEMPLATE, "llama") == "hermes"
    assert detect_format(LLAMA3_TEMPLATE, "qwen2") == "llama3"
    assert detect_format("{{ '<|tool_call>call:' }}", "qwen2") == "gemma4"
    assert detect_format(None, "gemma4") == "gemma4" and detect_format("", "llama") == "llama3"
    assert detect_format("", "mystery") == "hermes"
    assert template_supports_tools(HERMES_TEMPLATE) and not template_supports_tools("{{ messages }}")


# --- the constraint seam --------------------------------------------------------------------------------------

def test_tool_call_schema():
    one = tool_call_schema([WEATHER_TOOL, PYTHON_TOOL], name="python")
    assert one["properties"]["name"] == {"const": "python"}
    assert one["properties"]["arguments"] == PYTHON_TOOL["function"]["parameters"]
    both = tool_call_schema([WEATHER_TOOL, PYTHON_TOOL])
    assert [b["properties"]["name"]["const"] for b in both["anyOf"]] == ["get_current_weather", "python"]
    assert tool_call_schema([{"type": "function", "function": {"name": "f"}}])["properties"]["arguments"] == {
        "type": "object"}
    with pytest.raises(ValueError, match="no tool named"):
        tool_call_schema([WEATHER_TOOL], name="nope")


# --- rendering: what the chat template gets -------------------------------------------------------------------

def chat_request(**body) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


def test_tool_messages_reach_the_template_as_transformers_passes_them():
    req = chat_request(messages=CALC_CONVERSATION, tools=[CALC_TOOL])
    messages = req.template_messages()
    assert messages[2] == {"role": "assistant", "content": None, "tool_calls": [{"id": "call_6789", "type": "function",
                           "function": {"name": "calculate", "arguments": {"expression": "sin(30 * pi / 180)"}}}]}
    assert messages[3] == {"role": "tool", "content": "0.55644242476", "tool_call_id": "call_6789", "name": "calculate"}
    assert req.tools_offered == [CALC_TOOL]
    assert chat_request(messages=CALC_CONVERSATION, tools=[CALC_TOOL], tool_choice="none").tools_offered is None


@pytest.fixture(scope="module")
def tokenizer_with(tiny_model_path):
    from tandem.loading.tokenizer import Tokenizer

    def make(template: str) -> Tokenizer:
        return Tokenizer.from_gguf(tiny_model_path(seed=0, metadata={"tokenizer.chat_template": template}))

    return make


def test_hermes_template_renders_tools_calls_and_results(tokenizer_with):
    req = chat_request(messages=CALC_CONVERSATION, tools=[CALC_TOOL])
    text = tokenizer_with(HERMES_TEMPLATE).apply_chat_template(req.template_messages(), tools=req.tools_offered)
    assert "<tools>\n" + json.dumps(CALC_TOOL, ensure_ascii=False) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculate", "arguments": {"expression": '
            '"sin(30 * pi / 180)"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n0.55644242476\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama3_template_renders_tools_and_the_call(tokenizer_with):
    req = chat_request(messages=CALC_CONVERSATION, tools=[CALC_TOOL])
    text = tokenizer_with(LLAMA3_TEMPLATE).apply_chat_template(req.template_messages(), tools=req.tools_offered)
    assert json.dumps(CALC_TOOL, indent=4, ensure_ascii=False) in text
    assert '{"name": "calculate", "parameters": {"expression": "sin(30 * pi / 180)"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n0.55644242476<|eot_id|>" in text


def test_bad_tool_messages_are_400s():
    cases = [
        (dict(messages=[{"role": "user"}]), "messages[0].content"),
        (dict(messages=[{"role": "user", "content": None}]), "messages[0].content"),
        (dict(messages=[{"role": "user", "content": "x", "tool_calls": CALC_CONVERSATION[2]["tool_calls"]}]),
         "messages[0].tool_calls"),
        (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{oops"}}]}]), "messages[0].tool_calls[0].function.arguments"),
        (dict(messages=[{"role": "user", "content": "x"}], tool_choice="auto"), "tool_choice"),
        (dict(messages=[{"role": "user", "content": "x"}], tools=[CALC_TOOL],
              tool_choice={"type": "function", "function": {"name": "other"}}), "tool_choice"),
        (dict(messages=[{"role": "user", "content": "x"}], tools=[CALC_TOOL, CALC_TOOL]), "tools"),
        (dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {
            "name": "has space"}}]), "tools[0].function.name"),
    ]
    for body, param in cases:
        with pytest.raises(APIError) as error:
            chat_request(**body).template_messages()
        assert error.value.status == 400 and error.value.param == param, (body, error.value.message)


@pytest.mark.real
def test_the_real_qwen_template_renders_tools(real_pair):
    """Qwen2.5-Coder's own template: tools in its system turn, the assistant's call and the tool's answer."""
    from tandem.loading.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(real_pair[0])
    assert detect_format(tokenizer.chat_template, "qwen2") == "hermes"
    req = chat_request(messages=CALC_CONVERSATION, tools=[CALC_TOOL])
    text = tokenizer.apply_chat_template(req.template_messages(), tools=req.tools_offered)
    assert "# Tools" in text and json.dumps(CALC_TOOL, ensure_ascii=False) in text
    assert '<tool_call>\n{"name": "calculate", "arguments": {"expression": "sin(30 * pi / 180)"}}\n</tool_call>' in text
    assert "<tool_response>\n0.55644242476\n</tool_response>" in text
