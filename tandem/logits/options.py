"""From the options an API call carries (OpenAI's names, llama-server's extras) to LogitsSettings, with errors that
name the offending option (`LogitsError.param`), for the server's 400s and the Python API's ValueErrors alike."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tandem.logits.grammar import GrammarError, json_grammar, response_format_grammar, text_grammar
from tandem.logits.processor import DEFAULT_REPEAT_LAST_N, LogitsError, LogitsSettings

_TOKEN_ID = re.compile(r"\s*\d+\s*")


def logits_settings(response_format: Mapping[str, Any] | None = None, json_schema: Mapping[str, Any] | None = None,
                    grammar: str | None = None, logit_bias: Mapping[int | str, float] | None = None,
                    frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
                    repeat_last_n: int = DEFAULT_REPEAT_LAST_N, vocab: int | None = None) -> LogitsSettings | None:
    """The logits processing these options ask for (None: none). At most one of response_format (OpenAI's),
    json_schema (a schema) and grammar (GBNF or Lark) constrains the output; logit_bias keys may be ids or their
    decimal strings (JSON's object keys); vocab, when given, bounds the ids."""
    given = [name for name, value in (("response_format", response_format), ("json_schema", json_schema),
                                      ("grammar", grammar)) if value is not None]
    if response_format is not None and response_format.get("type") == "text":
        given.remove("response_format")  # OpenAI's default: no constraint, and no conflict with a grammar
    if len(given) > 1:
        raise LogitsError(f"give one of {' and '.join(given)}, not both", param=given[-1])
    try:
        constraint = response_format_grammar(dict(response_format)) if response_format is not None else \
            json_grammar(dict(json_schema)) if json_schema is not None else \
            text_grammar(grammar) if grammar is not None else None
    except GrammarError as e:
        raise LogitsError(str(e), param=given[0] if given else "response_format") from None
    bias = {}
    for key, value in (logit_bias or {}).items():
        if isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool):
            raise LogitsError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        bias[key] = value
    settings = LogitsSettings(bias, frequency_penalty, presence_penalty, repeat_penalty, repeat_last_n, constraint)
    if vocab is not None:
        settings.check_vocab(vocab)
    return settings if settings.active else None
