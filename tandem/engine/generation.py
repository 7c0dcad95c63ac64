"""One request's state in the batched engine, and what the engine hands back for it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from tandem.backends.base import ContextOverflowError
from tandem.config import DRAFT_POLICIES, POLICY
from tandem.loading.tokenizer import StreamDecoder, Tokenizer
from tandem.logits.processor import LogitsProcessor, LogitsSettings
from tandem.sampling import SamplingParams, make_generator
from tandem.speculative.policy import DRAFT_MODEL_SOURCE, lookup_share
from tandem.speculative.proposer import NgramProposer
from tandem.speculative.stats import GenerationStats

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass
class StepTimes:
    """A step's clock readings (perf_counter seconds): the parts each generation's stats are told of."""

    started: float
    admitting: float = 0.0  # before admission (which precedes `started`: no generation's time)
    planned: float = 0.0  # after the plan
    drafted: float = 0.0  # after the drafts (where drawn on the device: when the device had them)
    forwarded: float = 0.0  # after the target's forward was queued
    finished: float = 0.0  # after the verify's outcomes were read
    prefilled: float = 0.0  # after the draft's share of the prompt chunks (`finished` where it had none)
    ended: float = 0.0  # after the step's bookkeeping
    rows: int = 0  # the target's rows in the forward
    sequences: int = 0  # ... and the sequences they were of
    prompts: bool = False  # ... some of them prompt rows
    draft_prefills: int = 0  # prompt chunks the draft took in beside the target's

    @property
    def draft_ms(self) -> float:  # the plan and the drafts
        return 1000.0 * (self.drafted - self.started)

    @property
    def draft_step_ms(self) -> float:  # the drafts alone
        return 1000.0 * (self.drafted - self.planned)

    @property
    def verify_ms(self) -> float:
        return 1000.0 * (self.finished - self.drafted)

    @property
    def step_ms(self) -> float:
        return 1000.0 * (self.finished - self.started)


@dataclass
class TokenLogprob:
    """The target's log-probability of an emitted token, and of its most likely alternatives at that position.

    Raw log-probabilities: log-softmax of the target's logits, before temperature and truncation (vLLM's default),
    so they describe the model, not the sampling settings; drafted-and-accepted tokens get the target's own.
    """

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), most likely first


@dataclass
class GenerationChunk:
    text: str  # new text since the previous chunk
    tokens: list[int]  # new token ids since the previous chunk
    finish_reason: str | None = None  # set on the last chunk: "stop" | "length"
    stats: GenerationStats | None = None  # set on the last chunk
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens`, when the request asked for them
    stop_string: str | None = None  # set on the last chunk when a stop string ended the text: which one


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]  # generated ids (without the prompt, without a stop token)
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens or the context is full)
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them


def check_prompt(prompt: Seq[int], vocab: int, n_ctx: int) -> None:
    """What a prompt must be for a model of `vocab` tokens and `n_ctx` positions: the one check, the engine's and
    the server's (which answers it as a 400). Raises ValueError, or ContextOverflowError for a prompt that leaves
    no room for a generated token."""
    if not prompt:
        raise ValueError("the prompt is empty: at least one token is needed")
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of range [0, {vocab})")
    if len(prompt) >= n_ctx:
        raise ContextOverflowError(
            f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}, with room for at least one "
            f"generated token: {len(prompt) - n_ctx + 1} tokens too many")


@dataclass
class Request:
    """What a caller asks of the engine: a tokenized prompt and how to continue it."""

    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: Seq[str] = ()  # strings that end the text (not included)
    ignore_eos: bool = False
    speculate: bool = True  # use the engine's proposer, if it has one
    draft_max: int | None = None  # at most this many drafts an iteration (None: the engine's draft_max)
    draft_policy: str = "adaptive"  # "adaptive": draft lengths from measured costs; "fixed": always draft_max
    logprobs: int | None = None  # None: none; n >= 0: each token's log-probability and its n likeliest alternatives
    logits: LogitsSettings | None = None  # logit_bias, penalties, a grammar (tandem.logits): None adjusts nothing

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if not self.prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.draft_max is not None and self.draft_max < 0:
            raise ValueError(f"draft_max must be >= 0, got {self.draft_max}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"unknown draft policy {self.draft_policy!r}; choose adaptive or fixed")


DRAFT_MODEL = DRAFT_MODEL_SOURCE


class Estimate:
    """One proposer source's acceptance within a request: counts of accepted and reached draft positions, each
    iteration's weighing POLICY.acceptance_decay times the one before, so the estimate follows the text. Started from,
    and fading back to while unused, a prior (pseudo-counts)."""

    def __init__(self, prior: tuple[float, float]) -> None:
        self.prior = prior
        self.accepted, self.drafted = prior
        self.settled_at = 0  # the request's count of plain iterations when these counts were last brought up to date
        self.request_accepted = self.request_reached = 0  # over the request, for the shared prior

    def acceptance(self, plain_iterations: int) -> float:
        accepted, drafted = self.counts(plain_iterations)
        return accepted / drafted

    def counts(self, plain_iterations: int) -> tuple[float, float]:
        """(accepted, drafted) now, faded towards the prior by the plain iterations since the last update."""
        return self._faded(plain_iterations - self.settled_at)

    def settle(self, plain_iterations: int) -> None:
        """Apply the fading of the plain iterations since the last update (before new evidence is added)."""
        self.accepted, self.drafted = self._faded(plain_iterations - self.settled_at)
        self.settled_at = plain_iterations

    def _faded(self, idle: int) -> tuple[float, float]:
        if idle == 0:
            return self.accepted, self.drafted
        fade = POLICY.idle_decay**idle
        return (self.prior[0] + fade * (self.accepted - self.prior[0]),
                self.prior[1] + fade * (self.drafted - self.prior[1]))

    def observe(self, accepted: int, reached: int) -> None:
        """One drafting iteration: `reached` positions (the accepted ones and the first rejected), `accepted` kept."""
        self.accepted = POLICY.acceptance_decay * self.accepted + accepted
        self.drafted = POLICY.acceptance_decay * self.drafted + reached
        self.request_accepted += accepted
        self.request_reached += reached

    def observe_matches(self, matched: Seq[bool]) -> None:
        """Evidence, in order: whether the source would have predicted each token; each weighs as an iteration."""
        for match in matched:
            self.accepted = POLICY.acceptance_decay * self.accepted + match
            self.drafted = POLICY.acceptance_decay * self.drafted + 1.0
        self.request_accepted += sum(matched)
        self.request_reached += len(matched)


class TextStream:
    """Token ids -> text, holding back any tail that could still begin a stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: Seq[str]) -> None:
        self.detok = StreamDecoder(tokenizer)
        self.stops = [s for s in stops if s]
        self.held = ""  # decoded, not yet returned
        self.stopped = False  # a stop string was found; `held` is the text before it
        self.stop_string: str | None = None  # the one found (the earliest in the text)

    def push(self, tokens: Seq[int]) -> str:
        """Text now safe to return; sets `stopped` (and returns "") when a stop string ended the text."""
        self.held += "".join(self.detok.push(t) for t in tokens)
        if self._cut():
            return ""
        safe = len(self.held) - _longest_stop_prefix(self.held, self.stops)
        out, self.held = self.held[:safe], self.held[safe:]
        return out

    def finish(self) -> str:
        """The rest of the text once generation ends (cut at a stop string if one is found)."""
        if not self.stopped:
            self.held += self.detok.flush()
            self._cut()
        out, self.held = self.held, ""
        return out

    def _cut(self) -> bool:
        hits = [(i, s) for i, s in ((self.held.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.stop_string = min(hits, key=lambda hit: hit[0])
            self.held, self.stopped = self.held[:at], True
        return self.stopped


def _longest_stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


_ids = itertools.count()


def cut_tokens(new_tokens: list[int], stop_token_ids: frozenset[int], emitted: int,
               max_tokens: int) -> tuple[list[int], str | None]:
    """New tokens cut at a stop token (not returned) or at max_tokens, and why they were cut ("stop", "length",
    or None when they were not)."""
    out = []
    for token in new_tokens:
        if token in stop_token_ids:
            return out, "stop"
        out.append(token)
        if emitted + len(out) >= max_tokens:
            return out, "length"
    return out, None


class Generation:
    """A request inside the engine. Invariant while decoding: the target's slot holds every token of `tokens`
    but the last (the pending token, which the next forward feeds first); the draft's slot holds a prefix of them."""

    def __init__(self, request: Request, tokenizer: Tokenizer, device: torch.device, draft_max: int,
                 stop_token_ids: frozenset[int], proposer: str | None,
                 priors: dict[str, tuple[float, float]] | None = None) -> None:
        """proposer: "draft-model", "ngram" or "mixed" (the draft model, and prompt lookup where it matches);
        priors: per source, the (accepted, drafted) pseudo-counts its estimate starts from (default: fixed ones)."""
        self.id = next(_ids)
        self.request = request
        self.sampling = request.sampling
        self.tokens = list(request.prompt)  # prompt + generated (every accepted token, past a stop too)
        self.prompt_len = len(request.prompt)
        self.fed = 0  # prompt tokens in the target's slot (prefill progress)
        self.slot: int | None = None
        self.emitted = 0  # tokens handed to the caller
        self.finish_reason: str | None = None
        self.cancelled = False
        self.stop_token_ids = frozenset() if request.ignore_eos else stop_token_ids
        self.text = TextStream(tokenizer, request.stop)
        self.proposer = proposer if request.speculate else None  # "draft-model" | "ngram" | "mixed" | None
        self.stats = GenerationStats(proposer=self.proposer or "none",
                                     policy=request.draft_policy if self.proposer else "none")
        # The engine's draft_max is a ceiling (a server's operator sets it): a request may ask for fewer, not more.
        self.draft_max = draft_max if request.draft_max is None else min(request.draft_max, draft_max)
        self.ngram = NgramProposer() if self.proposer in ("ngram", "mixed") else None
        random = not self.sampling.greedy
        self.generator = make_generator(self.sampling.seed, device) if random else None
        seed = None if self.sampling.seed is None else self.sampling.seed + 1
        self.draft_generator = make_generator(seed, device) if random else None
        sources = ([DRAFT_MODEL] if self.proposer in (DRAFT_MODEL, "mixed") else []) + \
            (list(self.ngram.sources) if self.ngram is not None else [])
        priors = priors or {}
        default = {DRAFT_MODEL: POLICY.acceptance_prior}
        self.estimates = {s: Estimate(priors.get(s, default.get(s, POLICY.ngram_prior))) for s in sources}
        self.plain_iterations = 0  # estimates fade towards their priors over these (see Estimate.acceptance)
        self.draft_source: str | None = None  # the source of this iteration's drafts
        self.draft_declined = False  # the draft model's first catch-up was judged not worth it (see DraftPolicy.plan)
        self.draft_prefill = False  # the draft takes in the prompt beside the target (see DraftPolicy._draft_may_pay)
        self.processor: LogitsProcessor | None = None  # set by the engine when request.logits adjusts anything
        self._predicted = (0.0, 0)  # (sum, steps) of the speed-ups over plain its batch's plans predicted

    def note_prediction(self, speedup: float) -> None:
        """A step's plan for this sequence's batch predicted this speed-up over a plain step (1.0: it was plain)."""
        total, steps = self._predicted
        self._predicted = (total + speedup, steps + 1)

    @property
    def predicted_speedup(self) -> float:
        """The mean speed-up over plain decoding that the plans of its steps predicted (what the policy believed)."""
        total, steps = self._predicted
        return total / steps if steps else 1.0

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt_len

    def acceptance(self, source: str) -> float:
        """The source's estimate now. While it shows no evidence, each plain iteration fades it back towards its
        prior by POLICY.idle_decay (counted, not applied per source a step: a plain step costs one increment)."""
        return self.estimates[source].acceptance(self.plain_iterations)

    def lookup_share(self) -> float:
        """The share of the reply so far that prompt lookup's accepted drafts made (policy.lookup_share)."""
        return lookup_share(self.copied_tokens, self.emitted)

    @property
    def copied_tokens(self) -> int:
        """Tokens of the reply that prompt lookup's accepted drafts made."""
        return sum(v["accepted_tokens"] for s, v in self.stats.sources.items() if s != DRAFT_MODEL)

    def observe(self, source: str | None, k: int, n_accepted: int) -> None:
        """One iteration's outcome: k drafts from `source`, n_accepted kept (k = 0: a plain step)."""
        if k == 0:
            self.plain_iterations += 1
            return
        estimate = self.estimates[source]
        estimate.settle(self.plain_iterations)
        estimate.observe(n_accepted, n_accepted + (1 if n_accepted < k else 0))

    def observe_evidence(self, source: str, matched: Seq[bool]) -> None:
        """Whether `source` would have predicted each of these tokens (teacher-forced, or lookup in hindsight)."""
        estimate = self.estimates.get(source)
        if matched and estimate is not None:
            estimate.settle(self.plain_iterations)
            estimate.observe_matches(matched)

    def emit(self, new_tokens: list[int]) -> list[int]:
        """New tokens cut at a stop token (not returned) or at max_tokens; sets finish_reason when cut."""
        out, finish = cut_tokens(new_tokens, self.stop_token_ids, self.emitted, self.request.max_tokens)
        self.finish_reason = finish or self.finish_reason
        self.emitted += len(out)
        self.stats.generated_tokens = self.emitted
        return out

    def chunk(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> GenerationChunk | None:
        """What the caller gets for this iteration's tokens (and their logprobs, one each, when asked for), or None
        when there is nothing to say yet."""
        text = self.text.push(tokens)
        if self.text.stopped:
            self.finish_reason = "stop"
        if self.finish_reason is not None:
            return GenerationChunk(text + self.text.finish(), tokens, self.finish_reason, self.stats, logprobs,
                                   self.text.stop_string)
        return GenerationChunk(text, tokens, logprobs=logprobs) if tokens or text else None
