"""Greedy decoding against references recomputed from scratch at every step, outside the engine (issue 51, item 3):
plain decoding, speculative k = 1..8 and a 4-slot batch on the torch backend, in float32 and bfloat16.

- float32: Hugging Face transformers' Qwen2 (its own implementation, its own GGUF dequantisation) on the same file;
  each reference token is the argmax of its logits over the whole prefix, no cache. Its top-1 leads its top-2 by at
  least MARGIN at every step and tandem's logits lie within FORWARD_ERROR of it (both checked here), so any path of
  tandem's that computes the model's function must pick the same token, whatever its rounding (ragged batches,
  verify rows): exact token equality is then a sound test without float64.
- bfloat16 on the padded path (the 9-row static step CUDA graphs replay, run uncaptured on CPU): rounding there
  (~0.05 of logits of ~3) is far above this model's margins, so no other implementation can be a bitwise reference.
  The reference is the model's own padded step over the whole prefix in a fresh cache at every step: rows of the
  padded step do not depend on how many ran together, so a token decoded through the engine (its KV written step
  by step, drafts written and rewound) must be that token bit for bit, ties included. On CPU a batch of several
  sequences runs the ragged forward, not the padded one, so bfloat16 has no batch test here (docs/batching.md).

Negative control: the engine keeps one rejected draft's KV (the rewind after one verify keeps one position too
many); every check above must then fail.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_speculated, count_batches

import tandem
from tandem.engine import Engine, Request

SEED = 3  # a tiny model whose greedy margins on PROMPTS stay >= 7e-3 over N_TOKENS (checked below)
PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "{\"name\": \"tandem\", \"items\": [1, 2,",
           "Once upon a time"]
N_TOKENS = 32
MARGIN = 1e-4  # the reference's top-1 over its top-2, at every step: 30x what tandem's float32 logits are off by
FORWARD_ERROR = 2e-5  # tandem's eager float32 logits against transformers' (measured ~3e-6)
BATCH_DRAFT_LENGTHS = [1, 3, 5, 8]  # one per sequence of the 4-slot batch


def hf_greedy(model, prompt_ids: list[int], n: int) -> tuple[list[int], float]:
    """n greedy tokens of a transformers model, each the argmax of one forward over the whole prefix (no cache);
    and the smallest top-1 over top-2 gap seen."""
    out, margin = [], float("inf")
    with torch.inference_mode():
        for _ in range(n):
            row = model(torch.tensor([prompt_ids + out]), use_cache=False).logits[0, -1]  # [V]
            top2 = row.topk(2).values
            margin = min(margin, float(top2[0] - top2[1]))
            out.append(int(row.argmax()))
    return out, margin


def padded_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens, each the argmax of the model's padded step over the whole prefix in a fresh cache."""
    out = []
    for _ in range(n):
        seq = model.new_sequence(len(prompt_ids) + n)
        out.append(int(seq.forward(prompt_ids + out, logits="last")[-1].argmax()))
        seq.close()
    return out


@pytest.fixture(scope="module")
def fp32(tiny_model_path):
    """(target, draft, {prompt: (ids, reference tokens)}): float32 target, its Q4_0 copy as draft, and
    transformers' greedy tokens on the target's file."""
    transformers = pytest.importorskip("transformers")
    path = tiny_model_path(seed=SEED)
    target = tandem.load(path, dtype="float32")
    draft = tandem.load(tiny_model_path(qtype="Q4_0", seed=SEED), dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32)
    references, margins, errors = {}, [], []
    for prompt in PROMPTS:
        ids = target.tokenizer.encode(prompt)
        tokens, margin = hf_greedy(hf, ids, N_TOKENS)
        with torch.inference_mode():
            hf_logits = hf(torch.tensor([ids + tokens]), use_cache=False).logits[0]  # [T, V]
        errors.append(float((target.logits(ids + tokens) - hf_logits).abs().max()))
        references[prompt] = (ids, tokens)
        margins.append(margin)
    # What makes exact equality a sound test in float32: the reference never comes near a tie, and tandem computes
    # the same function to far better than its smallest margin.
    assert min(margins) > MARGIN, margins
    assert max(errors) < FORWARD_ERROR, errors
    return target, draft, references


@pytest.fixture(scope="module")
def bf16_padded(tiny_model_path):
    """(target, draft, {prompt: (ids, reference tokens)}) in bfloat16 on the padded path, the reference recomputed
    by the padded step from scratch."""
    target = tandem.load(tiny_model_path(seed=SEED), dtype="bfloat16", graphs=True)
    draft = tandem.load(tiny_model_path(qtype="Q4_0", seed=SEED), dtype="bfloat16", graphs=True)
    references = {}
    for prompt in PROMPTS:
        ids = target.tokenizer.encode(prompt)
        references[prompt] = (ids, padded_greedy(target, ids, N_TOKENS))
    return target, draft, references


def greedy_requests(references: dict, draft_lengths: list[int | None]) -> list[Request]:
    """One request a prompt: N_TOKENS greedy tokens past any stop token; draft_max None is plain decoding."""
    return [Request(ids, max_tokens=N_TOKENS, ignore_eos=True, speculate=k is not None, draft_max=k,
                    draft_policy="fixed") for (ids, _), k in zip(references.values(), draft_lengths, strict=True)]


