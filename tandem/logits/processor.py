"""One request's logits processing: what it asked for (`LogitsSettings`) and the state that follows its tokens
(`LogitsProcessor`: penalty counts, the recent window, the grammar's matcher).
More: docs/internals.md."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tandem.loading.tokenizer import Tokenizer
from tandem.logits.adjust import apply_bias, apply_bitmask, apply_frequency_presence, apply_repeat_penalty
from tandem.logits.grammar import Grammar, Matcher

MAX_BIAS = 100.0  # OpenAI's logit_bias range: -100..100
MAX_PENALTY = 2.0  # OpenAI's frequency/presence range: -2..2
DEFAULT_REPEAT_LAST_N = 64  # llama.cpp's default window


class LogitsError(ValueError):
    """Invalid logits-processing settings; `param` names the offending option."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class LogitsSettings:
    """How a request adjusts the target's logits before sampling, in this order:

    logit_bias: token id -> value added to its logit (OpenAI: -100..100; -100 bans, 100 all but forces).
    frequency_penalty, presence_penalty: OpenAI's, subtracted per occurrence / once per generated token (-2..2);
        they count the generated tokens only (as OpenAI and vLLM do), not the prompt.
    repeat_penalty, repeat_last_n: llama.cpp's, over the last repeat_last_n tokens of prompt and output (-1: the
        whole context, 0: off); 1.0 is off.
    grammar: the output must match it (tandem.logits.grammar); a grammar that completes ends the generation.
    """

    logit_bias: Mapping[int, float] = field(default_factory=dict)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise LogitsError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}", "logit_bias")
            if not _number(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
                raise LogitsError(f"logit_bias[{token}] must be a number in [-100, 100], got {bias!r}", "logit_bias")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise LogitsError(f"{name} must be a number in [-2, 2], got {value!r}", name)
        if not _number(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise LogitsError(f"repeat_penalty must be a number > 0, got {self.repeat_penalty!r}", "repeat_penalty")
        if not isinstance(self.repeat_last_n, int) or self.repeat_last_n < -1:
            raise LogitsError(f"repeat_last_n must be an integer >= -1, got {self.repeat_last_n!r}", "repeat_last_n")

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.counts_tokens or self.windowed or self.grammar is not None

    @property
    def counts_tokens(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def windowed(self) -> bool:
        return self.repeat_penalty != 1.0 and self.repeat_last_n != 0

    def check_vocab(self, vocab: int) -> None:
        """Every biased id must be a row of the model's logits."""
        bad = sorted(t for t in self.logit_bias if t >= vocab)
        if bad:
            raise LogitsError(f"logit_bias token ids {bad[:5]} are out of range [0, {vocab})", "logit_bias")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class LogitsProcessor:
    """A request's logits processing over its generation. `rows` adjusts logits for offsets after some drafts;
    `accept` advances the state by the tokens the verifier kept."""

    def __init__(self, settings: LogitsSettings, tokenizer: Tokenizer, vocab: int, prompt: list[int],
                 device: torch.device) -> None:
        settings.check_vocab(vocab)
        self.settings, self.vocab, self.device = settings, vocab, device
        self.bias_ids = torch.tensor(list(settings.logit_bias), dtype=torch.long, device=device)
        self.bias_values = torch.tensor(list(settings.logit_bias.values()), dtype=torch.float64, device=device)
        # Generated tokens' counts (frequency/presence), when asked for.
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device) if settings.counts_tokens else None
        # The repeat window: the last n tokens of prompt + output, or (n = -1) the set of every token seen; only
        # what a row needs is kept, so a step's cost does not grow with the output.
        n = settings.repeat_last_n
        self.recent = list(prompt[-n:]) if settings.windowed and n > 0 else None
        self.seen = set(prompt) if settings.windowed and n < 0 else None
        self.matcher = Matcher(settings.grammar, tokenizer, vocab) if settings.grammar is not None else None

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but a stop token may follow, so the generation ends here."""
        return self.matcher is not None and self.matcher.finished

    def usable(self, drafts: list[int]) -> int:
        """How many leading drafts a verifier may be given: those the grammar allows (prompt lookup proposes
        without it), none past a stop token or the grammar's end."""
        return self.matcher.extend(drafts) if self.matcher is not None else len(drafts)

    def rows(self, logits: torch.Tensor, drafts: list[int], first: int = 0) -> torch.Tensor:
        """logits [m, W] adjusted, row i as at offset first + i (after drafts[:first + i] on top of the accepted
        tokens). W may be narrower than the vocabulary (a draft's rows)."""
        settings, (m, width), device = self.settings, logits.shape, logits.device  # a draft may live elsewhere
        out = logits
        if settings.logit_bias:
            keep = self.bias_ids < width
            out = apply_bias(out, self.bias_ids[keep].to(device), self.bias_values[keep].to(device))
        if self.counts is not None:
            counts = self.counts[:width].to(device).expand(m, width).clone()
            pairs = [(i, t) for i in range(m) for t in drafts[: first + i] if t < width]
            if pairs:
                index = torch.tensor(pairs, dtype=torch.long, device=device).T
                counts.index_put_((index[0], index[1]), torch.ones(index.shape[1], device=device),
                                  accumulate=True)
            out = apply_frequency_presence(out, counts, settings.frequency_penalty, settings.presence_penalty)
        if settings.windowed:
            n = settings.repeat_last_n
            windows = []
            for i in range(m):
                extra = drafts[: first + i]
                window = (self.recent + extra)[-n:] if n > 0 else list(self.seen.union(extra))
                windows.append([min(t, width - 1) for t in window])  # a narrower draft: ids past it, clipped
            longest = max(len(w) for w in windows)
            # Rows padded with their own first id: penalizing a token twice writes the same value twice.
            ids = torch.tensor([w + w[:1] * (longest - len(w)) for w in windows], dtype=torch.long, device=device)
            out = apply_repeat_penalty(out, ids, settings.repeat_penalty)
        if self.matcher is not None:
            out = apply_bitmask(out, self.matcher.bitmask(drafts, first, m))
        return out

    def accept(self, tokens: list[int]) -> None:
        """The verifier kept `tokens` (accepted drafts and the target's own next token)."""
        if self.counts is not None and tokens:
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            self.counts.index_add_(0, ids, torch.ones(len(tokens), device=self.device))
        if self.recent is not None:
            self.recent = (self.recent + tokens)[-self.settings.repeat_last_n :]
        if self.seen is not None:
            self.seen.update(tokens)
        if self.matcher is not None:
            self.matcher.commit(tokens)

    def cut_draft(self, drawn: list[int], dists: list) -> bool:
        """After the draft model drew drawn[-1]: drop it (and its distribution) if the grammar refuses it or it is
        a stop token; True when this sequence drafts no further (so, too, after a token that completes the
        grammar)."""
        n = self.usable(drawn)
        if n < len(drawn):
            del drawn[n:], dists[n:]
            return True
        return self.matcher is not None and self.matcher.matcher.is_stopped()


def processor_for(settings: LogitsSettings | None, tokenizer: Tokenizer, vocab: int, prompt: list[int],
                  device: torch.device) -> LogitsProcessor | None:
    """A request's processor, or None when it adjusts nothing (the engine then does no per-step work for it)."""
    if settings is None or not settings.active:
        return None
    return LogitsProcessor(settings, tokenizer, vocab, prompt, device)
