"""Grammars for structured output (OpenAI's response_format, llama-server's GBNF `grammar`), through llguidance.
More: docs/internals.md."""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.loading.tokenizer import Tokenizer
from tandem.logits.adjust import BITS

# Free whitespace a JSON grammar allows in one gap (after a brace, around a colon or comma): a weak or random-weight
# model could otherwise emit blanks until max_tokens. 16 holds the indentation of pretty-printed JSON a few levels deep.
WHITESPACE_BOUND = 16
JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{WHITESPACE_BOUND}}}"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# JSON written as json.dumps writes it (no free whitespace), for replies no one reads as text (forced tool calls):
# a schema carrying it as "x-guidance" spends no tokens on blanks, whatever the model would like to write.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled (the message says why)."""


@dataclass(frozen=True)
class Grammar:
    """A compiled-to-text llguidance grammar and what it came from ("json_object", "json_schema", "grammar")."""

    source: str
    kind: str


def _checked(source: str, kind: str, what: str) -> Grammar:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source)
    if is_error:
        raise GrammarError(f"{what}: {messages[0] if messages else 'rejected by the grammar compiler'}")
    return Grammar(source, kind)


def json_grammar(schema: dict[str, Any] | bool | None = None) -> Grammar:
    """JSON matching `schema` (None: any JSON object, OpenAI's json_object), with bounded free whitespace."""
    import llguidance

    if schema is None:
        return _checked(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS),
                        "json_object", "json_object")
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"the JSON schema must be an object, got {type(schema).__name__}")
    # A schema with its own llguidance options ("x-guidance", e.g. COMPACT_JSON) is taken as it says.
    defaults = None if isinstance(schema, dict) and "x-guidance" in schema else JSON_OPTIONS
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None
    return _checked(source, "json_schema", "invalid JSON schema")


def text_grammar(text: str) -> Grammar:
    """A GBNF grammar (llama.cpp's format, `root` its start rule) or a Lark grammar (llguidance's own)."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    if not text.strip():
        raise GrammarError("the grammar is empty")
    try:
        lark = any_to_lark(text)
    except Exception as e:  # noqa: BLE001  (the converter raises its own error types for bad input)
        raise GrammarError(f"invalid grammar: {e}") from None
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), "grammar", "invalid grammar")


def response_format_grammar(response_format: dict[str, Any] | None) -> Grammar | None:
    """OpenAI's response_format: {"type": "text"} (None), {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}; llama-server's {"type": "json_object", "schema":
    {...}} constrains to the schema too."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise GrammarError(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}")
    if kind == "text":
        return None
    if response_format.get("schema") is not None:  # llama-server's {"type": "json_object", "schema": {...}}
        if kind == "json_schema" and response_format.get("json_schema") is not None:
            raise GrammarError("response_format: give json_schema.schema or schema, not both")
        return json_grammar(response_format["schema"])
    if kind == "json_object":
        return json_grammar()
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError("response_format json_schema needs a json_schema object: {name, schema}")
    schema = spec.get("schema", {})
    return json_grammar(schema if schema is not None else {})


# One llguidance view of a vocabulary per (tokenizer, logits width): building it reads the whole vocabulary (~1 s
# for Qwen's 152k tokens), so it is made on a tokenizer's first constrained request and kept with the tokenizer.
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, dict[int, Any]] = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Tokenizer, vocab: int):
    """llguidance's tokenizer for `tokenizer`, with masks `vocab` wide (a model's rows past its tokenizer's
    tokens are never allowed)."""
    import llguidance

    views = _LL_TOKENIZERS.setdefault(tokenizer, {})
    if vocab not in views:
        views[vocab] = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab,
                                              eos_token=list(tokenizer.eos_token_ids))
    return views[vocab]


def allows(bitmask: np.ndarray, token: int) -> bool:
    """Whether a row's bitmask (int32 words) allows `token`."""
    return bool((int(bitmask[token // BITS]) >> (token % BITS)) & 1)


class Matcher:
    """One sequence's grammar state: the committed tokens, plus draft tokens advanced tentatively on top.

    Invariant: `masks[r]` is the mask after the committed tokens and `pending[:r]`, for r <= len(pending).
    """

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer, vocab: int) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab), grammar.source, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self.words = (vocab + BITS - 1) // BITS
        self.stop_token_ids = frozenset(tokenizer.eos_token_ids)
        self.pending: list[int] = []
        self.masks: list[np.ndarray] = []

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows no further token but a stop token."""
        return self.matcher.is_stopped() and not self.pending

    def _align(self, tokens: list[int]) -> None:
        """Roll the tentative tokens back to their longest common prefix with `tokens`."""
        common = 0
        for a, b in zip(self.pending, tokens, strict=False):
            if a != b:
                break
            common += 1
        if common < len(self.pending):
            self.matcher.rollback(len(self.pending) - common)
            del self.pending[common:]
            del self.masks[common + 1 :]

    def mask(self, offset: int) -> np.ndarray:
        """The mask after the committed tokens and pending[:offset] (computed once; offset <= len(pending))."""
        while len(self.masks) <= offset:
            row = np.empty(self.words, dtype=np.int32)
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            self.masks.append(row)
        return self.masks[offset]

    def extend(self, tokens: list[int]) -> int:
        """Advance tentatively along `tokens` (drafts after the committed state) as far as the grammar allows them,
        stopping before a stop token and after a token that completes the grammar. Returns how many it took."""
        self._align(tokens)
        while len(self.pending) < len(tokens):
            token = tokens[len(self.pending)]
            if self.matcher.is_stopped() or token in self.stop_token_ids or \
                    not allows(self.mask(len(self.pending)), token):
                break
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar matcher refused token {token} its mask allowed: "
                                   f"{self.matcher.get_error()}")
            self.pending.append(token)
        return len(self.pending)

    def bitmask(self, drafts: list[int], first: int, count: int) -> torch.Tensor:
        """[count, words] int32 masks at offsets first .. first + count - 1 after the committed tokens, offset r
        following drafts[:r] (which the grammar must allow: drafts are proposed under it)."""
        last = first + count - 1
        if self.extend(drafts[:last]) < last:
            raise RuntimeError(f"draft tokens {drafts[:last]} leave the grammar; proposals must be cut first")
        return torch.from_numpy(np.stack([self.mask(r) for r in range(first, last + 1)]))

    def commit(self, tokens: list[int]) -> None:
        """The verifier kept `tokens`: advance the committed state past them (up to a stop token, which ends the
        sequence), rolling back drafts it did not keep."""
        end = next((i for i, t in enumerate(tokens) if t in self.stop_token_ids), len(tokens))
        tokens = tokens[:end]
        if self.extend(tokens) < len(tokens):
            raise RuntimeError(f"the target chose tokens {tokens} the grammar refuses: {self.matcher.get_error()}")
        self.masks = self.masks[len(tokens) : len(tokens) + 1]
        self.pending = []
