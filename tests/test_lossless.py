"""Speculation end to end on tiny random GGUF models (`tandem.generate`, the engine): lossless greedy decoding, and
sampled decoding with the target's exact distribution."""

import math

import pytest
import torch
from conftest import K_QUANT_SHAPES, assert_speculated, exact_distribution, record_verifies
from scipy.stats import chisquare

import tandem
from tandem.backends.base import ContextOverflowError
from tandem.engine import Engine, Request
from tandem.engine import drafter as drafter_module
from tandem.sampling import SamplingParams, probs_from_logits
from tandem.speculative.proposer import NgramProposer
from tandem.speculative.verify import verify_sampled

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "{\"name\": \"tandem\", \"items\": [1, 2,"]


def run(target, prompt, draft=None, k=4, max_tokens=24, **sampling):
    return tandem.generate(target, prompt=prompt, draft=draft, draft_max=k, draft_policy="fixed",
                           max_tokens=max_tokens, **sampling)


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_plain(pair64, k):
    target, draft = pair64
    stats = []
    for prompt in PROMPTS:
        plain = run(target, prompt)
        spec = run(target, prompt, draft=draft, k=k)
        assert spec.tokens == plain.tokens, (k, prompt)
        assert spec.text == plain.text
        stats.append(spec.stats)
    assert plain.stats.draft_tokens == 0
    # Accepted drafts and rejected ones: a verifier that kept one draft too many, or none, would change tokens.
    assert_speculated(*stats, rejected=True)


def test_partial_acceptance_is_exercised(pair64):
    target, draft = pair64
    stats = [run(target, p, draft=draft, k=6, max_tokens=48).stats for p in PROMPTS]
    assert_speculated(*stats, rejected=True)


@pytest.mark.parametrize("arch, qtype, dtype", [
    ("qwen2", "Q8_0", "float32"), ("qwen2", "Q4_K", "float64"), ("qwen2", "Q6_K", "float64"),
    ("llama", "Q5_0", "float64"), ("gemma3", "F16", "float64"), ("llama", "Q4_1", "float64"),
])
@pytest.mark.parametrize("model_seed", [1, 2])
def test_greedy_identity_across_models(tiny_model_path, arch, qtype, dtype, model_seed):
    target = tandem.load(tiny_model_path(arch=arch, qtype=qtype, seed=model_seed), dtype=dtype)
    # A draft that mostly agrees: the same weights in Q4_0. The tiny K-quant files hold random blocks, not quantised
    # values, so there the draft is the same file with another RoPE base (about a quarter of drafts accepted).
    draft_file = (tiny_model_path(arch=arch, qtype=qtype, seed=model_seed, rope_base=300_000.0)
                  if qtype.endswith("_K") else tiny_model_path(arch=arch, qtype="Q4_0", seed=model_seed))
    draft = tandem.load(draft_file, dtype=dtype)
    # gemma3's window is 8 tokens in the tiny files: 40 tokens cross it several times.
    stats = []
    for prompt in PROMPTS[:2]:
        plain = run(target, prompt, max_tokens=40)
        spec = run(target, prompt, draft=draft, k=5, max_tokens=40)
        assert spec.tokens == plain.tokens
        stats.append(spec.stats)
    assert_speculated(*stats, rejected=True)


def test_self_draft_accepts_everything(pair64):
    target, _ = pair64
    greedy = run(target, PROMPTS[0], draft=target, k=5, max_tokens=30)
    assert greedy.stats.draft_tokens > 0 and greedy.stats.acceptance_rate == 1.0
    sampled = run(target, PROMPTS[0], draft=target, k=5, max_tokens=30, temperature=0.8, seed=3)
    assert sampled.stats.draft_tokens > 0 and sampled.stats.acceptance_rate > 0.99


def test_ngram_proposer_is_lossless(pair64):
    target, _ = pair64
    prompt = "abc abc abc abc abc abc"
    plain = run(target, prompt, max_tokens=40)
    spec = run(target, prompt, draft="ngram", k=4, max_tokens=40)
    assert spec.tokens == plain.tokens
    assert spec.stats.proposer == "ngram"
    assert_speculated(spec.stats)


