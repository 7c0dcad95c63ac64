"""The propose stage of a step: where each drafting sequence's draft tokens come from. Prompt lookup runs on the host
over the sequence's own text; a draft model (or a head over the target's hidden states) drafts every sequence that
needs it in one batched loop (Drafter.draft)."""

from __future__ import annotations

import torch

from tandem.backends.base import Alongside, BatchedCache, Model
from tandem.engine.costs import BatchCosts
from tandem.engine.drafter import Drafter, HeadDrafter, Proposal
from tandem.engine.generation import DRAFT_MODEL, Generation, Request
from tandem.speculative.compat import check_compatible, check_head, is_head
from tandem.speculative.proposer import NgramProposer

LOOKUP_SOURCES = NgramProposer().sources  # prompt lookup's sources: one per match length, longest first

# (sequences, draft forwards) of a step's steady batched draft: the shape its time is a cost of (None: no such draft)
Drafted = tuple[int, int] | None


class Proposers:
    """The engine's draft sources: a draft model or head (its Drafter over its KV slots), prompt lookup, or none.

    Args:
        target: the model the drafts are verified by.
        draft: None, a Model of the same tokenizer (a draft model or a head), or "ngram" (prompt lookup).
        synthetic_acceptance: benchmarks: drafts pass with this probability, whatever they are.
    """

    def __init__(self, target: Model, draft: Model | str | None, synthetic_acceptance: float | None = None) -> None:
        if isinstance(draft, str) and draft != "ngram":
            raise ValueError(f"draft must be a loaded Model, 'ngram' or None, got {draft!r}")
        self.draft_model = draft if isinstance(draft, Model) else None
        self.head = self.draft_model is not None and is_head(self.draft_model)
        if self.head:
            check_head(target, self.draft_model)
        elif self.draft_model is not None:
            check_compatible(target, self.draft_model)
        self.kind = DRAFT_MODEL if self.draft_model else "ngram" if draft == "ngram" else None
        self.synthetic = synthetic_acceptance
        self.drafter: Drafter | None = None  # open() makes it, once the slots are known

    @property
    def kv_models(self) -> list[Model]:
        """The draft models that keep KV of their own (a head reads the target's)."""
        return [self.draft_model] if self.draft_model is not None and not self.head else []

    def open(self, target: Model, target_kv: BatchedCache, slots: int, n_ctx: int, device: torch.device) -> None:
        """The drafter over its slots: a head's over the target's KV, a draft model's over a cache of its own."""
        if self.head:
            self.drafter = HeadDrafter(self.draft_model, target.vocab_size, target_kv, device)
        elif self.draft_model is not None:
            self.drafter = Drafter(self.draft_model, target.vocab_size, slots, n_ctx, device, self.synthetic)

    def sources(self, request: Request, prompt_lookup: bool) -> tuple[str | None, list[str]]:
        """A request's proposer ("draft-model", "ngram", "mixed" or None) and the acceptance sources it learns."""
        proposer = self.kind
        if proposer == DRAFT_MODEL and prompt_lookup and request.draft_policy == "adaptive":
            proposer = "mixed"  # a fixed draft length is the draft model's, as in tandem.generate
        sources = ([DRAFT_MODEL] if proposer in (DRAFT_MODEL, "mixed") else []) + \
            (list(LOOKUP_SOURCES) if proposer in ("ngram", "mixed") else [])
        return proposer, sources

    def propose(self, decoding: list[Generation], ks: list[int], keep_on_device: bool, timed: bool
                ) -> tuple[dict[int, Proposal], Drafted]:
        """Draft tokens per sequence (and, sampling, the distributions they were drawn from): prompt lookup on the
        host; a draft model batched, one forward a draft position over every sequence still drafting (a lone
        sequence's left on the device where keep_on_device: Drafter.draft). Also the steady draft's shape, where
        `timed` (its time is a draft step's cost: no evidence read ran in it)."""
        proposals = {g.id: ([], None) for g in decoding}
        drafting = {}
        for gen, k in zip(decoding, ks, strict=True):
            if k and gen.draft_source != DRAFT_MODEL:
                drafts = gen.ngram.continuation(gen.tokens, k)
                if gen.processor is not None:  # lookup proposes without the grammar: cut at its first refusal
                    drafts = drafts[: gen.processor.usable(drafts)]
                proposals[gen.id] = (drafts, None)
            elif k:
                drafting[gen.id] = (gen, k)
        if not drafting:
            return proposals, None
        drafted, forwards = self.drafter.draft(drafting, keep_on_device)
        proposals.update(drafted)
        return proposals, (len(drafting), forwards) if forwards is not None and timed else None

    def ahead(self, decoding: list[Generation], proposals: dict[int, Proposal], drafted: Drafted,
              costs: BatchCosts | None) -> Alongside | None:
        """The draft's feed of each drafting sequence's last draft, beside the verify, where that pays
        (BatchCosts.feeds_ahead: a GPU runs it beside the target's forward): a sequence whose drafts all pass then
        drafts from its bonus token alone, where it would first take in its last draft in a forward of its own."""
        if drafted is None or costs is None or not costs.feeds_ahead(drafted[0]):
            return None
        gens = [g for g in decoding if g.draft_source == DRAFT_MODEL and proposals[g.id][0]]
        return self.drafter.ahead(gens, [proposals[g.id][0][-1] for g in gens])
