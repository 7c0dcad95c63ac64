"""EAGLE-3 head drafts on the torch backend (tandem/backends/torch_head.py, docs/decisions/0004-head-drafts.md): the
llama target's taps, the head module loaded from the GGUF llama.cpp reads, speculation with it exact (greedy ==
plain alone and batched; sampled against the target's distribution, with wrong residuals caught), and the same
drafts as llama.cpp's head on the same files.

A random head agrees with a random target on nothing: the tests that need accepted drafts give both a logit bias
onto a few tokens (a request's logit_bias applies to the draft's rows as to the target's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    HEAD_BIAS,
    HEAD_PROMPTS,
    assert_speculated,
    check_adaptive_head_is_plain,
    check_head_greedy_catches_a_kept_rejection,
    check_head_greedy_is_plain,
    sample_with_drafts,
)
from sampling_reference import exact_distribution
from test_lossless import chi_square_pvalue, residual_from_target, residual_from_target_after_an_accept

import tandem
from tandem.backends import torch_head
from tandem.engine import Engine
from tandem.logits.options import logits_settings
from tandem.speculative.compat import HeadMismatchError
from tandem.speculative.verify import verify_sampled
from tandem.synthetic.heads import write_eagle3, write_gemma4_assistant

TARGET = dict(arch="llama", n_layers=4, qtype="F32", seed=3)  # d_model 64, the tiny byte-level vocabulary (310)
LAYERS = (0, 2, 3)
THREE_TOKENS = {300: 30.0, 301: 30.0, 302: 30.0}
# A draft vocabulary of its own: 203 of the target's 310 ids (the biased three among them), by d2t
D2T = sorted(set(range(0, 300, 3)) | set(range(1, 300, 3)) | {300, 301, 302})


@pytest.fixture(scope="module")
def head_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3-torch")
    return {
        "own": write_eagle3(folder / "eagle3.gguf", target_d_model=64, target_layers=LAYERS, seed=4),
        # the target's embedding, its own 203-token output mapped by d2t
        "d2t": write_eagle3(folder / "eagle3-d2t.gguf", target_d_model=64, target_layers=LAYERS, seed=6, d2t=D2T,
                            own_embedding=False),
    }


@pytest.fixture(scope="module")
def target(tiny_model_path):
    return tandem.load(tiny_model_path(**TARGET), backend="torch", n_ctx=128)


@pytest.fixture(scope="module", params=["own", "d2t"])
def pair(request, target, head_files):
    return target, tandem.load(head_files[request.param], backend="torch", n_ctx=128)


def draft_logits(target, head, ids: list[int], k: int = 1, verify_from: int | None = None,
                 copy_to: int | None = None) -> np.ndarray:
    """The head's logits [k, V] of k greedy drafts after ids[-1], slot 0 of a fresh 2-slot target cache that took
    ids[:-1] as a prompt (or up to verify_from as a prompt and the rest as a verify's rows, two drafts past them
    rewound), slot 1 another prompt beside it. copy_to: draft in slot copy_to after the target copied slot 0 there."""
    kv = target.new_batched_cache(2, 64)
    head_kv = kv.attach_head(head)
    try:
        start = verify_from if verify_from is not None else len(ids) - 1
        kv.forward([(0, ids[:start]), (1, ids[3:9])], [True, True])
        if verify_from is not None:
            kv.forward([(0, ids[start:] + [7, 8])], [False])
            kv.rewind(0, len(ids) - 1)
        slot = 0
        if copy_to is not None:
            kv.copy_prefix(0, copy_to, len(ids) - 1)
            slot = copy_to
        rows, token = [], ids[-1]
        for _ in range(k):
            logits = torch.as_tensor(head_kv.forward([(slot, [token])], [True])[0])[0].float()
            rows.append(logits.numpy())
            token = int(logits.argmax())
        return np.stack(rows)
    finally:
        head_kv.close()
        kv.close()


def gap(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference of two drafts' logits where b's are finite (a d2t head's other ids are -inf)."""
    finite = np.isfinite(b)
    return float(np.abs(a[finite] - b[finite]).max())


