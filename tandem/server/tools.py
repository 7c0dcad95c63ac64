"""Tool calls: which text format a model writes them in, parsing that text into OpenAI `tool_calls`, incrementally
for streams, and the JSON Schema that "a call to one of these tools" must match (for constrained decoding).
More: docs/internals.md."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "llama3", "gemma4")
# A forced tool_choice ("required", a named function) constrains the reply to the calls' JSON (tool_call_schema),
# whatever format the template teaches: the whole reply is then parsed as bare calls.
FORCED_FORMAT = "json"
# At most this many calls in a forced "required" reply: a weak model would otherwise add calls until max_tokens.
MAX_FORCED_CALLS = 8
ARCHITECTURE_FORMATS = {"qwen2": "hermes", "qwen3": "hermes", "llama": "llama3", "gemma4": "gemma4"}

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
GEMMA4_OPEN, GEMMA4_CLOSE = "<|tool_call>", "<tool_call|>"
GEMMA4_QUOTE = '<|"|>'
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ParsedCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's tool_call object (with `index` for a streamed delta); arguments as a JSON string."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return call if index is None else {"index": index, **call}


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` at all (one that never reads it would drop them silently)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def detect_format(chat_template: str | None, architecture: str) -> str:
    """The tool-call format a model writes: from what its template writes for an assistant's call, else from
    the architecture, else hermes (the most common among open models)."""
    template = chat_template or ""
    if GEMMA4_OPEN in template:
        return "gemma4"
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or ('"parameters"' in template and "<|start_header_id|>" in template):
        return "llama3"
    return ARCHITECTURE_FORMATS.get(architecture, "hermes")


# --- parsing one call -------------------------------------------------------------------------------------------

def _json_call(text: str, arguments_key: str | tuple[str, ...]) -> ParsedCall | None:
    """{"name": ..., <arguments_key>: {...}} -> a call, or None when the text is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    keys = (arguments_key,) if isinstance(arguments_key, str) else arguments_key
    arguments = next((obj[k] for k in keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments serialized, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ParsedCall(obj["name"], arguments) if isinstance(arguments, dict) else None


def parse_hermes_call(body: str) -> ParsedCall | None:
    """The JSON between <tool_call> and </tool_call>."""
    return _json_call(body.strip(), ("arguments", "parameters"))


def parse_llama3_calls(text: str) -> list[ParsedCall] | None:
    """A whole Llama 3 reply that is a call, or several separated by ';' (None: it is not calls)."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        call = _json_call(body[at:end], ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        at = end
        rest = body[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return None
        at = len(body) - len(rest)
    return calls or None


_GEMMA4_CALL = re.compile(r"^\s*call:([A-Za-z0-9_.-]+)(\{.*\})\s*$", re.DOTALL)
_GEMMA4_BARE_KEY = re.compile(r'([{,]\s*)([A-Za-z_][A-Za-z0-9_-]*)(\s*:)')


def gemma4_to_json(text: str) -> str:
    """Gemma 4's argument notation as JSON: `<|"|>`-quoted strings become JSON strings (their contents escaped),
    bare keys get quotes; numbers, true/false/null, objects and lists are already JSON."""
    out, at = [], 0
    while True:
        start = text.find(GEMMA4_QUOTE, at)
        if start < 0:
            out.append(_GEMMA4_BARE_KEY.sub(r'\1"\2"\3', text[at:]))
            return "".join(out)
        end = text.find(GEMMA4_QUOTE, start + len(GEMMA4_QUOTE))
        if end < 0:
            raise ValueError("an unterminated <|\"|> string")
        out.append(_GEMMA4_BARE_KEY.sub(r'\1"\2"\3', text[at:start]))
        out.append(json.dumps(text[start + len(GEMMA4_QUOTE):end], ensure_ascii=False))
        at = end + len(GEMMA4_QUOTE)


def parse_gemma4_call(body: str) -> ParsedCall | None:
    """`call:name{key:value,...}` (the text between <|tool_call> and <tool_call|>)."""
    match = _GEMMA4_CALL.match(body)
    if match is None:
        return None
    try:
        arguments = json.loads(gemma4_to_json(match.group(2)))
    except (ValueError, json.JSONDecodeError):
        return None
    return ParsedCall(match.group(1), arguments) if isinstance(arguments, dict) else None


# --- parsing a reply, whole or streamed -------------------------------------------------------------------------

def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker (text to hold back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


_FENCED = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_bare_calls(text: str, names: Collection[str]) -> list[ParsedCall] | None:
    """A whole reply that is only JSON: one call object, or a list of them, bare or in a ```json fence, each naming
    one of `names` (None: it is not calls). Qwen2.5-Coder writes its calls so instead of in <tool_call> tags more
    often than not; llama.cpp's hermes parser takes them too. Only offered names count, so JSON a user asked for
    stays content."""
    body = text.strip()
    fenced = _FENCED.match(body)
    body = fenced.group(1) if fenced else body
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    objects = obj if isinstance(obj, list) else [obj]
    calls = [_json_call(json.dumps(o), ("arguments", "parameters")) for o in objects]
    if not calls or any(c is None or c.name not in names for c in calls):
        return None
    return calls


class ToolCallParser:
    """Model text in, (text, calls) out, as the text arrives. Delimited calls (hermes, gemma4) come out at their
    closing marker, the text around them at once; a reply that begins like a whole-reply call (llama3, bare JSON:
    `{`, `<|python_tag|>`, a ```json fence) is held until the end."""

    def __init__(self, fmt: str, tool_names: Collection[str] = ()) -> None:
        """tool_names: the offered functions (hermes takes bare-JSON calls to these only)."""
        if fmt not in (*FORMATS, FORCED_FORMAT):
            raise ValueError(f"unknown tool-call format {fmt!r}; choose one of {', '.join(FORMATS)}")
        self.fmt, self.tool_names = fmt, frozenset(tool_names)
        self.opening, self.closing = {"hermes": (HERMES_OPEN, HERMES_CLOSE),
                                      "gemma4": (GEMMA4_OPEN, GEMMA4_CLOSE)}.get(fmt, (None, None))
        self.buffer = ""  # received, not yet returned
        self.in_call = False  # the buffer starts inside an opened call (delimited formats)
        # Whether the reply is (maybe) a whole-reply call: None undecided, True held to the end, False not.
        self.whole = True if fmt == FORCED_FORMAT else \
            None if fmt == "llama3" or (fmt == "hermes" and self.tool_names) else False
        self.calls: list[ParsedCall] = []  # every call returned so far
        self.space = ""  # trailing whitespace held back: it is dropped if only calls follow it

    def push(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Text that is surely content, and calls completed by this text."""
        self.buffer += text
        if self.whole is None:
            self.whole = self._looks_whole(self.buffer.lstrip())
        if self.whole is not False:  # held (or still undecided)
            return "", []
        if self.fmt == "llama3":
            out, self.buffer = self.buffer, ""
            return out, []
        return self._push_delimited()

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What is left at the end of the reply: a held reply parsed as calls, an unclosed call parsed if it is whole
        (models sometimes stop before the closing marker); whatever is not a call is returned as text."""
        if self.whole is not False:
            rest, self.buffer, self.whole = self.buffer, "", False
            calls = (parse_llama3_calls(rest) if self.fmt == "llama3" else parse_bare_calls(rest, self.tool_names))
            if calls:
                self.calls += calls
                return "", calls
            if self.fmt in ("llama3", FORCED_FORMAT):  # forced: cut short (max_tokens), it stays text
                return rest, []
            head, calls = self.push(rest)  # hermes: it may still hold tagged calls
            tail, more = self.finish()
            return head + tail, calls + more
        rest, self.buffer = self.buffer, ""
        if self.fmt == "llama3":
            return rest, []
        if self.in_call:
            self.in_call = False
            call = self._parse_delimited(rest)
            if call is not None:
                self.calls.append(call)
                return self._content("", final=True), [call]
            rest = self.opening + rest
        return self._content(rest, final=True), []

    def _looks_whole(self, head: str) -> bool | None:
        """Whether a reply beginning with `head` is held as a possible whole-reply call (None: cannot tell yet)."""
        if not head:
            return None
        starts = ("{", PYTHON_TAG) if self.fmt == "llama3" else ("{", "```json")
        if head.startswith(starts):
            return True
        return None if any(s.startswith(head) for s in starts) else False

    def _push_delimited(self) -> tuple[str, list[ParsedCall]]:
        out, calls = [], []
        while True:
            if self.in_call:
                end = self.buffer.find(self.closing)
                if end < 0:
                    break
                body, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(self.closing):], False
                call = self._parse_delimited(body)
                if call is None:  # malformed: it stays text, as the model wrote it
                    out.append(self.opening + body + self.closing)
                else:
                    calls.append(call)
                continue
            start = self.buffer.find(self.opening)
            if start < 0:
                keep = _partial_marker(self.buffer, self.opening)
                out.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            out.append(self.buffer[:start])
            self.buffer, self.in_call = self.buffer[start + len(self.opening):], True
        self.calls += calls
        return self._content("".join(out), final=False), calls

    def _content(self, text: str, final: bool) -> str:
        """Text to return, less trailing whitespace held until more text shows it belongs to the content (at the
        end: kept when the reply made no call, dropped when it did, so a call-only reply has no content)."""
        text = self.space + text
        if final:
            self.space = ""
            return text if not self.calls else text.rstrip()
        kept = text.rstrip()
        self.space = text[len(kept):]
        return kept

    def _parse_delimited(self, body: str) -> ParsedCall | None:
        return parse_hermes_call(body) if self.fmt == "hermes" else parse_gemma4_call(body)


def parse_tool_calls(text: str, fmt: str, tool_names: Collection[str] = ()) -> tuple[str, list[ParsedCall]]:
    """A whole reply -> (the text that is not calls, the calls)."""
    parser = ToolCallParser(fmt, tool_names)
    head, calls = parser.push(text)
    tail, more = parser.finish()
    return head + tail, calls + more


# --- the constraint seam ---------------------------------------------------------------------------------------

def tool_call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON Schema of "a call to one of these tools" (tool_choice "required"), or of "a call to function
    `name`" (a named tool_choice): {"name": <const>, "arguments": <the function's parameters>}, one branch per
    function. Constrained decoding of the call's JSON body (between the format's markers) makes the answer a
    valid call; tools: OpenAI's tool objects ({"type": "function", "function": {...}})."""
    branches = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        branches.append({"type": "object", "properties": {
            "name": {"const": function["name"]},
            "arguments": function.get("parameters") or {"type": "object"},
        }, "required": ["name", "arguments"], "additionalProperties": False})
    if not branches:
        raise ValueError(f"no tool named {name!r}")
    return branches[0] if len(branches) == 1 else {"anyOf": branches}
