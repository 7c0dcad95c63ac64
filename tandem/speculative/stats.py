"""Statistics of one generation. Every duration covers this generation only and is in milliseconds (`_ms`).

llama.cpp's `dur(g)` is a server-lifetime total that its own user read as a per-step time; nothing here is
cumulative across requests, and per-token figures say so in their name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # tokens of the prompt (those reused from an earlier request's KV included)
    cached_tokens: int = 0  # of those, tokens whose KV an earlier request left (prefix reuse), not recomputed
    generated_tokens: int = 0  # tokens returned to the caller
    draft_tokens: int = 0  # draft tokens proposed to the verifier, over the whole generation
    accepted_tokens: int = 0  # of those, kept by the verifier
    iterations: int = 0  # target forwards after the prefill (one per speculative or plain step)
    prefill_ms: float = 0.0  # target (and draft) prompt processing, up to the first token
    decode_ms: float = 0.0  # everything after the first token: draft + verify + bookkeeping
    draft_ms: float = 0.0  # total time proposing draft tokens in this generation
    verify_ms: float = 0.0  # total time of the target's verify/plain forwards and acceptance in this generation
    proposer: str = "none"  # "draft-model", "ngram", "mixed" (the draft model and prompt lookup), "none"
    draft_kind: str = "model"  # what drafts as the "draft-model" source: a draft "model", or a "head" (decisions/0004)
    policy: str = "none"  # "fixed", "adaptive", "none"
    draft_len_counts: dict[int, int] = field(default_factory=dict)  # k chosen -> iterations that used it
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = iterations that accepted draft token i
    # Per proposer source ("draft-model", "ngram"): iterations it drafted, tokens drafted and accepted, and its
    # catch-ups (tokens taken in at once, with the ms they cost and how many generated tokens the draft would have
    # predicted among them: `evidence_matches` of `evidence_positions`).
    sources: dict[str, dict[str, float]] = field(default_factory=dict)
    # What the adaptive policy believed at the end: acceptance per source, the prior it started from, and the mean
    # speed-up over plain its plans predicted, step by step (Engine._retire).
    belief: dict = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """accepted_tokens / draft_tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per target forward after the prefill (1.0 = plain decoding)."""
        return (self.generated_tokens - 1) / self.iterations if self.iterations else 0.0

    @property
    def tokens_per_second(self) -> float:
        """generated_tokens / (prefill_ms + decode_ms), the throughput the caller saw."""
        total_ms = self.prefill_ms + self.decode_ms
        return 1000.0 * self.generated_tokens / total_ms if total_ms > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second of decode time (excludes the prompt)."""
        return 1000.0 * (self.generated_tokens - 1) / self.decode_ms if self.decode_ms > 0 else 0.0

    @property
    def draft_ms_per_token(self) -> float:
        return self.draft_ms / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def verify_ms_per_iteration(self) -> float:
        return self.verify_ms / self.iterations if self.iterations else 0.0

    def _source(self, source: str) -> dict[str, float]:
        return self.sources.setdefault(source, {"iterations": 0, "draft_tokens": 0, "accepted_tokens": 0,
                                                "catch_up_ms": 0.0, "evidence_matches": 0, "evidence_positions": 0})

    def record_catch_up(self, source: str, ms: float, matches: int, positions: int) -> None:
        entry = self._source(source)
        entry["catch_up_ms"] += ms
        entry["evidence_matches"] += matches
        entry["evidence_positions"] += positions

    def record_iteration(self, k: int, n_accepted: int, source: str | None = None) -> None:
        if source is not None and k > 0:
            entry = self._source(source)
            entry["iterations"] += 1
            entry["draft_tokens"] += k
            entry["accepted_tokens"] += n_accepted
        self.iterations += 1
        self.draft_tokens += k
        self.accepted_tokens += n_accepted
        self.draft_len_counts[k] = self.draft_len_counts.get(k, 0) + 1  # sorted when read out (to_dict)
        if len(self.accepted_per_position) < k:
            self.accepted_per_position.extend([0] * (k - len(self.accepted_per_position)))
        for i in range(n_accepted):
            self.accepted_per_position[i] += 1

    def to_dict(self) -> dict:
        out = asdict(self)
        out["draft_len_counts"] = {str(k): v for k, v in sorted(self.draft_len_counts.items())}
        for name in ("acceptance_rate", "mean_accepted_len", "tokens_per_second", "decode_tokens_per_second",
                     "draft_ms_per_token", "verify_ms_per_iteration"):
            out[name] = getattr(self, name)
        return out