def test_torch_loads_an_eagle3_head_and_says_what_it_cannot_run(pair, tmp_path):
    target, head = pair
    assert isinstance(head, torch_head.TorchHeadModel) and head.config.head_target_layers == LAYERS
    with pytest.raises(ValueError, match="drafts beside its target"):
        head.new_sequence()
    # the Gemma 4 assistant needs a gemma4 target, which the torch backend does not run
    assistant = write_gemma4_assistant(tmp_path / "assistant.gguf", target_d_model=64)
    with pytest.raises(ValueError, match="runs on the llama.cpp backend only"):
        tandem.load(assistant, backend="torch")
    broken = write_eagle3(tmp_path / "broken.gguf", target_d_model=64, metadata={"eagle3.norm_before_fc": True})
    with pytest.raises(ValueError, match="enc.output_norm"):
        tandem.load(broken, backend="torch")


def test_a_head_that_does_not_fit_its_target_is_a_clear_error(target, tiny_model_path, tmp_path):
    wider = tandem.load(write_eagle3(tmp_path / "wide.gguf", target_d_model=96), backend="torch")
    deep = tandem.load(write_eagle3(tmp_path / "deep.gguf", target_d_model=64, target_layers=(0, 2, 7)),
                       backend="torch")
    qwen = tandem.load(tiny_model_path(qtype="F32"), backend="torch", n_ctx=64)
    ok = tandem.load(write_eagle3(tmp_path / "ok.gguf", target_d_model=64), backend="torch")
    with pytest.raises(HeadMismatchError, match="hidden states of 96 values, the target's are 64"):
        tandem.generate(target, prompt="hi", max_tokens=2, draft=wider)
    with pytest.raises(HeadMismatchError, match=r"target layers \[0, 2, 7\], the target has 4"):
        tandem.generate(target, prompt="hi", max_tokens=2, draft=deep)
    with pytest.raises(HeadMismatchError, match="drafts for llama targets, not qwen2"):
        tandem.generate(qwen, prompt="hi", max_tokens=2, draft=ok)
    with pytest.raises(HeadMismatchError, match="hidden states of 96"):
        target.new_batched_cache(1, 64).attach_head(wider)  # also below the engine


def test_the_plain_path_taps_nothing_and_a_closed_head_turns_the_taps_off(pair):
    target, head = pair
    kv = target.new_batched_cache(2, 64)
    seen = []
    assert kv.taps == () and kv.head is None
    head_kv = kv.attach_head(head)
    kv.head.take_in, real = (lambda pieces: (seen.extend(pieces), real(pieces))), kv.head.take_in
    kv.forward([(0, [5, 6, 7]), (1, [8, 9])], [True, True])
    kv.forward([(0, [10])], [False])
    assert [(slot, start, list(tokens), tuple(f.shape)) for slot, start, tokens, f in seen] == \
        [(0, 0, [5, 6, 7], (3, 3 * 64)), (1, 0, [8, 9], (2, 3 * 64)), (0, 3, [10], (1, 3 * 64))]
    head_kv.close()
    assert kv.taps == () and kv.head is None
    kv.forward([(0, [11])], [False])
    assert len(seen) == 3
    kv.close()


def test_the_targets_forwards_run_no_head_layer_until_it_drafts(pair, monkeypatch):
    """The head catches up on the target's rows at its next draft round (or past PENDING_MAX rows), so the target's
    steps the policy does not draft beside pay for no head work."""
    target, head = pair
    runs, decode = [], torch_head.Eagle3Drafts.decode

    def counted(self, slots, *args, **kwargs):
        runs.append(len(slots))
        return decode(self, slots, *args, **kwargs)

    monkeypatch.setattr(torch_head.Eagle3Drafts, "decode", counted)
    monkeypatch.setattr(torch_head, "PENDING_MAX", 25)
    kv = target.new_batched_cache(2, 64)
    head_kv = kv.attach_head(head)
    try:
        kv.forward([(0, list(range(5, 15))), (1, [5, 6])], [True, True])
        for token in range(20, 30):
            kv.forward([(0, [token]), (1, [token])], [False, False])
        assert runs == []
        head_kv.forward([(0, [30]), (1, [31])], [True, True])
        assert runs == [19 + 11, 2]  # the pairs of both slots' rows in one catch-up, then the draft step
        kv.forward([(0, list(range(40, 70)))], [False])  # slot 0 passes PENDING_MAX rows: caught up at once
        assert runs[2:] == [30]
    finally:
        head_kv.close()
        kv.close()


