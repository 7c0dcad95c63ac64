"""The adaptive policy against a fake backend whose costs and acceptance we set."""

import random

import pytest

from tandem.spec.policy import AdaptivePolicy, CostModel, FixedPolicy, expected_tokens

K_MAX = 8


def costs(c_t, c_d, slope):
    """V(n) = c_t + slope * (n - 1): slope ~ 0 on a memory-bound GPU, ~c_t on a compute-bound CPU."""
    return CostModel(draft_step_ms=c_d, verify_ms={n: c_t + slope * (n - 1) for n in (1, 2, K_MAX + 1)})


def analytic_best(c_t, c_d, slope, a):
    rate = lambda k: expected_tokens(a, k) / (k * c_d + c_t + slope * k)  # noqa: E731
    return max(range(K_MAX + 1), key=rate)


def simulate(policy, c_t, c_d, slope, acceptance_of, iterations, seed=0):
    """Run the policy against a fake pair; acceptance_of(i) gives the true per-token rate at iteration i."""
    rng = random.Random(seed)
    chosen = []
    for i in range(iterations):
        k = policy.choose()
        n = 0
        while n < k and rng.random() < acceptance_of(i):
            n += 1
        policy.observe(k, n, draft_ms=k * c_d, verify_ms=c_t + slope * k)
        chosen.append(k)
    return chosen


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_interpolates_verify_cost():
    c = costs(10.0, 1.0, 2.0)
    assert c.verify(5) == pytest.approx(18.0)
    assert c.verify(12) == pytest.approx(32.0)  # extrapolates beyond the measured range


def test_picks_plain_when_drafting_cannot_pay():
    # A 2-core CPU: verify grows ~linearly with k and the draft costs half a step (CONTEXT.md's numbers).
    policy = AdaptivePolicy(costs(40.0, 20.0, 25.0), K_MAX)
    chosen = simulate(policy, 40.0, 20.0, 25.0, lambda i: 0.3, 200)
    assert sum(k == 0 for k in chosen[50:]) / 150 > 0.85  # off, but for rare probes


@pytest.mark.parametrize("a, c_d, slope", [(0.9, 1.0, 0.1), (0.7, 2.0, 0.5), (0.8, 0.5, 3.0)])
def test_converges_to_analytic_best(a, c_d, slope):
    c_t = 10.0
    best = analytic_best(c_t, c_d, slope, a)
    assert best > 0
    policy = AdaptivePolicy(costs(c_t, c_d, slope), K_MAX)
    chosen = simulate(policy, c_t, c_d, slope, lambda i: a, 400, seed=1)
    late = chosen[100:]
    # The estimate of a wanders with the sampled outcomes, so k may step to a neighbour now and then.
    assert sum(abs(k - best) <= 1 for k in late) / len(late) > 0.9, (best, sorted(set(late)))


def test_recovers_after_low_acceptance_phase():
    c_t, c_d, slope = 10.0, 1.0, 0.2
    policy = AdaptivePolicy(costs(c_t, c_d, slope), K_MAX)
    phase = lambda i: 0.02 if i < 150 else 0.9  # noqa: E731
    chosen = simulate(policy, c_t, c_d, slope, phase, 400, seed=2)
    assert sum(k == 0 for k in chosen[60:150]) / 90 > 0.7  # switched off in the bad phase
    assert sum(k >= 4 for k in chosen[300:]) / 100 > 0.9  # and back on, drafting long, after it


def test_fixed_policy():
    assert FixedPolicy(3).choose() == 3
    with pytest.raises(ValueError):
        FixedPolicy(-1)
