"""OpenAI's request shapes for /v1/chat/completions and /v1/completions, and their validation (responses.py builds
the answers).
More: docs/internals.md."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from tandem.engine.generation import MAX_TOP_LOGPROBS
from tandem.logits.grammar import COMPACT_JSON
from tandem.logits.options import logits_settings
from tandem.logits.processor import DEFAULT_REPEAT_LAST_N, MAX_PENALTY, LogitsError, LogitsSettings
from tandem.server.errors import APIError
from tandem.server.tools import MAX_FORCED_CALLS, tool_call_schema

MAX_STOP_STRINGS = 4  # OpenAI's limit
_REFUSED = "not supported: a request that sets it gets a 400"
MAX_N = 16  # choices a request may ask for: each takes a slot of the batch
MAX_DRAFT_OVERRIDE = 64  # a per-request draft_max above this is surely a mistake (and each new k calibrates once)
ROLES = ("system", "developer", "user", "assistant", "tool")


# --- requests -------------------------------------------------------------------------------------------------

def _whole_number(value: Any) -> Any:
    """8.0 -> 8: JSON Schema's `integer` accepts whole-number floats, and Python clients send them; 8.5 stays a
    float, which the strict int then refuses."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _whole(**constraints: Any) -> Any:
    """An int field that takes whole-number floats, with its bounds (ge, le) where JSON Schema shows them (bounds
    placed after the validator would be documented under pydantic's names instead)."""
    return Annotated[int, Field(**constraints), BeforeValidator(_whole_number)]


WholeInt = _whole()
NonEmptyText = Annotated[str, Field(min_length=1)]
NonEmptyIds = Annotated[list[_whole(ge=0)], Field(min_length=1)]
# A list of one prompt (several are a 400 from `checked`, which says why): the document says so too.
OnePrompt = Field(min_length=1, json_schema_extra={"maxItems": 1})


class _Lenient(BaseModel):
    """Strict types for the fields we know, silence for the ones we don't."""

    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str = Field("{}", description="the arguments as a JSON object, serialized (as OpenAI sends them)")


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal[ROLES] = Field(description=f"one of {', '.join(ROLES)}")
    content: str | list[ContentPart] | None = Field(
        None, description="required, except for an assistant message that carries tool_calls")
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages: the calls the model made")
    tool_call_id: str | None = Field(None, description="tool messages: the call this message answers")


class FunctionDefinition(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="the arguments' JSON Schema")
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class SpeculativeOptions(_Lenient):
    """Per-request draft override: {"draft_max": k} caps draft tokens per iteration; {"enabled": false} is off."""

    enabled: bool = True
    draft_max: _whole(ge=0, le=MAX_DRAFT_OVERRIDE) | None = None


