"""The verifier alone: exact greedy tables, and rejection sampling reproducing the target's distribution."""

import pytest
import torch
from scipy.stats import chisquare

from tandem.speculative.verify import verify_greedy, verify_sampled


@pytest.mark.parametrize(
    "draft, target, n, nxt",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted, bonus token
        ([1, 2, 3], [1, 5, 3, 4], 1, 5),  # mismatch at 2: keep 1, target's own 5
        ([1, 2, 3], [0, 2, 3, 4], 0, 0),  # first rejected
        ([], [4], 0, 4),  # k = 0 is plain decoding
        ([2, 2], [2, 2, 2], 2, 2),
    ],
)
def test_greedy_table(draft, target, n, nxt):
    assert verify_greedy(draft, target) == (n, draft[:n] + [nxt])


def biased_verify(draft_tokens, draft_probs, target_probs, generator):
    """Negative control: on rejection draw from p instead of the residual max(0, p - q)."""
    n, _ = verify_sampled(draft_tokens, draft_probs, target_probs, generator)
    return n, torch.multinomial(target_probs[n], 1, generator=generator).squeeze(-1)


def first_token_counts(verify, target_probs, draft_probs, trials, seed):
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(target_probs.shape[-1])
    k = draft_probs.shape[0]
    for _ in range(trials):
        draft_tokens = torch.stack([torch.multinomial(draft_probs[i], 1, generator=generator)[0] for i in range(k)])
        n, nxt = verify(draft_tokens, draft_probs, target_probs, generator)
        first = draft_tokens[0] if n > 0 else nxt
        counts[first] += 1
    return counts


PROBS = dict(
    target=torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.1, 0.1, 0.1, 0.6]]),
    draft=torch.tensor([[0.05, 0.1, 0.5, 0.3, 0.05], [0.6, 0.1, 0.1, 0.1, 0.1]]),
)


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_first_token_follows_target(seed):
    trials = 6000
    counts = first_token_counts(verify_sampled, PROBS["target"], PROBS["draft"], trials, seed)
    p = chisquare(counts.numpy(), (PROBS["target"][0] * trials).numpy()).pvalue
    assert p > 1e-3, f"seed {seed}: counts {counts.tolist()} do not follow the target (p={p:.2g})"


def test_negative_control_catches_biased_rule():
    trials = 6000
    counts = first_token_counts(biased_verify, PROBS["target"], PROBS["draft"], trials, seed=0)
    p = chisquare(counts.numpy(), (PROBS["target"][0] * trials).numpy()).pvalue
    assert p < 1e-6, f"the biased rule went unnoticed (p={p:.2g})"


def test_identical_draft_is_always_accepted():
    probs = torch.softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(3)), dim=-1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens = torch.multinomial(probs[:3], 1, generator=generator).squeeze(-1)
        n, _ = verify_sampled(tokens, probs[:3], probs, generator)
        assert int(n) == 3


def test_deterministic_proposal_is_one_hot():
    # q one-hot: accept x with probability p(x); on rejection the residual is p with x removed.
    target = torch.tensor([[0.25, 0.75, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    outcomes = torch.zeros(3)
    for _ in range(4000):
        n, nxt = verify_sampled(torch.tensor([0]), None, target, generator)
        outcomes[0 if int(n) == 1 else int(nxt)] += 1
    assert outcomes[2] == 0  # p = 0 is never emitted
    assert chisquare(outcomes[:2].numpy(), [1000.0, 3000.0]).pvalue > 1e-3


def test_the_host_argmax_is_torchs_on_ties_nans_views_and_dtypes():
    """tandem.sampling.argmax takes numpy's argmax on the CPU (torch's was 10-200x slower there): the same ids,
    the first of equal maxima, a NaN wins as in torch, strided views and float64 alike."""
    from tandem.sampling import argmax

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 1000, generator=g)
    rows[1, 10] = rows[1, 700] = rows[1].max() + 1  # a tie: the first wins
    rows[2, 333] = float("nan")
    rows[3] = 0.0
    for x in (rows, rows[:, :900], rows[-1:], rows[0], rows.double(), rows.T.contiguous().T):
        got = argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), x.shape
    assert argmax(rows)[1] == 10 and argmax(rows)[2] == 333 and argmax(rows)[3] == 0


def test_synthetic_verify_of_picked_tokens_draws_as_on_logits():
    """The host's synthetic verify of tokens a backend picked (llama.cpp's greedy rows) takes the same draws from the
    request's generator and gives the same outcome as verify_synthetic on the logits rows they were picked from."""
    from tandem.speculative.verify import verify_synthetic, verify_synthetic_picked

    outcomes = set()
    for seed in range(200):
        k = 1 + seed % 6
        logits = torch.randn(k + 1, 50, generator=torch.Generator().manual_seed(seed))
        drafts = torch.randint(0, 50, (k,), generator=torch.Generator().manual_seed(seed + 1000)).tolist()
        rate = (0.3, 0.8, 1.0, 0.0)[seed % 4]
        n, token = verify_synthetic(torch.tensor(drafts), logits, rate, torch.Generator().manual_seed(seed))
        got = verify_synthetic_picked(drafts, logits.argmax(-1), rate, torch.Generator().manual_seed(seed))
        assert got == (int(n), drafts[: int(n)] + [int(token)]), seed
        outcomes.add(got[0])
    assert len(outcomes) == 7  # every count from none to all six accepted was drawn
