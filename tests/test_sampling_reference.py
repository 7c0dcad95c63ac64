"""`probs_from_logits` against a reference that shares none of its code (tests/sampling_reference.py: numpy, from
the definitions) and against Hugging Face's logits warpers; then speculative sampling at top_p 0.8 and min_p 0.1
against the target's distribution enumerated with that reference. Each comparison is shown catching a wrong rule."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import sample_with_drafts
from sampling_reference import CUT_MARGIN, exact_distribution, group_totals, reference_probs, reference_probs_row
from scipy.stats import chi2, ncx2
from test_lossless import MIN_EXPECTED, chi_square_pvalue

import tandem
from tandem.engine import Engine
from tandem.engine import drafter as drafter_module
from tandem.engine import outcomes as outcomes_module
from tandem.sampling import SamplingParams, probs_from_logits
from tandem.speculative.verify import verify_sampled

# --- the reference itself, on rows worked by hand ----------------------------------------------------------------


def test_reference_on_rows_worked_by_hand():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = np.log(probs)

    def ref(**kw):
        return reference_probs(logits, **{"temperature": 1.0, **kw})

    np.testing.assert_allclose(ref(), probs)
    np.testing.assert_allclose(reference_probs(logits * 2, temperature=2.0), probs)
    np.testing.assert_allclose(ref(top_k=2), [4 / 7, 3 / 7, 0, 0])
    # top-p: the mass before each token is 0, 0.4, 0.7, 0.9; a token stays while that is below top_p.
    np.testing.assert_allclose(ref(top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0])
    np.testing.assert_allclose(ref(top_p=0.65), [4 / 7, 3 / 7, 0, 0])
    np.testing.assert_allclose(ref(top_p=1e-12), [1, 0, 0, 0])  # the top token always stays
    np.testing.assert_allclose(ref(min_p=0.6), [4 / 7, 3 / 7, 0, 0])  # threshold 0.24
    # Hugging Face's order: top-p keeps three (0.7 < 0.75), then min-p at 0.3 * 4/9 keeps them all. vLLM's (min-p
    # first) would keep three, renormalise to 4/9, 3/9, 2/9, and top-p would then drop the third (7/9 >= 0.75).
    np.testing.assert_allclose(ref(top_p=0.75, min_p=0.3), [4 / 9, 3 / 9, 2 / 9, 0])
    # Ties: top-k keeps every token tied with the k-th; top-p keeps the lower id of a tie it cuts through.
    tied = np.log(np.array([0.4, 0.2, 0.2, 0.2]))
    np.testing.assert_allclose(reference_probs(tied, 1.0, top_k=2), [0.4, 0.2, 0.2, 0.2])
    np.testing.assert_allclose(reference_probs(tied, 1.0, top_p=0.5), [2 / 3, 1 / 3, 0, 0])
    np.testing.assert_allclose(reference_probs(np.array([1.0, 3.0, 3.0]), 1.0, top_p=1e-9), [0, 1, 0])
    # Masked tokens (-inf: a grammar's) get nothing and never count towards a cut.
    masked = np.array([-np.inf, 0.0, -np.inf, 0.0])
    np.testing.assert_allclose(reference_probs(masked, 0.5, top_k=3, top_p=0.9, min_p=0.5), [0, 0.5, 0, 0.5])


# --- probs_from_logits against the reference and Hugging Face's warpers -----------------------------------------

ROWS = 3


def random_cases(n_cases: int = 300, seed: int = 51) -> list[tuple[np.ndarray, SamplingParams]]:
    """(logits [ROWS, V] float32, params): random widths and settings; logits rounded to a coarse grid (many ties,
    some across a cut), a top tie planted, masked (-inf) tokens, tiny top_p, min_p up to 1."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(n_cases):
        vocab = int(rng.choice([2, 3, 7, 64, 300]))
        logits = rng.normal(size=(ROWS, vocab)) * rng.choice([0.5, 2.0, 6.0])
        if rng.random() < 0.5:
            logits = np.round(logits * 2) / 2  # ties
        if rng.random() < 0.3 and vocab > 2:
            logits[:, 1] = logits.max(axis=-1)  # the top token tied
        if rng.random() < 0.3 and vocab > 3:
            logits[:, rng.choice(vocab, vocab // 3, replace=False)] = -np.inf
            logits[:, 1] = np.where(np.isfinite(logits).any(axis=-1), logits[:, 1], 0.0)
        params = SamplingParams(
            temperature=float(rng.choice([0.05, 0.3, 0.7, 1.0, 2.0])),
            top_k=int(rng.choice([0, 0, 1, 2, 5, vocab])),
            top_p=float(rng.choice([1.0, 1.0, 0.95, 0.8, 0.5, 0.1, 1e-6, 1e-12])),
            min_p=float(rng.choice([0.0, 0.0, 0.05, 0.1, 0.5, 0.9, 1.0])),
        )
        cases.append((logits.astype(np.float32), params))
    return cases


CASES = random_cases()


def mismatches(probs_fn, dtype: torch.dtype = torch.float32, cases=CASES) -> tuple[list, dict[str, int]]:
    """Rows where probs_fn(logits tensor, params) -> [N, V] differs from the reference (tokens tied in their logit
    compared as one: group_totals), and counts: rows checked, rows skipped as ill-conditioned (a cut within
    CUT_MARGIN of a token), rows with a tie that a cut went through."""
    wrong, counts = [], {"checked": 0, "skipped": 0, "tie_cut": 0}
    atol = 1e-5 if dtype == torch.float32 else 1e-10
    for logits, params in cases:
        got = probs_fn(torch.from_numpy(logits).to(dtype), params).double().numpy()
        for row, got_row in zip(logits, got, strict=True):
            expected, margin = reference_probs_row(row, params.temperature, params.top_k, params.top_p, params.min_p)
            if margin < CUT_MARGIN:
                counts["skipped"] += 1
                continue
            counts["checked"] += 1
            want, have = group_totals(row, expected), group_totals(row, got_row)
            counts["tie_cut"] += any(0 < kept < int((row == value).sum()) for value, (kept, _) in want.items())
            same = want.keys() == have.keys() and all(
                want[v][0] == have[v][0] and math.isclose(want[v][1], have[v][1], rel_tol=atol, abs_tol=atol)
                for v in want)
            if not same:
                wrong.append((row, params, expected, got_row))
    return wrong, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_probs_from_logits_matches_the_reference(dtype):
    wrong, counts = mismatches(probs_from_logits, dtype)
    assert not wrong, f"{len(wrong)} rows differ, e.g. {wrong[0]}"
    # The comparison covered what it is for: ties cut by top-p or top-k kept in part, and few rows left out.
    assert counts["tie_cut"] >= 10 and counts["skipped"] <= 0.05 * counts["checked"], counts


def hugging_face_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Hugging Face's warpers in the order its generate() applies them, then a softmax."""
    transformers = pytest.importorskip("transformers")
    warpers = [transformers.TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(transformers.TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(transformers.TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(transformers.MinPLogitsWarper(params.min_p))
    scores = logits.float()
    for warp in warpers:
        scores = warp(None, scores)
    return torch.softmax(scores, dim=-1)


def test_hugging_face_warpers_agree_with_the_reference_and_probs_from_logits():
    pytest.importorskip("transformers")
    wrong, counts = mismatches(hugging_face_probs)
    assert not wrong, f"Hugging Face's warpers and the reference differ on {len(wrong)} rows, e.g. {wrong[0]}"
    assert counts["tie_cut"] >= 10, counts
    for logits, params in CASES:
        ours, theirs = probs_from_logits(torch.from_numpy(logits), params), hugging_face_probs(
            torch.from_numpy(logits), params)
        for row, a, b in zip(logits, ours.double().numpy(), theirs.double().numpy(), strict=True):
            if reference_probs_row(row, params.temperature, params.top_k, params.top_p, params.min_p)[1] < CUT_MARGIN:
                continue
            ga, gb = group_totals(row, a), group_totals(row, b)
            assert all(ga[v][0] == gb[v][0] and abs(ga[v][1] - gb[v][1]) < 1e-5 for v in ga), (row, params)


# Wrong rules the comparison must catch: each differs from the documented one in a single way.

def wrong_temperature(logits, params):
    return probs_from_logits(logits, replace(params, temperature=params.temperature * 7 / 6))


def top_k_without_ties(logits, params):
    """Exactly k tokens (torch.topk's choice among a tie at the k-th place), not every token tied with the k-th."""
    if 0 < params.top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, logits.topk(params.top_k).indices, True)
        logits = logits.masked_fill(~keep, -math.inf)
    return probs_from_logits(logits, replace(params, top_k=0))


def top_p_drops_the_token_that_crosses_it(logits, params):
    """Keeps the tokens whose mass *including* their own stays within top_p (and the top one): one token short."""
    probs = probs_from_logits(logits, replace(params, top_p=1.0, min_p=0.0))
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) > params.top_p
        drop[..., 0] = False
        probs = probs.masked_fill(drop.scatter(-1, order, drop), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs_from_logits(probs.log(), SamplingParams(temperature=1.0, min_p=params.min_p))


def min_p_before_top_p(logits, params):
    """vLLM v1's order (temperature, min-p, top-k, top-p) instead of the documented Hugging Face order."""
    probs = probs_from_logits(logits, replace(params, top_k=0, top_p=1.0))
    return probs_from_logits(probs.log(), replace(params, temperature=1.0, min_p=0.0))


@pytest.mark.parametrize("wrong_rule", [wrong_temperature, top_k_without_ties, top_p_drops_the_token_that_crosses_it,
                                        min_p_before_top_p])
def test_the_comparison_catches_a_wrong_rule(wrong_rule):
    wrong, _ = mismatches(wrong_rule)
    assert len(wrong) >= 5, f"{wrong_rule.__name__} went unnoticed ({len(wrong)} rows differ)"


# --- speculative sampling at top_p 0.8 / min_p 0.1, against the reference ----------------------------------------

# Seed 20's target on "The quick brown fox" at this temperature: 88 sequences of 6 tokens; top-p cuts tokens min-p
# would keep at some positions, min-p cuts tokens top-p would keep at others (checked below), so both filters count.
TOP_P_MIN_P = dict(temperature=0.15, top_p=0.8, min_p=0.1)
# The target's p at a wrong temperature, planted in verification. Colder: the same support, the mass moved (only the
# statistic can see it); hotter: sequences the right p never gives, which the test fails at once.
WRONG_TEMPERATURES = [0.13, 0.175]
N_GENERATED = 6  # the prefill's token, then room for a 4-token draft and its bonus token
DRAFT_LENGTHS = [4, 3, 2]
N_SAMPLES = 1200
DRAFT_RANK_WEIGHTS = [0.55, 0.1, 0.15, 0.2]  # q over the draft's 4 likeliest tokens by rank


def ranked_draft_probs(logits, params):
    """The draft's q [N, V], whatever params say: DRAFT_RANK_WEIGHTS over each row's 4 likeliest tokens. Far from p
    at every position (the last two ranks are often outside the target's top-p / min-p set, always rejected), so
    every outcome of a verify happens often. Any q must keep the output exact."""
    top = logits.topk(len(DRAFT_RANK_WEIGHTS), dim=-1).indices
    weights = torch.tensor(DRAFT_RANK_WEIGHTS, dtype=torch.float32).expand(top.shape)
    return torch.zeros(logits.shape, dtype=torch.float32).scatter(-1, top, weights)


def sample_sequences(target, prompt_ids, monkeypatch, target_temperature=None):
    """N_SAMPLES generations on an engine of 4 slots (4 requests at a time, each on its own seed), the target drafting
    for itself through ranked_draft_probs: ({sequence: count}, {(k, n_accepted): verifies}). target_temperature:
    the verifier's p at this temperature instead of the request's (a planted bug)."""
    monkeypatch.setattr(drafter_module, "probs_from_logits", ranked_draft_probs)
    if target_temperature is not None:
        monkeypatch.setattr(outcomes_module, "probs_from_logits", lambda logits, params: probs_from_logits(
            logits, replace(params, temperature=target_temperature)))
    engine = Engine(target, target, slots=4, draft_max=max(DRAFT_LENGTHS), measure_costs=False, prompt_lookup=False)
    return sample_with_drafts(engine, prompt_ids, TOP_P_MIN_P, N_SAMPLES, N_GENERATED, DRAFT_LENGTHS, monkeypatch,
                              verify_sampled)


@pytest.fixture(scope="module")
def top_p_min_p_setup(tiny_model_path):
    target = tandem.load(tiny_model_path(seed=20), dtype="float32")
    prompt_ids = target.tokenizer.encode("The quick brown fox")

    def last_row(ids):
        return target.logits(ids)[-1].numpy()

    dist, margin = exact_distribution(last_row, prompt_ids, N_GENERATED, **TOP_P_MIN_P)
    # Well-conditioned: no token within CUT_MARGIN of a cut, so float32 arithmetic cuts where float64 does.
    assert margin > CUT_MARGIN, margin
    # Both filters matter: at some positions top-p cuts tokens min-p alone keeps, at others min-p cuts tokens top-p
    # alone keeps.
    top_p_cuts = min_p_cuts = 0
    for prefix in {sequence[:i] for sequence in dist for i in range(N_GENERATED)}:
        row = last_row(prompt_ids + list(prefix))
        kept_by = {name: reference_probs(row, TOP_P_MIN_P["temperature"], **kw) > 0 for name, kw in
                   (("both", dict(top_p=0.8, min_p=0.1)), ("top_p", dict(top_p=0.8)), ("min_p", dict(min_p=0.1)))}
        top_p_cuts += bool((kept_by["both"] != kept_by["min_p"]).any())
        min_p_cuts += bool((kept_by["both"] != kept_by["top_p"]).any())
    assert top_p_cuts >= 5 and min_p_cuts >= 5, (top_p_cuts, min_p_cuts)
    return target, prompt_ids, dist, last_row


def test_speculative_sampling_at_top_p_and_min_p_matches_the_reference(top_p_min_p_setup, monkeypatch):
    target, prompt_ids, dist, _ = top_p_min_p_setup
    counts, outcomes = sample_sequences(target, prompt_ids, monkeypatch)
    # Every row of the verifier decided tokens: rejections at row 0 and after accepted drafts, and all k accepted.
    assert all(outcomes.get((k, n), 0) >= 10 for k in (2, 3, 4) for n in range(k + 1)), sorted(outcomes.items())
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p > 1e-3, f"speculative sampling at top_p/min_p departs from the reference distribution (p={p:.3g})"


def power_against(dist: dict, wrong: dict, n: int, alpha: float = 1e-4) -> float:
    """The chi-square's chance to reject `dist` at level alpha from n samples of `wrong`, with chi_square_pvalue's
    pooling, from mass moved between cells alone (a noncentral chi-square): sequences outside dist's support,
    which fail chi_square_pvalue outright, count here only by the mass they take from the others."""
    inside = sum(mass for cell, mass in wrong.items() if cell in dist)
    cells, pooled, pooled_wrong = [], 0.0, 0.0
    for cell, mass in dist.items():
        if mass * n >= MIN_EXPECTED:
            cells.append((mass, wrong.get(cell, 0.0) / inside))
        else:
            pooled, pooled_wrong = pooled + mass, pooled_wrong + wrong.get(cell, 0.0) / inside
    cells.append((pooled, pooled_wrong))
    noncentrality = n * sum((w - m) ** 2 / m for m, w in cells if m > 0)
    df = len(cells) - 1
    return float(ncx2.sf(chi2.isf(alpha, df), df, noncentrality))


@pytest.mark.parametrize("wrong_temperature", WRONG_TEMPERATURES)
def test_the_distribution_test_catches_a_wrong_temperature(top_p_min_p_setup, monkeypatch, wrong_temperature):
    target, prompt_ids, dist, last_row = top_p_min_p_setup
    wrong, _ = exact_distribution(last_row, prompt_ids, N_GENERATED, **{**TOP_P_MIN_P,
                                                                         "temperature": wrong_temperature})
    outside = sum(mass for cell, mass in wrong.items() if cell not in dist)
    if wrong_temperature < TOP_P_MIN_P["temperature"]:
        # Colder keeps to the right support: only the statistic can see it, and it has the power to.
        assert outside == 0.0 and power_against(dist, wrong, N_SAMPLES) > 0.99
    else:
        assert outside * N_SAMPLES > 50  # hotter: sequences the right p never gives
    counts, _ = sample_sequences(target, prompt_ids, monkeypatch, target_temperature=wrong_temperature)
    p = chi_square_pvalue(counts, dist, N_SAMPLES)
    assert p < 1e-4, f"the target's p at temperature {wrong_temperature} went unnoticed (p={p:.3g})"