class JSONSchemaFormat(_Lenient):
    """response_format.json_schema: the schema the output must match (name, description, strict: informative)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema", description="llama-server's form: "
                                                  '{"type": "json_object", "schema": {...}} constrains to the schema')


class _GenerationRequest(_Lenient):
    """Fields common to chat and text completions. Defaults are OpenAI's (temperature 1, top_p 1)."""

    model: str | None = Field(None, description="the served model's id (GET /v1/models) or an alias; may be left out")
    max_tokens: _whole(ge=1) | None = Field(None, description="[until the context is full]")
    max_completion_tokens: _whole(ge=1) | None = Field(None, description="the same as max_tokens; wins over it")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: _whole(ge=0) = Field(0, description="keep the k likeliest tokens; 0 is off (llama-server, vLLM)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = Field(None, description=f"at most {MAX_STOP_STRINGS} strings")
    seed: WholeInt | None = Field(None, description="makes sampling reproducible; choice i of n uses a seed derived "
                                  "from it (choice 0 the seed itself)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: _whole(ge=1, le=MAX_N) = Field(1, description="choices to generate, decoded together")
    user: str | None = None
    speculative: bool | SpeculativeOptions | None = Field(
        None, description="tandem's per-request drafting: false turns it off, {draft_max: k} caps draft lengths")

    # Logits processing (tandem.logits): structured output, OpenAI's bias and penalties, llama-server's extras.
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: the output is "
                                                   "constrained to match (llguidance)")
    grammar: str | None = Field(None, description="llama-server's and vLLM's: a GBNF (or Lark) grammar the output "
                                "must match")
    json_schema: dict[str, Any] | bool | None = Field(None, description="llama-server's: a JSON Schema the output "
                                                      "must match")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias added to its logit")
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    repeat_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="llama-server's; 1 is off")
    repeat_last_n: _whole(ge=-1) = Field(DEFAULT_REPEAT_LAST_N, description="the repeat penalty's window: -1 the "
                                         "whole context, 0 off")

    # Parameters OpenAI defines that tandem cannot honour: a request that uses them gets a 400 naming them
    # (never a silently different answer). {field: the values that ask for nothing, so they pass}.
    _UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    def checked(self) -> _GenerationRequest:
        """Cross-field checks pydantic's per-field constraints can't express."""
        for name, neutral in self._UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and value not in neutral:
                raise APIError(400, f"{name} is not supported by this server (got {value!r})", param=name,
                               code="unsupported_parameter")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                           param="stop")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise APIError(400, f"seed must fit in 64 bits, got {self.seed}", param="seed")
        return self

    def forced_schema(self) -> dict[str, Any] | None:
        """A JSON Schema the reply must match beyond response_format (chat: a forced tool call)."""
        return None

    def logits_settings(self, vocab: int) -> LogitsSettings | None:
        """The request's logits processing for a model of `vocab` logits (None: none), or a 400 naming the field."""
        fmt = self.response_format
        try:
            forced = self.forced_schema()
            return logits_settings(fmt and fmt.model_dump(by_alias=True, exclude_none=True),
                                   self.json_schema if forced is None else forced, self.grammar,
                                   self.logit_bias,
                                   self.frequency_penalty, self.presence_penalty, self.repeat_penalty,
                                   self.repeat_last_n, vocab)
        except LogitsError as e:
            raise APIError(400, str(e), param=e.param) from None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprobs_count(self) -> int | None:
        """None: no logprobs; n >= 0: each token's logprob and its n likeliest alternatives."""
        return None

    def draft_override(self) -> tuple[bool, int | None]:
        """(speculation enabled, draft_max override or None)."""
        spec = self.speculative
        if spec is None or spec is True:
            return True, None
        if spec is False:
            return False, None
        return spec.enabled, spec.draft_max

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index`: the request's for choice 0, so n=1 and the first of n agree; a hash of
        (seed, index) for the others, so choices differ and each is reproducible."""
        if self.seed is None or index == 0:
            return self.seed
        digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1  # 63 bits: any torch.Generator takes it


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation; at least one message")
    logprobs: bool = False
    top_logprobs: _whole(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    tools: list[Tool] | None = Field(None, description="functions the model may call; rendered by the model's chat "
                                     "template, as transformers' apply_chat_template(tools=...) does")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"auto" (default with tools): the model decides; "none": tools are not offered; '
        '"required": at least one call, constrained to the tools\' schemas; a named function: a call to it')
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (the choice ends when its "
                                             "first call is complete) [true]")
    # OpenAI parameters tandem cannot honour (400 when used): see _UNSUPPORTED.
    audio: dict[str, Any] | None = Field(None, description=_REFUSED)
    modalities: list[str] | None = Field(None, description='["text"] only (400 otherwise)')
    prediction: dict[str, Any] | None = Field(None, description=_REFUSED)
    web_search_options: dict[str, Any] | None = Field(None, description=_REFUSED)
    functions: list[Any] | None = Field(None, description="deprecated by OpenAI: use tools (400)")
    function_call: str | dict[str, Any] | None = Field(None, description="deprecated by OpenAI: use tool_choice (400)")
    store: bool | None = Field(None, description="false only (400 otherwise): nothing is stored",
                               json_schema_extra={"enum": [False, None]})
    reasoning_effort: str | None = Field(None, description=_REFUSED)

    _UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "audio": (), "modalities": (["text"],), "prediction": (), "web_search_options": (), "functions": (),
        "function_call": (), "store": (False,), "reasoning_effort": (),
    }

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def checked(self) -> ChatCompletionRequest:
        super().checked()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                raise APIError(400, f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}",
                               param=f"messages[{i}].role")
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise APIError(400, f"messages[{i}].content is required (only an assistant message with tool_calls "
                               "may leave it out or null)", param=f"messages[{i}].content")
            if m.tool_calls and m.role != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                               param=f"messages[{i}].tool_calls")
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"messages[{i}].content[{j}]: only {{type: 'text', text}} parts are "
                                       f"supported, got type {part.type!r}", param=f"messages[{i}].content")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError(400, f"tools: function names must be unique, got {names}", param="tools")
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if not self.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                           f"({', '.join(names)})", param="tool_choice")
        if self.forces_call:
            other = "grammar" if self.grammar is not None else "json_schema" if self.json_schema is not None else \
                "response_format" if self.response_format is not None and self.response_format.type != "text" else None
            if other is not None:
                raise APIError(400, f"tool_choice {self._shown_choice} constrains the reply to a tool call, so "
                               f"{other} cannot constrain it too", param=other)

    @property
    def forces_call(self) -> bool:
        """tool_choice "required" or a named function: the reply is constrained to tool calls."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def _shown_choice(self) -> str:
        choice = self.tool_choice
        return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"

    def forced_schema(self) -> dict[str, Any] | None:
        """The schema of the reply a forced tool_choice allows: the named function's call, or for "required" calls
        to any tool (a JSON list of 1 to MAX_FORCED_CALLS; one call when parallel_tool_calls is false), written
        compactly. The reply is then the calls' JSON alone, parsed whatever format the model's template teaches."""
        if not self.forces_call:
            return None
        choice, tools = self.tool_choice, self.tools_offered
        if isinstance(choice, NamedToolChoice):
            schema = tool_call_schema(tools, choice.function.name)
        else:
            schema = tool_call_schema(tools)
            if self.parallel_tool_calls is not False:
                schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": MAX_FORCED_CALLS}
        return {**schema, "x-guidance": COMPACT_JSON}

    @property
    def max_tool_calls(self) -> int | None:
        return 1 if self.parallel_tool_calls is False else None

    @property
    def tools_offered(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (None: none, or tool_choice "none", which offers none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates want them (as transformers and vLLM hand them over): content as one string
        (None for an assistant's tool calls without text), `developer` as `system`, tool-call arguments as
        objects (templates write them with `tojson`), and a tool message's `name` filled in from the call it
        answers (some templates print it)."""
        out, call_names = [], {}
        for i, m in enumerate(self.messages):
            text = m.content if m.content is None or isinstance(m.content, str) else "".join(
                p.text or "" for p in m.content)
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [self._template_call(i, j, call) for j, call in enumerate(m.tool_calls)]
                call_names.update({c.id: c.function.name for c in m.tool_calls if c.id})
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
                if m.role == "tool" and "name" not in message and m.tool_call_id in call_names:
                    message["name"] = call_names[m.tool_call_id]
            out.append(message)
        return out

    @staticmethod
    def _template_call(i: int, j: int, call: ToolCall) -> dict[str, Any]:
        try:
            arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
        except json.JSONDecodeError as e:
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            raise APIError(400, f"{param} is not valid JSON: {e}", param=param) from None
        return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


class CompletionRequest(_GenerationRequest):
    prompt: NonEmptyText | NonEmptyIds | Annotated[list[NonEmptyText], OnePrompt] \
        | Annotated[list[NonEmptyIds], OnePrompt] = Field(
        description="text, or token ids; a list of one of them is taken too (several: 400)")
    logprobs: _whole(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    echo: bool = Field(False, description="return the prompt before the completion (with logprobs: the prompt "
                       "tokens' too, the first one null, as OpenAI does)")
    max_tokens: _whole(ge=0) | None = Field(None, description="[until the context is full]; 0 only with echo "
                                        "(score the prompt, generate nothing)")
    best_of: WholeInt | None = Field(None, description="1 only (400 otherwise): tandem returns every choice it makes",
                                     json_schema_extra={"enum": [1, None]})
    suffix: str | None = Field(None, description="not supported (400): no fill-in-the-middle",
                               json_schema_extra={"enum": ["", None]})

    _UNSUPPORTED: ClassVar[dict[str, tuple]] = {"best_of": (1,), "suffix": ("",)}

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def checked(self) -> CompletionRequest:
        super().checked()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise APIError(400, f"a batch of {len(self.prompt)} prompts is not supported: send one prompt per "
                               f"request (n gives several choices for one prompt)", param="prompt")
            self.prompt = self.prompt[0]
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 is allowed only with echo (scoring the prompt)", param="max_tokens")
        return self


def parse_request(model: type[_GenerationRequest], body: bytes) -> Any:
    """Validate a raw JSON body into `model`; raise APIError(400) naming the first offending field."""
    if not body.strip():
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        # The deepest location is the most specific: for `stop: [1]` it is stop[0], not the `str` branch of stop.
        err = max(e.errors(include_url=False), key=lambda x: len(x["loc"]))
        if err["type"] == "json_invalid":
            raise APIError(400, f"malformed JSON in the request body: {err['msg']}") from None
        param = _param_name(err["loc"])
        where = f"{param}: " if param else "the request body: "
        raise APIError(400, where + err["msg"], param=param) from None
    return request.checked()


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|constrained-\w+|function-\w+\[.*\]|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


def _param_name(loc: tuple) -> str | None:
    """'messages[0].content' from pydantic's loc, dropping the union-member tags it inserts ('str', 'list[int]')."""
    name = ""
    for item in loc:
        if isinstance(item, int):
            name += f"[{item}]"
        elif not _TYPE_TAG.match(item):
            name += f".{item}" if name else item
    return name or None