def test_ngram_example():
    proposer = NgramProposer(max_ngram=2)
    proposer.start([])
    assert proposer.continuation([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]
    assert proposer.continuation([5, 6, 7, 8, 5, 6, 9], 3) == []
    # match() says which source (match length) has a continuation, and how many tokens it holds (the index grows
    # with the sequence: a proposer follows one request)
    fresh = NgramProposer(max_ngram=2)
    fresh.start([])
    assert fresh.match([5, 6, 7, 8, 5, 6]) == ("ngram2", 4) and fresh.match([5, 6, 7, 8, 5, 6, 9]) == (None, 0)


@pytest.mark.parametrize("run_ahead", [1, 8])
def test_ngram_with_nothing_to_propose_runs_plain_steps_losslessly(pair64, run_ahead):
    # A prompt that repeats only in places: the loop alternates lookups that find a match with runs of plain steps.
    target, _ = pair64
    ids = target.tokenizer.encode("abc abc xyz def abc ghi")
    plain = run(target, ids, max_tokens=40).tokens
    engine = Engine(target, "ngram", slots=1, draft_max=3, measure_costs=False, run_ahead=run_ahead)
    result = engine.generate([Request(ids, max_tokens=40, draft_policy="fixed")])[0]
    assert result.tokens == plain
    assert result.stats.draft_len_counts.get(0, 0) > 0
    assert_speculated(result.stats)


@pytest.mark.parametrize("seed", [0, 7])
def test_seeded_runs_reproduce(pair64, seed):
    target, draft = pair64
    a = run(target, PROMPTS[1], draft=draft, temperature=1.0, top_p=0.9, seed=seed)
    b = run(target, PROMPTS[1], draft=draft, temperature=1.0, top_p=0.9, seed=seed)
    c = run(target, PROMPTS[1], temperature=1.0, top_p=0.9, seed=seed)
    d = run(target, PROMPTS[1], temperature=1.0, top_p=0.9, seed=seed)
    assert a.tokens == b.tokens and c.tokens == d.tokens
    assert_speculated(a.stats)


# --- the sampled distribution, exactly -------------------------------------------------------------------------

# Random tiny models have near-flat logits; a low temperature gives the target a spread but clearly uneven p.
TARGET_SAMPLING = dict(temperature=0.06, top_k=3)
N_GENERATED = 6  # the prefill's token, then room for a 4-token draft and its bonus token
DRAFT_LENGTHS = [4, 3, 2]  # cycled; the loop caps each at the room left, so 1-token drafts happen too
N_SAMPLES = 1200
MIN_EXPECTED = 5  # chi-square cells expecting fewer samples are pooled into one


def skewed_draft_probs(logits, params):
    """The draft's distribution, skewed: from its own top 3 (the draft is the target here), mostly its most likely
    token, partly the least likely ones.

    q = 0.7 * one-hot(top 1) + 0.3 * (the top 3's probabilities reversed). q overlaps p and is far from it, so every
    outcome of a verify happens often: rejection at row 0 and at rows >= 1 (where the residual norm(max(0, p - q))
    leaves the top token out, unlike p), and all k accepted (the bonus token). Any q must keep the output exact."""
    top = logits.topk(3, dim=-1).indices
    reversed_logits = torch.full_like(logits, -math.inf).scatter(-1, top, -logits.gather(-1, top))
    probs = 0.3 * probs_from_logits(reversed_logits, params)
    probs[0, top[0, 0]] += 0.7
    return probs


def sample_sequences(target, prompt_ids, n, monkeypatch, verify=verify_sampled):
    """n speculative generations on the engine under `verify`, the target drafting for itself through
    skewed_draft_probs, draft lengths cycling through DRAFT_LENGTHS (each capped at the room left, so shorter ones
    happen too): ({sequence: count}, {(k, n_accepted): verifies})."""
    outcomes = record_verifies(monkeypatch, verify)
    monkeypatch.setattr(drafter_module, "probs_from_logits", skewed_draft_probs)
    engine = Engine(target, target, slots=1, draft_max=max(DRAFT_LENGTHS), measure_costs=False)
    counts = {}
    for seed in range(n):
        request = Request(prompt_ids, SamplingParams(seed=seed, **TARGET_SAMPLING), max_tokens=N_GENERATED,
                          ignore_eos=True, draft_max=DRAFT_LENGTHS[seed % len(DRAFT_LENGTHS)], draft_policy="fixed")
        tokens = tuple(engine.generate([request])[0].tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    monkeypatch.undo()
    return counts, outcomes


def chi_square_pvalue(counts, dist, n):
    """p-value of the counts under dist; cells expecting < MIN_EXPECTED samples are pooled. 0 when a sequence the
    target gives probability 0 was sampled."""
    if not set(counts) <= set(dist):
        return 0.0
    total = sum(dist.values())  # 1 up to float32 rounding, which scipy's own sum check would trip on
    observed, expected, pooled_observed, pooled_expected = [], [], 0, 0.0
    for cell, mass in dist.items():
        if mass / total * n >= MIN_EXPECTED:
            observed.append(counts.get(cell, 0))
            expected.append(mass / total * n)
        else:
            pooled_observed += counts.get(cell, 0)
            pooled_expected += mass / total * n
    return chisquare(observed + [pooled_observed], expected + [pooled_expected]).pvalue


@pytest.fixture(scope="module")
def distribution_setup(tiny_model_path):
    target = tandem.load(tiny_model_path(seed=11), dtype="float32")
    prompt_ids = target.tokenizer.encode("Once upon")
    return target, prompt_ids, exact_distribution(target, prompt_ids, SamplingParams(**TARGET_SAMPLING), N_GENERATED)


def test_sampled_speculative_matches_target_distribution(distribution_setup, monkeypatch):
    target, prompt_ids, dist = distribution_setup
    assert math.isclose(sum(dist.values()), 1.0, rel_tol=1e-6) and len(dist) == 3**N_GENERATED
    counts, outcomes = sample_sequences(target, prompt_ids, N_SAMPLES, monkeypatch)
    # Every row of verify_sampled decided some tokens: rejections at row 0 and at rows >= 1 (the residual after
    # accepted drafts), and bonus tokens after 2, 3 and 4 accepted drafts.
    drafted = sum(k * v for (k, _), v in outcomes.items())
    accepted = sum(n * v for (_, n), v in outcomes.items())
    assert drafted > 0 and 0 < accepted < drafted
    assert all(outcomes.get((k, n), 0) > 20 for k in (2, 3, 4) for n in range(k + 1)), outcomes
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p > 1e-3, f"speculative sampling departs from the target's distribution (p={p:.3g})"


def test_plain_sampling_matches_target_distribution(distribution_setup):
    target, prompt_ids, dist = distribution_setup
    counts = {}
    for seed in range(N_SAMPLES):
        r = run(target, prompt_ids, max_tokens=N_GENERATED, seed=seed, **TARGET_SAMPLING)
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    assert chi_square_pvalue(counts, dist, N_SAMPLES) > 1e-3


def test_queued_plain_sampling_matches_target_distribution(distribution_setup):
    target, prompt_ids, dist = distribution_setup
    counts = {}
    engine = Engine(target, slots=1, run_ahead=8)  # plain steps queued ahead of the host, as on a GPU
    for seed in range(N_SAMPLES):
        request = Request(prompt_ids, SamplingParams(seed=seed, **TARGET_SAMPLING), max_tokens=N_GENERATED,
                          ignore_eos=True)
        tokens = tuple(engine.generate([request])[0].tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    assert chi_square_pvalue(counts, dist, N_SAMPLES) > 1e-3


def residual_from_target(draft_tokens, draft_probs, target_probs, generator):
    """Accepts by min(1, p/q) but recovers from p instead of the residual, at every row."""
    n, _ = verify_sampled(draft_tokens, draft_probs, target_probs, generator)
    return n, torch.multinomial(target_probs[n], 1, generator=generator).squeeze(-1)


def residual_from_target_after_an_accept(draft_tokens, draft_probs, target_probs, generator):
    """Right at row 0; recovers from p instead of the residual at rows >= 1 only."""
    n, token = verify_sampled(draft_tokens, draft_probs, target_probs, generator)
    if 0 < int(n) < draft_tokens.shape[0]:
        token = torch.multinomial(target_probs[n], 1, generator=generator).squeeze(-1)
    return n, token


def bonus_from_the_draft(draft_tokens, draft_probs, target_probs, generator):
    """Right but for the bonus token, drawn from the draft's last distribution instead of the target's last row."""
    n, token = verify_sampled(draft_tokens, draft_probs, target_probs, generator)
    if int(n) == draft_tokens.shape[0] > 0:
        token = torch.multinomial(draft_probs[-1], 1, generator=generator).squeeze(-1)
    return n, token


def bonus_is_the_top_token(draft_tokens, draft_probs, target_probs, generator):
    """Right but for the bonus token, the target's most likely one instead of a draw from its last row."""
    n, token = verify_sampled(draft_tokens, draft_probs, target_probs, generator)
    if int(n) == draft_tokens.shape[0] > 0:
        token = target_probs[-1].argmax()
    return n, token


@pytest.mark.parametrize("wrong_rule", [residual_from_target, residual_from_target_after_an_accept,
                                        bonus_from_the_draft, bonus_is_the_top_token])
def test_distribution_test_catches_a_wrong_rule(distribution_setup, monkeypatch, wrong_rule):
    target, prompt_ids, dist = distribution_setup
    counts, _ = sample_sequences(target, prompt_ids, N_SAMPLES, monkeypatch, verify=wrong_rule)
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p < 1e-4, f"{wrong_rule.__name__} went unnoticed (p={p:.3g})"


# --- stopping --------------------------------------------------------------------------------------------------

def test_stop_token_ends_generation(pair64):
    target, draft = pair64
    ids = target.tokenizer.encode(PROMPTS[0])
    reference = run(target, ids, max_tokens=12).tokens
    stop_at = next(i for i in range(2, 12) if reference[i] not in reference[:i])
    for d in (None, draft):
        engine = Engine(target, d, slots=1, draft_max=4)
        engine.stop_token_ids = frozenset({reference[stop_at]})
        result = engine.generate([Request(ids, max_tokens=12, draft_policy="fixed")])[0]
        assert result.tokens == reference[:stop_at] and result.finish_reason == "stop"
        if d is not None:
            assert_speculated(result.stats)


@pytest.mark.parametrize("run_ahead", [2, 8])
def test_queued_plain_steps_stop_at_the_end_of_the_context(tiny_model_path, run_ahead):
    # Where the context ends mid-run, the run stops at it: the same tokens as one step at a time.
    small = tandem.load(tiny_model_path(seed=0), dtype="float64", n_ctx=24)
    ids = (small.tokenizer.encode(PROMPTS[0]) * 5)[:20]
    one, ahead = (Engine(small, slots=1, run_ahead=r).generate([Request(ids, max_tokens=100)])[0]
                  for r in (1, run_ahead))
    assert ahead.tokens == one.tokens and len(one.tokens) == 24 - 20 + 1
    assert ahead.finish_reason == "length" and ahead.stats.iterations == one.stats.iterations == 4
    with pytest.raises(ValueError, match="run_ahead must be >= 1"):
        Engine(small, slots=1, run_ahead=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's read-back path needs a GPU")
def test_queued_plain_steps_on_the_gpu_change_no_token(tiny_model_path):
    # On a GPU, queued plain steps land their tokens in pinned host slots reused from run to run of steps.
    target = tandem.load(tiny_model_path(seed=5), dtype="float32", device="cuda", graphs=True)
    ids = target.tokenizer.encode(PROMPTS[1])
    reference = Engine(target, slots=1, run_ahead=1).generate([Request(ids, max_tokens=40)])[0].tokens
    stop_at = next(i for i in range(10, 40) if reference[i] not in reference[:i])
    for max_tokens, stop, expect in ((40, (), reference), (13, (), reference[:13]),
                                     (40, (reference[stop_at],), reference[:stop_at])):
        engine = Engine(target, slots=1, run_ahead=8)
        assert engine.config.run_ahead == 8
        engine.stop_token_ids = frozenset(stop)
        assert engine.generate([Request(ids, max_tokens=max_tokens)])[0].tokens == expect, (max_tokens, stop)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's verify path needs a GPU")
def test_a_verify_fed_from_drafts_on_the_gpu_changes_no_token(tiny_model_path, monkeypatch):
    # On a GPU a lone sequence's verify reads its drafts from the device while they are drawn, and its drafts' time
    # from events: the same tokens as drafts read back first, greedy (the target's own) and seeded sampling.
    target = tandem.load(tiny_model_path(seed=5), dtype="float32", device="cuda", graphs=True)
    draft = tandem.load(tiny_model_path(qtype="Q4_0", seed=5), dtype="float32", device="cuda", graphs=True)
    ids = target.tokenizer.encode(PROMPTS[1])
    plain = Engine(target, slots=1).generate([Request(ids, max_tokens=40)])[0].tokens
    outputs = {}
    for from_device in (True, False):
        engine = Engine(target, draft, slots=1, draft_max=3, prompt_lookup=False)
        keep = engine.drafter.draft
        monkeypatch.setattr(engine.drafter, "draft", lambda drafting, on=False, keep=keep, use=from_device:
                            keep(drafting, on and use))
        outputs[from_device] = [engine.generate([Request(ids, sampling, max_tokens=40, draft_policy="fixed")])[0]
                                for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=2))]
        assert_speculated(outputs[from_device][0].stats)
    assert [r.tokens for r in outputs[True]] == [r.tokens for r in outputs[False]]
    assert outputs[True][0].tokens == plain


def test_a_target_id_beyond_the_drafts_vocabulary_is_lossless(tiny_model_path):
    # Qwen2.5-32B pads its vocabulary to 152064, its small drafts to 151936: a target's id the draft cannot embed
    # (ids past the draft's rows) once crashed the draft's forward (an H200 run, random weights, 256 tokens).
    target = tandem.load(tiny_model_path(seed=3, vocab_size=400), dtype="float64")
    draft = tandem.load(tiny_model_path(seed=3), dtype="float64")
    assert draft.vocab_size < target.vocab_size
    ids = target.tokenizer.encode(PROMPTS[0])
    reference = run(target, ids, max_tokens=40).tokens
    assert max(reference) >= draft.vocab_size  # the case under test happens
    for k in (1, 4):
        spec = run(target, ids, draft=draft, k=k, max_tokens=40)
        assert spec.tokens == reference
        # Other random weights (the vocabularies differ): the point is the draft's stand-in ids and the rejections.
        assert_speculated(spec.stats, accepted=False, rejected=True)


def test_stop_string(pair64):
    target, draft = pair64
    full = run(target, PROMPTS[2], max_tokens=30)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    for d in (None, draft):
        r = run(target, PROMPTS[2], draft=d, max_tokens=30, stop=[stop])
        assert r.text == full.text[: full.text.index(stop)] and r.finish_reason == "stop"
        if d is not None:
            assert_speculated(r.stats)


def test_max_tokens(pair64):
    target, draft = pair64
    for max_tokens in (1, 2, 7):
        r = run(target, PROMPTS[0], draft=draft, k=8, max_tokens=max_tokens)
        assert len(r.tokens) == max_tokens and r.finish_reason == "length"
        assert r.stats.generated_tokens == max_tokens
        if max_tokens > 2:  # one token comes from the prefill, and a draft needs room for the token after it
            assert_speculated(r.stats)


def test_context_limit(tiny_model_path):
    target = tandem.load(tiny_model_path(seed=0), dtype="float64", n_ctx=32)
    draft = tandem.load(tiny_model_path(qtype="Q4_0", seed=0), dtype="float64", n_ctx=32)
    ids = (target.tokenizer.encode(PROMPTS[0]) * 5)[:20]
    plain = run(target, ids, max_tokens=100)
    spec = run(target, ids, draft=draft, k=8, max_tokens=100)
    assert plain.finish_reason == spec.finish_reason == "length"
    assert len(plain.tokens) == 32 - 20 + 1  # the last generated token need not enter the cache
    assert spec.tokens == plain.tokens
    assert_speculated(spec.stats)
    with pytest.raises(ContextOverflowError, match="too many"):
        run(target, list(range(40)), max_tokens=4)


def test_invalid_sampling_parameters(pair64):
    target, _ = pair64
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2),
                dict(temperature=float("nan"))):
        with pytest.raises(ValueError):
            run(target, PROMPTS[0], **bad)
    with pytest.raises(ValueError):
        run(target, PROMPTS[0], max_tokens=0)