def test_the_taps_are_the_inputs_of_the_heads_layers(target):
    """The features of a row: the inputs of layers 0, 2 and 3, as a forward computes them (layer 0's input, the
    embedding; the others, the residual stream), in the head's order."""
    t = target.transformer
    tokens, positions = torch.tensor([5, 6, 7]), torch.arange(3)
    cache = t.new_cache(16)
    tapped = dict.fromkeys(LAYERS)
    with torch.inference_mode():
        logits = t.forward(tokens, positions, cache.k, cache.v, kv_len=3, tapped=tapped)
        torch.testing.assert_close(tapped[0], t.w["token_embd.weight"][tokens] * t.embed_scale)
        cache2 = t.new_cache(16)
        assert torch.equal(logits, t.forward(tokens, positions, cache2.k, cache2.v, kv_len=3))  # taps change nothing
        # layer 2's input is what layers 0 and 1 make of the embedding
        x = tapped[0][None]
        for i in (0, 1):
            x, _ = t.layer(x, None, t.blocks[i], False, positions, cache2.k[i], cache2.v[i], 3, t.attention_bias(
                positions, 3, None), False, False)
        torch.testing.assert_close(tapped[2], x[0])


def test_the_torch_head_drafts_what_llamacpps_drafts_on_the_same_files(pair, tiny_model_path):
    """Cross-backend: the same F32 files, the same greedy drafts (4 in a row, each fed back) and logits within
    float rounding (llama.cpp's kernels sum in another order), from a prompt and after a verify's rewind."""
    pytest.importorskip("llama_cpp")
    target, head = pair
    ids = target.tokenizer.encode(HEAD_PROMPTS[0]) + [300, 301, 302]
    ours = draft_logits(target, head, ids, k=4)
    lt = tandem.load(tiny_model_path(**TARGET), backend="llama.cpp", n_ctx=128, threads=1)
    lh = tandem.load(head.path, backend="llama.cpp", n_ctx=128, threads=1)
    try:
        for verify_from in (None, len(ids) - 3):
            theirs = draft_logits(lt, lh, ids, k=4, verify_from=verify_from)
            assert (ours.argmax(-1) == theirs.argmax(-1)).all()
            finite = np.isfinite(theirs)
            assert (finite == np.isfinite(ours)).all() and finite.sum(-1).min() == (len(D2T) if head.d2t is not None
                                                                                    else target.vocab_size)
            np.testing.assert_allclose(ours[finite], theirs[finite], atol=2e-2)
    finally:
        lh.close()
        lt.close()


def test_drafts_come_from_the_pairs_the_catch_up_wrote(pair, monkeypatch):
    target, head = pair
    ids = target.tokenizer.encode(HEAD_PROMPTS[0]) + [300, 301, 302]
    from_prompt = draft_logits(target, head, ids, k=3)
    assert np.isfinite(from_prompt).any(-1).all()
    # the pairs a verify's rows wrote (those of the rejected drafts dropped) give the drafts a prompt's give
    np.testing.assert_allclose(draft_logits(target, head, ids, k=3, verify_from=len(ids) - 3), from_prompt, atol=1e-4)
    # a prefix the target copied to another slot carries its pairs along
    np.testing.assert_allclose(draft_logits(target, head, ids, k=3, copy_to=1), from_prompt, atol=1e-4)
    # controls: without the catch-up on a verify's rows, or without copying the pairs, the drafts differ
    take_in = torch_head.Eagle3Drafts.take_in
    monkeypatch.setattr(torch_head.Eagle3Drafts, "take_in",
                        lambda self, pieces: take_in(self, pieces) if pieces[0][1] == 0 else None)
    assert gap(draft_logits(target, head, ids, k=3, verify_from=len(ids) - 3), from_prompt) > 1e-2
    monkeypatch.undo()
    monkeypatch.setattr(torch_head.Eagle3Drafts, "copy_prefix", lambda self, src, dst, length: self.forget(dst, 0))
    assert gap(draft_logits(target, head, ids, k=3, copy_to=1), from_prompt) > 1e-2


def test_a_sequences_drafts_are_the_same_alone_and_beside_others(pair):
    target, head = pair
    ids = [target.tokenizer.encode(p) for p in HEAD_PROMPTS[:2]]
    kv = target.new_batched_cache(2, 64)
    head_kv = kv.attach_head(head)
    try:
        kv.forward([(0, ids[0][:-1]), (1, ids[1][:-1])], [True, True])
        together = [head_kv.forward([(0, ids[0][-1:]), (1, ids[1][-1:])], [True, True]),
                    head_kv.forward([(0, [300]), (1, [301])], [True, True])]
        for slot in (0, 1):  # a new round each, alone
            head_kv.rewind(slot, kv.length(slot))
        alone = [head_kv.forward([(0, ids[0][-1:])], [True]), head_kv.forward([(0, [300])], [True])]
        for both, one in zip(together, alone, strict=True):
            torch.testing.assert_close(both[0], one[0], atol=1e-5, rtol=1e-5)
        assert gap(together[0][0].numpy(), together[0][1].numpy()) > 1e-2  # control: the two slots draft apart
    finally:
        head_kv.close()
        kv.close()