def assert_matches_reference(results, references: dict) -> None:
    for result, (prompt, (_, expected)) in zip(results, references.items(), strict=True):
        got = result.tokens
        first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
        assert first is None, f"{prompt!r}: token {first} is {got[first]}, the reference's argmax is {expected[first]}"


def run_alone(target, draft, references: dict, k: int | None) -> list:
    """Each prompt alone in a one-slot engine: plain (k None) or drafting k a step."""
    results = []
    for request in greedy_requests(references, [k] * len(references)):
        engine = Engine(target, draft if k else None, slots=1, draft_max=k or 1, measure_costs=False)
        results.append(engine.generate([request])[0])
    return results


def keep_one_rejected_draft(engine: Engine) -> dict:
    """Plant the bug: the first rewind after a verify that rejected drafts keeps one of them in the target's cache
    (one position too many). Returns a dict whose 'kept' says whether it happened."""
    kv, rewind, state = engine.target_kv, engine.target_kv.rewind, {"kept": False}

    def leaky(slot: int, length: int) -> None:
        if not state["kept"] and 0 < length < kv.length(slot):  # drafts past `length` were rejected
            state["kept"] = True
            return rewind(slot, length + 1)
        return rewind(slot, length)

    kv.rewind = leaky
    return state


# --- float32: transformers' argmax ------------------------------------------------------------------------------

def test_plain_greedy_is_the_references_argmax(fp32):
    target, _, references = fp32
    assert_matches_reference(run_alone(target, None, references, None), references)


@pytest.mark.parametrize("k", range(1, 9))
def test_speculative_greedy_is_the_references_argmax(fp32, k):
    target, draft, references = fp32
    results = run_alone(target, draft, references, k)
    assert_matches_reference(results, references)
    assert_speculated(*(r.stats for r in results), rejected=True)


@pytest.mark.parametrize("drafting", [True, False])
def test_a_batch_of_four_is_the_references_argmax(fp32, drafting):
    # Four sequences decoded together through the ragged forward: float32 rows that differ from a lone sequence's
    # in their last bits, and (drafting) verifies of 1..8 drafts beside each other.
    target, draft, references = fp32
    engine = Engine(target, draft if drafting else None, slots=4, draft_max=max(BATCH_DRAFT_LENGTHS),
                    measure_costs=False)
    sizes = count_batches(engine)
    results = engine.generate(greedy_requests(references, BATCH_DRAFT_LENGTHS if drafting else [None] * 4))
    assert_matches_reference(results, references)
    assert sizes.count(4) >= N_TOKENS // max(BATCH_DRAFT_LENGTHS), sizes  # the four decoded together
    if drafting:
        assert_speculated(*(r.stats for r in results), rejected=True)
    else:
        assert all(r.stats.draft_tokens == 0 for r in results)


# --- bfloat16 on the padded path: the padded step recomputed from scratch ----------------------------------------

def test_the_padded_reference_is_the_model(bf16_padded, fp32):
    # The bfloat16 reference computes the float32 model's function to bfloat16's precision (not a broken model
    # that the engine would match just as well): its logits over each whole sequence against transformers'.
    target, _, references = bf16_padded
    transformers_tokens = {prompt: tokens for prompt, (_, tokens) in fp32[2].items()}
    for ids, tokens in references.values():
        logits = target.logits(ids + tokens).float()
        reference = fp32[0].logits(ids + tokens)  # within FORWARD_ERROR of transformers' (the fp32 fixture)
        assert (logits - reference).abs().max() < 0.05 * reference.abs().max()
    agree = sum(a == b for prompt, (_, tokens) in references.items()
                for a, b in zip(tokens, transformers_tokens[prompt], strict=True))
    assert agree > 0.5 * N_TOKENS * len(PROMPTS)  # diverging where bfloat16 flips a near tie, then following it


@pytest.mark.parametrize("k", [None, *range(1, 9)])
def test_padded_bf16_greedy_is_the_recomputed_argmax(bf16_padded, k):
    target, draft, references = bf16_padded
    results = run_alone(target, draft, references, k)
    assert_matches_reference(results, references)
    if k:
        assert_speculated(*(r.stats for r in results), rejected=True)


# --- negative control -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("setup, slots", [("fp32", 1), ("fp32", 4), ("bf16_padded", 1)])
def test_a_kept_rejected_draft_fails_the_reference(request, setup, slots):
    target, draft, references = request.getfixturevalue(setup)
    if slots == 1:
        results, kept = [], []
        for req in greedy_requests(references, [4] * len(references)):
            engine = Engine(target, draft, slots=1, draft_max=4, measure_costs=False)
            kept.append(keep_one_rejected_draft(engine))
            results.append(engine.generate([req])[0])
    else:
        engine = Engine(target, draft, slots=4, draft_max=max(BATCH_DRAFT_LENGTHS), measure_costs=False)
        kept = [keep_one_rejected_draft(engine)]
        results = engine.generate(greedy_requests(references, BATCH_DRAFT_LENGTHS))
    assert all(state["kept"] for state in kept)  # the bug was planted
    with pytest.raises(AssertionError, match="the reference's argmax"):
        assert_matches_reference(results, references)
