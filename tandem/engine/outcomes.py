"""A step's outcome per sequence: how many of its drafts the target's rows accept, and the token after them (the
verifier's rules: tandem.speculative.verify), read back to the host in one transfer for the whole batch."""

from __future__ import annotations

import torch

from tandem.engine.generation import Generation
from tandem.engine.scoring import score_rows
from tandem.sampling import argmax, picked, probs_from_logits
from tandem.speculative.verify import verify_greedy, verify_sampled, verify_synthetic, verify_synthetic_picked


def reads_argmax_only(gen: Generation) -> bool:
    """Whether read_outcomes reads nothing of this sequence's rows but their argmax: greedy, with no processor to
    adjust them and no log-probabilities to score (the engine then has the backend pick them: forward_picking)."""
    return gen.sampling.greedy and gen.processor is None and gen.request.logprobs is None


def read_outcomes(decoding: list[tuple[Generation, torch.Tensor]], firsts: list[tuple[Generation, torch.Tensor]],
                  proposals: dict, device: torch.device, synthetic_acceptance: float | None = None
                  ) -> tuple[dict[int, tuple[int, list[int]]], dict[int, list]]:
    """Each sequence's (accepted drafts, new tokens) from its rows (a prompt just read in: its first token),
    read back in one transfer: greedy sequences by one argmax over all their rows, compared with their drafts
    on the host; the others by rejection sampling each on its own generator. Drafts still on the device (a
    tensor: Drafter.draft's keep_on_device) come back in the same transfer. Also the log-probabilities of the
    rows of requests that asked for them (score_rows), read back after it."""
    greedy, sampled, scored = [], [], {}  # greedy: (gen, rows); sampled: (gen, [n, token])
    on_device: list[tuple[Generation, torch.Tensor]] = []  # drafts to read back with the outcomes
    outcomes = {}
    for gen, rows in decoding + firsts:
        if rows.dtype == torch.long and not reads_argmax_only(gen):
            raise ValueError(f"sequence {gen.id}: its rows came back picked, but its outcome reads their logits")
        drafts, draft_probs = proposals.get(gen.id, ([], None))  # a prompt just read in has none
        if synthetic_acceptance is not None and len(drafts) and rows.dtype == torch.long and \
                rows.device.type == "cpu" and not isinstance(drafts, torch.Tensor):
            outcomes[gen.id] = verify_synthetic_picked(drafts, rows, synthetic_acceptance, gen.generator)
            continue
        if isinstance(drafts, torch.Tensor):
            on_device.append((gen, drafts))
        # What the choice reads: rows adjusted for the request (bias, penalties, grammar) at each draft offset.
        chosen = rows if gen.processor is None else gen.processor.rows(rows, drafts)
        greedy_step = gen.sampling.greedy and (synthetic_acceptance is None or not len(drafts))
        # On the device only where a verifier or the logprobs need them: a greedy step compares on the host.
        draft_tokens = drafts if isinstance(drafts, torch.Tensor) else \
            None if greedy_step and gen.request.logprobs is None else \
            torch.tensor(drafts, dtype=torch.long, device=device)
        own = None
        if greedy_step:
            greedy.append((gen, chosen))
            if chosen is not rows and gen.request.logprobs is not None:  # the adjusted argmax, not the raw
                own = argmax(chosen)
        else:
            n_accepted, own = verify(gen, draft_tokens, draft_probs, chosen, synthetic_acceptance)
            sampled.append((gen, torch.stack([n_accepted, own])))
        if gen.request.logprobs is not None:
            scored[gen.id] = score_rows(rows, draft_tokens, own, gen.request.logprobs)
    # Drafts read back first, then an argmax per sequence, its tokens joined (joining the 152k-float rows first
    # cost more than the argmax), then each sampled sequence's (n, token).
    parts = [drafts for _, drafts in on_device] + \
        ([_cat([picked(rows) for _, rows in greedy])] if greedy else []) + [pair for _, pair in sampled]
    values = _cat(parts).tolist() if parts else []  # the step's one host synchronisation
    host_drafts, at = {gen.id: proposals.get(gen.id, ([], None))[0] for gen, _ in decoding + firsts}, 0
    for gen, drafts in on_device:
        host_drafts[gen.id] = values[at : at + len(drafts)]
        at += len(drafts)
    for gen, _ in greedy:
        drafts = host_drafts[gen.id]
        outcomes[gen.id] = verify_greedy(drafts, values[at : at + len(drafts) + 1])  # the argmax at each row
        at += len(drafts) + 1
    for gen, _ in sampled:
        n, token = values[at], values[at + 1]
        at += 2
        outcomes[gen.id] = (n, host_drafts[gen.id][:n] + [token])
    return outcomes, {i: [t.tolist() for t in tensors] for i, tensors in scored.items()}


def verify(gen: Generation, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
           synthetic_acceptance: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled sequence's (accepted drafts, next token), or a greedy one's at synthetic acceptance (greedy
    sequences are otherwise verified together, in read_outcomes)."""
    if synthetic_acceptance is not None and draft_tokens.shape[0]:
        return verify_synthetic(draft_tokens, logits, synthetic_acceptance, gen.generator)
    return verify_sampled(draft_tokens, draft_probs, probs_from_logits(logits, gen.sampling), gen.generator)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