def test_greedy_with_the_head_is_the_target_alone_and_batched(pair):
    check_head_greedy_is_plain(*pair)


def test_the_greedy_comparison_catches_a_rule_that_keeps_a_rejected_draft(pair, monkeypatch):
    check_head_greedy_catches_a_kept_rejection(*pair, monkeypatch)


def test_the_adaptive_policy_drafts_with_a_torch_head_and_stays_exact(pair, monkeypatch, tmp_path):
    check_adaptive_head_is_plain(*pair, monkeypatch, tmp_path)

def test_draft_auto_and_the_doctor_take_a_torch_head(tmp_path, capsys):
    import json

    from tandem.api import load_pair
    from tandem.cli import main
    from tandem.synthetic.heads import write_eagle3_pair

    path, head_path = write_eagle3_pair(tmp_path, "tiny", qtype="F32", head_qtype="F32")
    loaded, head = load_pair(path, "auto", backend="torch", n_ctx=64)
    assert isinstance(head, torch_head.TorchHeadModel) and head.path == head_path
    assert main(["doctor", "--json", "--repeats", "2", "--model", path, "--draft", head.path, "--backend",
                 "torch", "--slots", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["draft_kind"] == "head" and d["draft_step_ms_paired"] > 0


# --- sampled: the target's distribution, drafts of 2-3 tokens, 4 sequences a verify ---------------------------------
SAMPLING = dict(temperature=1.0, top_k=3)  # the biased three, each model weighing them by its own logits
N_GENERATED = 5
N_SAMPLES = 3600
SLOTS = 4


@pytest.fixture(scope="module")
def sampled_setup(target, head_files):
    head = tandem.load(head_files["own"], backend="torch", n_ctx=128)
    prompt_ids = target.tokenizer.encode(HEAD_PROMPTS[1])
    bias = np.zeros(target.vocab_size)
    bias[list(THREE_TOKENS)] = list(THREE_TOKENS.values())
    dist, _ = exact_distribution(lambda ids: target.logits(ids)[-1].numpy() + bias, prompt_ids, N_GENERATED,
                                 **SAMPLING)
    return target, head, prompt_ids, dist


def sample_with_head(target, head, prompt_ids, monkeypatch, verify=verify_sampled):
    engine = Engine(target, head, slots=SLOTS, draft_max=3, measure_costs=False, prompt_lookup=False)
    logits = logits_settings(logit_bias=THREE_TOKENS, vocab=target.vocab_size)
    return sample_with_drafts(engine, prompt_ids, SAMPLING, N_SAMPLES, N_GENERATED, [2, 3], monkeypatch, verify,
                              logits=logits)


def test_sampled_speculation_with_a_torch_head_matches_the_targets_distribution(sampled_setup, monkeypatch):
    target, head, prompt_ids, dist = sampled_setup
    counts, outcomes = sample_with_head(target, head, prompt_ids, monkeypatch)
    assert all(outcomes.get((k, n), 0) >= 10 for k in (2, 3) for n in range(k + 1)), sorted(outcomes.items())
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p > 1e-3, f"sampled speculation with a torch head departs from the target's distribution (p={p:.3g})"


@pytest.mark.parametrize("wrong_rule", [residual_from_target, residual_from_target_after_an_accept])
def test_the_torch_head_distribution_test_catches_a_wrong_residual(sampled_setup, monkeypatch, wrong_rule):
    target, head, prompt_ids, dist = sampled_setup
    counts, _ = sample_with_head(target, head, prompt_ids, monkeypatch, verify=wrong_rule)
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p < 1e-4, f"{wrong_rule.__name__} went unnoticed with a torch head (p={p:.3g})"


def test_the_step_graphs_path_taps_as_the_eager_one(tiny_model_path, head_files):
    """graphs=True: every forward of up to a graph's rows runs StepGraph's padded step (captured on CUDA, run as is
    here), its taps copied to a static buffer; with a head its output is the target's alone and batched."""
    target = tandem.load(tiny_model_path(**TARGET), backend="torch", n_ctx=128, graphs=True)
    head = tandem.load(head_files["own"], backend="torch", n_ctx=128)
    plain = [tandem.generate(target, prompt=p, max_tokens=20, logit_bias=HEAD_BIAS).tokens for p in HEAD_PROMPTS]
    alone = [tandem.generate(target, prompt=p, max_tokens=20, logit_bias=HEAD_BIAS, draft=head,
                             draft_policy="fixed", draft_max=3) for p in HEAD_PROMPTS]
    batched = tandem.generate(target, prompts=HEAD_PROMPTS, max_tokens=20, logit_bias=HEAD_BIAS, draft=head,
                              draft_policy="fixed", draft_max=3)
    assert [r.tokens for r in alone] == [r.tokens for r in batched] == plain
    assert_speculated(*(r.stats for r in alone + batched), rejected=True)
    ids = target.tokenizer.encode(HEAD_PROMPTS[0]) + [300, 301, 302]
    eager = tandem.load(tiny_model_path(**TARGET), backend="torch", n_ctx=128)
    np.testing.assert_allclose(draft_logits(target, head, ids, k=3, verify_from=len(ids) - 3),
                               draft_logits(eager, head, ids, k=3), atol=1e-4)


PACKED_SCRIPT = """
import sys, tempfile, torch
from tandem.backends.torch_backend import load_torch
from tandem.backends.torch_batched import TorchBatchedCache
from tandem.synthetic.heads import write_eagle3
from tandem.synthetic.tiny_gguf import write_tiny_gguf

folder = tempfile.mkdtemp()
target = load_torch(write_tiny_gguf(folder + "/t.gguf", arch="llama", n_layers=4, seed=3), device=sys.argv[1],
                    dtype="float16" if sys.argv[1] == "cpu" else "bfloat16", progress=False)
head = load_torch(write_eagle3(folder + "/h.gguf", target_d_model=64, target_layers=(0, 2, 3), seed=4),
                  device=sys.argv[1])
if sys.argv[1] == "cpu":
    target.transformer.packed = True  # the kernels, in Triton's interpreter (no CUDA graphs)
cache = TorchBatchedCache(target, slots=3, capacity=160)
assert cache.packed is not None
head_kv = cache.attach_head(head)
pieces, take_in = [], cache.head.take_in
cache.head.take_in = lambda got: (pieces.extend(got), take_in(got))
prompts = {0: list(range(5, 16)), 1: [7, 8, 9], 2: [(11 * i) % 300 + 1 for i in range(70)]}  # 70: the compiled step
cache.forward([(s, p) for s, p in prompts.items()], [True] * 3)
cache.forward([(0, [1, 2, 3]), (1, [4])], [False, False])
head_kv.forward([(0, [5]), (1, [6]), (2, [7])], [True] * 3)
fed = {0: prompts[0] + [1, 2, 3], 1: prompts[1] + [4], 2: prompts[2]}
t = target.transformer
for slot, start, tokens, features in pieces:
    ids = fed[slot][: start + len(tokens)]
    assert list(map(int, tokens)) == ids[start:]
    cache_row = t.new_cache(256)
    tapped = dict.fromkeys((0, 2, 3))
    with torch.inference_mode():
        t.forward(torch.tensor(ids, device=t.device), torch.arange(len(ids), device=t.device), cache_row.k,
                  cache_row.v, kv_len=len(ids), tapped=tapped)
    want = torch.cat([tapped[layer] for layer in (0, 2, 3)], -1)[start:].float()
    err = ((features.float() - want).norm() / want.norm()).item()
    assert err < 2e-2, ("packed taps far from the eager forward's", slot, start, err)
for slot, ids in fed.items():  # pieces of at most a replay's rows, covering every row fed once
    covered = sorted((st, st + len(t)) for s, st, t, _ in pieces if s == slot)
    assert [a for a, _ in covered] == [0] + [b for _, b in covered[:-1]] and covered[-1][1] == len(ids), covered
print("ok")
"""


def test_the_packed_path_taps_as_the_eager_one():
    """The packed path (Transformer.forward_packed, PackedGraphs; a long prompt through the compiled step) hands the
    head each piece's tapped rows, close to the eager forward's; on CPU in Triton's interpreter."""
    pytest.importorskip("triton")
    from test_decode_attention import run_script

    run_script(PACKED_SCRIPT, "cuda" if torch.cuda.is_available() else "cpu", 0)
