"""Do the torch backend's EAGLE-3 taps hold under CUDA graphs and the compiled step (issue 48)? Not yet run on a
GPU: none was lent the session that wrote it. On CPU the same forwards run uncaptured (tests/test_torch_heads.py).

Checks, on one CUDA device in bfloat16 with a tiny llama target and a random EAGLE-3 head:
- greedy with the head == plain, alone (StepGraph's captured step; a 150-token prompt through the compiled step)
  and batched (PackedGraphs), and with the adaptive engine;
- the features each packed piece hands the head against the eager forward's taps of the same rows.
Run: PYTHONPATH=. python3 lab/gpu_torch_heads.py   (prints ok)
"""

import tempfile

import torch

import tandem
from tandem.engine import Engine, Request
from tandem.logits.options import logits_settings
from tandem.synthetic.heads import write_eagle3
from tandem.synthetic.tiny_gguf import write_tiny_gguf

LAYERS = (0, 2, 3)
BIAS = {300: 30.0, 301: 30.0}  # random models agree on nothing: both pick among two tokens, each by its own logits
PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "hi", "x" * 150]

folder = tempfile.mkdtemp()
target = tandem.load(write_tiny_gguf(f"{folder}/t.gguf", arch="llama", n_layers=4, seed=3, context_length=2048),
                     backend="torch", device="cuda", dtype="bfloat16", n_ctx=512)
head = tandem.load(write_eagle3(f"{folder}/h.gguf", target_d_model=64, target_layers=LAYERS, seed=4),
                   backend="torch", device="cuda", dtype="bfloat16", n_ctx=512)
print(torch.cuda.get_device_name(0), "packed:", target.transformer.packed, "graphs:", target.use_graphs)

plain = [tandem.generate(target, prompt=p, max_tokens=40, logit_bias=BIAS).tokens for p in PROMPTS]
alone = [tandem.generate(target, prompt=p, max_tokens=40, logit_bias=BIAS, draft=head, draft_policy="fixed",
                         draft_max=3) for p in PROMPTS]
batched = tandem.generate(target, prompts=PROMPTS, max_tokens=40, logit_bias=BIAS, draft=head, draft_policy="fixed",
                          draft_max=4)
for name, results in (("alone", alone), ("batched", batched)):
    print(name, "== plain:", [r.tokens for r in results] == plain,
          "drafted/accepted:", [(r.stats.draft_tokens, r.stats.accepted_tokens) for r in results])
    assert [r.tokens for r in results] == plain and sum(r.stats.accepted_tokens for r in results) > 0

kv = target.new_batched_cache(3, 256)
head_kv = kv.attach_head(head)
pieces, take_in = [], kv.head.take_in
kv.head.take_in = lambda got: (pieces.extend(got), take_in(got))
fed = {0: list(range(5, 25)), 1: [7, 8, 9], 2: [(11 * i) % 300 for i in range(80)]}
kv.forward(list(fed.items()), [True] * 3)
kv.forward([(0, [1, 2, 3]), (1, [4])], [False, False])
fed[0] += [1, 2, 3]
fed[1] += [4]
t, worst = target.transformer, 0.0
for slot, start, tokens, features in pieces:
    ids = fed[slot][: start + len(tokens)]
    cache, tapped = t.new_cache(512), dict.fromkeys(LAYERS)
    with torch.inference_mode():
        t.forward(torch.tensor(ids, device="cuda"), torch.arange(len(ids), device="cuda"), cache.k, cache.v,
                  kv_len=len(ids), tapped=tapped)
    want = torch.cat([tapped[layer] for layer in LAYERS], -1)[start:].float()
    worst = max(worst, ((features.float() - want).norm() / want.norm()).item())
print("packed pieces:", [(s, st, len(tk)) for s, st, tk, _ in pieces], "worst relative tap error:", worst)
assert worst < 2e-2
head_kv.close()
kv.close()

engine = Engine(target, head, slots=4, draft_max=4, prompt_lookup=False)
settings = logits_settings(logit_bias=BIAS, vocab=target.vocab_size)
results = engine.generate([Request(target.tokenizer.encode(p), max_tokens=40, logits=settings) for p in PROMPTS])
print("adaptive engine == plain:", [r.tokens for r in results] == plain)
assert [r.tokens for r in results] == plain
print("ok")