def test_stats_fields(pair64):
    target, draft = pair64
    s = run(target, PROMPTS[0], draft=draft, k=4, max_tokens=20).stats
    d = s.to_dict()
    for key in ("prompt_tokens", "generated_tokens", "draft_tokens", "accepted_tokens", "acceptance_rate",
                "iterations", "mean_accepted_len", "prefill_ms", "decode_ms", "draft_ms", "verify_ms",
                "tokens_per_second"):
        assert key in d
    assert s.generated_tokens == 20 and s.iterations >= 1 and s.draft_tokens > 0
    assert s.accepted_tokens <= s.draft_tokens and s.prefill_ms > 0 and s.decode_ms >= s.verify_ms
    assert sum(s.draft_len_counts.values()) == s.iterations


@pytest.fixture(scope="module")
def padded_bf16(tiny_model_path):
    """bfloat16 target and draft on the padded static-step path that CUDA graphs replay (run uncaptured on CPU)."""
    target = tandem.load(tiny_model_path(seed=3), dtype="bfloat16", graphs=True)
    draft = tandem.load(tiny_model_path(qtype="Q4_0", seed=3), dtype="bfloat16", graphs=True)
    return target, draft


@pytest.mark.parametrize("graphs", [True, False])
def test_a_tokens_logits_do_not_depend_on_its_batch(tiny_model_path, graphs):
    # A matmul's rounding depends on its row count (float32 here; bfloat16 on a GPU), so a token verified among 8
    # drafts could get other logits than in a plain one-token step, and greedy ties could flip. Every target
    # forward of 1..9 tokens runs as the same 9 rows: bit-identical rows. Without that (graphs=False) they differ.
    target = tandem.load(tiny_model_path(seed=4, **K_QUANT_SHAPES), dtype="float32", graphs=graphs)
    ids = target.tokenizer.encode(PROMPTS[2])[:14]
    seq = target.new_sequence(64)
    seq.forward(ids[:6], logits="last")
    batched = seq.forward(ids[6:14], logits="all").clone()  # 8 tokens in one forward, like a verify
    seq.rewind(6)
    single = torch.cat([seq.forward([t], logits="all").clone() for t in ids[6:14]])
    seq.close()
    assert torch.equal(batched, single) == graphs, (batched - single).abs().max().item()


