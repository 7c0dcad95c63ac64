"""The tokenizer a GGUF file describes, built with maintained libraries (no hand-written BPE).
More: docs/internals.md."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from tandem.loading.gguf import GGUFError, GGUFFile, eos_token_ids_from_metadata, open_gguf

# Used when a file carries no `tokenizer.chat_template`.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
TOKEN_TYPE_USER_DEFINED = 4
REPLACEMENT_CHAR = "\ufffd"

# GGUF tokenizer keys -> the names transformers' converter expects (mirrors its GGUF_TOKENIZER_MAPPING).
_GGUF_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.precompiled_charsmap": "precompiled_charsmap",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}


def _build_backend(architecture: str, metadata: dict[str, Any], path: str) -> Any:
    """A `tokenizers.Tokenizer` for this file's vocabulary."""
    tokenizer_dict = {name: metadata[key] for key, name in _GGUF_TOKENIZER_KEYS.items() if key in metadata}
    if "tokens" not in tokenizer_dict:
        raise GGUFError(f"{path}: missing metadata key 'tokenizer.ggml.tokens' (no vocabulary in the file)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the converter must never reach for the hub
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:
        convert_gguf_tokenizer = None
    fallback = _FALLBACK_BUILDERS.get(tokenizer_dict.get("tokenizer_type"))
    if convert_gguf_tokenizer is not None:
        try:
            backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
            return backend
        except ValueError as exc:  # a tokenizer type this transformers does not know
            if fallback is None:
                raise GGUFError(f"{path}: {exc}") from exc
    if fallback is not None:
        return fallback(tokenizer_dict)
    raise GGUFError(
        f"{path}: tokenizer type {tokenizer_dict.get('tokenizer_type')!r} needs transformers' GGUF converter, "
        "which this transformers version lacks"
    )


def _byte_level_bpe(tokenizer_dict: dict[str, Any]) -> Any:
    """Fallback for `gpt2` vocabularies: tokenizers' BPE model, ByteLevel pre-tokenizer and decoder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = tokenizer_dict["tokens"]
    merges = [tuple(m.split(" ", 1)) for m in tokenizer_dict.get("merges", [])]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    types = tokenizer_dict.get("token_type") or []
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=False)
            if k == TOKEN_TYPE_CONTROL
        ]
    )
    return backend


def _gemma4_bpe(tokenizer_dict: dict[str, Any]) -> Any:
    """Fallback for `gemma4` vocabularies: BPE over text whose spaces are `▁`, unknown characters as `<0xXX>` byte
    tokens; control tokens whole and special, user-defined ones whole (as transformers' GemmaTokenizer and its GGUF
    converter build it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = tokenizer_dict["tokens"]
    merges = [tuple(m.split(" ", 1)) for m in tokenizer_dict.get("merges", [])]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=True,
                                   unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    types = tokenizer_dict.get("token_type") or []
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types, strict=False) if k == TOKEN_TYPE_CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types, strict=False) if k == TOKEN_TYPE_USER_DEFINED])
    return backend


_FALLBACK_BUILDERS = {"gpt2": _byte_level_bpe, "gemma4": _gemma4_bpe}


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _compile_template(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Same environment settings transformers uses for chat templates.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary, plus its chat template."""

    def __init__(
        self,
        backend: Any,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos: bool,
        chat_template: str | None,
    ):
        self.backend = backend  # a tokenizers.Tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template = _compile_template(chat_template or CHATML_TEMPLATE)

    @classmethod
    def from_gguf(cls, source: GGUFFile | str | os.PathLike[str]) -> Tokenizer:
        gf = source if isinstance(source, GGUFFile) else open_gguf(source)
        meta = gf.metadata
        backend = _build_backend(gf.architecture, meta, gf.path)
        model_type = meta.get("tokenizer.ggml.model")
        # llama.cpp adds BOS to SentencePiece (`llama`) vocabularies unless the file says otherwise.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model_type == "llama"))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_token_ids_from_metadata(meta, gf.architecture),
            add_bos=add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_start|>`) become their single ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary entry as stored (byte-level symbols for gpt2 vocabularies)."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, piece: str) -> int | None:
        return self.backend.token_to_id(piece)

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]) under the file's template.

        tools: OpenAI-style tool objects ({"type": "function", "function": {name, description, parameters}}),
        handed to the template as `tools` (None when there are none), as transformers' apply_chat_template does.
        """
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self.bos_token_id),
            eos_token=self._special_text(eos),
            **kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        # Templates that want BOS write `{{ bos_token }}` themselves, so none is added here.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_bos=False)


class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get back only newly completed text. It decodes a window
    of recent ids (keeping SentencePiece's leading spaces right) and holds back an unfinished UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context so the next token decodes as it would in the full text
        self._read_offset = 0  # ids before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (possibly with replacement characters), then reset."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._ids, self._prefix_offset, self._read_offset = [], 0, 0
        return full_text[len(prefix_text) :]
