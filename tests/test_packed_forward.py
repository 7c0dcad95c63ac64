"""TorchBatchedCache's packed path (Transformer.forward_packed, PackedGraphs): a sequence's logits are bit for bit
the same alone and beside others, through prompts in pieces, verify-sized steps, rewinds and a long prompt, and
close to the eager forward. On CPU the kernels run in Triton's interpreter (a subprocess, as
tests/test_decode_attention.py runs them); skipped without Triton."""

from __future__ import annotations

import importlib.util

import pytest
from test_decode_attention import run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

SCRIPT = """
import os
import sys
import torch
from tandem.backends.torch_batched import TorchBatchedCache
from tandem.models import fused_projections
from tandem.synthetic.shapes import random_model

device = sys.argv[1]
model = random_model("tiny", device=device, dtype="float16" if device == "cpu" else "bfloat16", n_ctx=160,
                     seed=int(sys.argv[2]))
if device == "cpu":
    model.transformer.packed = True  # the kernels, in Triton's interpreter (no CUDA graphs)
assert model.transformer.packed
prompts = {0: [1 + i for i in range(11)], 1: [5, 6, 7], 2: [(7 * i) % 300 + 1 for i in range(70)]}  # 70: long
# Per step and sequence: rows fed (the greedy token, then fillers: a verify of drafts) and rows rejected after
schedule = [{0: (1, 0), 1: (3, 1), 2: (1, 0)}, {0: (9, 4), 2: (2, 0)}, {0: (1, 0), 1: (1, 0), 2: (5, 2)},
            {1: (9, 0)}, {0: (2, 1), 1: (1, 0), 2: (1, 0)}]

def run(together):
    cache = TorchBatchedCache(model, slots=3, capacity=160)
    slot = {0: 2, 1: 0, 2: 1}  # sequences in other rows than their ids
    logits = {i: [] for i in prompts}
    history = {i: list(prompts[i]) for i in prompts}  # the tokens each sequence's cache row holds
    next_token = {}
    groups = [list(prompts)] if together else [[i] for i in prompts]
    for group in groups:
        out = cache.forward([(slot[i], prompts[i]) for i in group], [True] * len(group))
        for i, rows in zip(group, out):
            logits[i].append(rows.float().cpu().clone())
            next_token[i] = int(rows[-1].argmax())
    for step in schedule:
        groups = [list(step)] if together else [[i] for i in step]
        for group in groups:
            feeds = [[next_token[i]] + [(13 * i + j) % 300 + 1 for j in range(step[i][0] - 1)] for i in group]
            out = cache.forward([(slot[i], f) for i, f in zip(group, feeds)], [False] * len(group))
            for i, f, rows in zip(group, feeds, out):
                assert rows.shape[0] == len(f)
                logits[i].append(rows.float().cpu().clone())
                keep = len(f) - step[i][1]
                cache.rewind(slot[i], cache.length(slot[i]) - step[i][1])
                history[i] += f[:keep]
                assert cache.length(slot[i]) == len(history[i])
                next_token[i] = int(rows[keep - 1].argmax())
                last[i] = rows[keep - 1].float().cpu()
    return logits, history

last = {}

alone, _ = run(False)
fused_projections.MAX_ROWS = 16  # batched, graphs of 16 rows at most: a step of 9 + 5 + 2 rows takes two replays
batched, history = run(True)
invariant = os.environ.get("TANDEM_BATCH_INVARIANT", "1") != "0"
for i in prompts:
    for a, b in zip(alone[i], batched[i], strict=True):
        if invariant:
            assert torch.equal(a, b), ("batched differs from alone", i)
        else:  # alone ran the batch-1 path (TorchSequence): the same logits up to rounding
            assert ((a - b).norm() / b.norm()).item() < 2e-2, ("batch-1 path far from the packed one", i)
# Close to the eager forward (its own cache, all tokens at once) at each prompt's end and each sequence's last row
for i in prompts:
    for tokens, got in ((prompts[i], batched[i][0][-1]), (history[i], last[i])):
        want = model.logits(tokens)[-1].float().cpu()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-2, ("packed logits far from the eager forward", i, len(tokens), err)
print("ok")
"""


@pytest.mark.parametrize("invariant", ["1", "0"])
def test_packed_batched_equals_alone(invariant, monkeypatch):
    """TANDEM_BATCH_INVARIANT=0: a batch of one runs the batch-1 path, close to the packed one, not bitwise."""
    import torch

    monkeypatch.setenv("TANDEM_BATCH_INVARIANT", invariant)
    run_script(SCRIPT, "cuda" if torch.cuda.is_available() else "cpu", 0)