@pytest.mark.parametrize("k", [1, 3, 8])
def test_padded_steps_keep_speculation_lossless(padded_bf16, k):
    # Padded rows write cache slots past the real tokens; nothing real may ever read them.
    target, draft = padded_bf16
    stats = []
    for prompt in PROMPTS:
        plain = run(target, prompt, max_tokens=40)
        spec = run(target, prompt, draft=draft, k=k, max_tokens=40)
        assert spec.tokens == plain.tokens, (k, prompt)
        stats.append(spec.stats)
    assert_speculated(*stats, rejected=True)


def test_padded_steps_compute_the_eager_forward(padded_bf16):
    target, _ = padded_bf16
    ids = target.tokenizer.encode(PROMPTS[0])
    eager = target.logits(ids)  # one eager forward, its own cache
    seq = target.new_sequence(64)
    stepped = torch.cat([seq.forward(ids[:5], logits="all").clone()]  # chunked through the 9-row step
                        + [seq.forward([t], logits="all").clone() for t in ids[5:]])
    seq.close()
    assert stepped.shape == eager.shape
    assert (stepped.argmax(-1) == eager.argmax(-1)).float().mean() > 0.9
    assert torch.allclose(stepped, eager, atol=0.15 * eager.abs().max().item())


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_prompt_fed_in_chunks_gives_the_eager_logits(tiny_model_path, device):
    # A prompt of up to 64 tokens runs as several replays of the 9-row step. On a GPU its chunks once went
    # through one pinned staging buffer without waiting, and every chunk but the last read the next one's tokens.
    target = tandem.load(tiny_model_path(seed=5), dtype="float32", device=device, graphs=True)
    ids = (target.tokenizer.encode(" ".join(PROMPTS)) * 4)[:50]
    eager = target.logits(ids)
    seq = target.new_sequence(64)
    chunked = seq.forward(ids, logits="all").clone()
    last = seq.forward(ids[:1], logits="last").clone()  # and the cache holds those 50 tokens at their positions
    seq.close()
    torch.testing.assert_close(chunked, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, target.logits(ids + ids[:1])[-1:], rtol=1e-4, atol=1e-4)
