"""Tests of the speculative speedup model against exact enumeration and brute-force simulation.

Statistical tests here use numpy's seeded generator and state their bound; each has a negative
control (a plausible wrong formula) that the same bound rejects.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxinfer.speculative.speedup import (
    LinearCost,
    TableCost,
    best_gamma,
    cycle_time,
    emitted_distribution,
    estimate_alpha,
    expected_tokens_per_cycle,
    pooled_alpha,
    speedup,
)

# |z| bound of the simulation tests: two-sided p = 6.3e-5 per comparison.
Z_BOUND = 4.0
NUM_CYCLES = 200_000


def _enumerated_law(alpha: np.ndarray) -> np.ndarray:
    """P(num_emitted = k+1) by enumerating all 2^γ accept/reject patterns, float64."""
    gamma = len(alpha)
    bits = np.array(list(itertools.product([0, 1], repeat=gamma)), bool)  # [2^γ, γ]
    prob = np.prod(np.where(bits, alpha, 1.0 - alpha), axis=1)  # [2^γ]
    accepted = np.where(bits.all(axis=1), gamma, np.argmin(bits, axis=1))  # first reject
    return np.bincount(accepted, weights=prob, minlength=gamma + 1)


def _simulate_emitted(rng: np.random.Generator, alpha: np.ndarray, cycles: int) -> np.ndarray:
    """Brute force: per cycle, Bernoulli(α_i) at each position, count the leading accepts + 1."""
    accept = rng.random((cycles, len(alpha))) < alpha  # [cycles, γ]
    return np.cumprod(accept, axis=1).sum(axis=1) + 1  # [cycles]


ALPHAS = [
    np.array([0.9]),
    np.array([0.3, 0.8]),
    np.array([0.9, 0.8, 0.7, 0.6]),
    np.array([0.0, 1.0, 0.5]),
    np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    np.array([0.95, 0.2, 0.99, 0.5, 0.7, 0.85]),
]


@pytest.mark.parametrize("alpha", ALPHAS, ids=lambda a: "-".join(f"{x:g}" for x in a))
def test_expected_tokens_matches_enumeration(alpha):
    gamma = len(alpha)
    law = _enumerated_law(alpha)
    np.testing.assert_allclose(emitted_distribution(alpha, gamma), law, rtol=0, atol=1e-12)
    mean = float(np.sum(np.arange(1, gamma + 2) * law))
    assert abs(expected_tokens_per_cycle(alpha, gamma) - mean) < 1e-12
    # A longer per-position array: only the first γ entries matter.
    assert abs(expected_tokens_per_cycle(np.append(alpha, 0.123), gamma) - mean) < 1e-12


@pytest.mark.parametrize("a", [0.0, 0.25, 0.8, 0.999999, 1.0])
@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_constant_alpha_closed_form(a, gamma):
    law = _enumerated_law(np.full(gamma, a))
    mean = float(np.sum(np.arange(1, gamma + 2) * law))
    assert abs(expected_tokens_per_cycle(a, gamma) - mean) < 1e-9
    assert abs(expected_tokens_per_cycle(np.full(gamma, a), gamma) - mean) < 1e-12


def test_expected_tokens_matches_simulation():
    rng = np.random.default_rng(0)
    alpha = np.array([0.9, 0.8, 0.7, 0.6])
    n = _simulate_emitted(rng, alpha, NUM_CYCLES)
    stderr = n.std() / np.sqrt(NUM_CYCLES)
    z = (n.mean() - expected_tokens_per_cycle(alpha, len(alpha))) / stderr
    assert abs(z) < Z_BOUND, z
    # Negative controls: forgetting the bonus token, or summing α without the products.
    assert abs(n.mean() - (np.sum(np.cumprod(alpha)))) / stderr > Z_BOUND
    assert abs(n.mean() - (1.0 + np.sum(alpha))) / stderr > Z_BOUND


def test_speedup_matches_simulated_wall_clock():
    """Decode M tokens cycle by cycle with simulated accepts and the cycle's wall time."""
    rng = np.random.default_rng(1)
    alpha, gamma = np.array([0.85, 0.8, 0.75, 0.7, 0.65]), 5
    t_plain, t_draft, overhead = 0.020, 0.004, 0.001
    verify = LinearCost(a=0.018, b=0.004)  # a 6-position verify costs 2.1x a 1-token step
    n = _simulate_emitted(rng, alpha, NUM_CYCLES)
    total_tokens = int(0.9 * n.sum())  # stop mid-stream, as a real generation does
    cycles = int(np.searchsorted(np.cumsum(n), total_tokens)) + 1
    wall = cycles * (gamma * t_draft + verify(gamma + 1) + overhead)
    simulated = total_tokens * t_plain / wall
    predicted = speedup(alpha, gamma, t_plain, t_draft, verify, overhead)
    # Error of the simulated ratio: that of the mean of num_emitted (relative), plus at most one
    # partial cycle of γ tokens at the end.
    tol = Z_BOUND * n.std() / np.sqrt(cycles) / n.mean() + (gamma + 1) / total_tokens
    assert abs(simulated / predicted - 1.0) < tol, (simulated, predicted)
    # Negative control: pricing the verify like a 1-token step overstates the speedup.
    flat = speedup(alpha, gamma, t_plain, t_draft, LinearCost(a=verify(1), b=0.0), overhead)
    assert abs(simulated / flat - 1.0) > tol
    assert cycle_time(gamma, t_draft, verify, overhead) == pytest.approx(wall / cycles)


def _brute_force_best(alpha, t_plain, t_draft, verify, overhead, gammas):
    """Argmax over γ of E[n] · t_plain / cycle time, with E[n] from enumeration."""
    scores = {}
    for g in gammas:
        a = np.full(g, alpha) if np.ndim(alpha) == 0 else np.asarray(alpha)[:g]
        mean = float(np.sum(np.arange(1, g + 2) * _enumerated_law(a)))
        scores[g] = mean * t_plain / (g * t_draft + verify(g + 1) + overhead)
    best = max(scores, key=lambda g: (scores[g], -g))
    return best, scores[best], scores


BEST_CASES = [  # alpha, t_plain, t_draft, verify, overhead, gammas passed (None: default)
    (0.8, 0.020, 0.003, LinearCost(0.018, 0.004), 0.0005, list(range(1, 11))),
    (0.8, 0.020, 0.003, LinearCost(0.018, 0.004), 0.0005, None),
    (
        np.array([0.95, 0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1]),
        0.02,
        0.002,
        LinearCost(0.02, 0.002),
        0.0,
        None,
    ),
    (
        0.6,
        0.02,
        0.004,
        TableCost.from_measurements({2: 0.024, 3: 0.027, 4: 0.033, 5: 0.041}),
        0.0,
        None,
    ),
    (0.0, 0.02, 0.002, LinearCost(0.02, 0.001), 0.0, list(range(1, 6))),
    (1.0, 0.02, 0.0, LinearCost(0.02, 0.0), 0.0, list(range(1, 9))),
    (0.0, 0.02, 0.0, LinearCost(0.02, 0.0), 0.0, [4, 2, 5, 3]),  # all tie at speedup 1
]


@pytest.mark.parametrize("case", range(len(BEST_CASES)))
def test_best_gamma_is_the_argmax(case):
    alpha, t_plain, t_draft, verify, overhead, gammas = BEST_CASES[case]
    got_gamma, got_speedup = best_gamma(alpha, t_plain, t_draft, verify, overhead, gammas)
    if gammas is None:  # the documented defaults
        if np.ndim(alpha) == 1:
            gammas = list(range(1, len(alpha) + 1))
        elif isinstance(verify, TableCost):
            gammas = [1, 2, 3, 4]
        else:
            gammas = list(range(1, 17))
    want_gamma, want_speedup, scores = _brute_force_best(
        alpha, t_plain, t_draft, verify, overhead, gammas
    )
    assert got_gamma == want_gamma, scores
    assert abs(got_speedup - want_speedup) < 1e-12
    if case in (0, 2):  # the optimum is interior, so the search really compares candidates
        assert min(gammas) < got_gamma < max(gammas), scores
    if case == 4:  # nothing is ever accepted: speculation only costs time
        assert got_gamma == 1 and got_speedup < 1.0
    if case == 5:  # everything accepted, free drafts, flat verify: longest γ wins
        assert got_gamma == max(gammas)
    if case == 6:  # ties go to the smallest γ
        assert got_gamma == 2 and got_speedup == 1.0


def test_linear_cost_fit():
    ns = np.arange(1, 9)
    exact = LinearCost.fit(ns, 0.015 + 0.0025 * ns)
    assert exact.a == pytest.approx(0.015, abs=1e-12) and exact.b == pytest.approx(
        0.0025, abs=1e-12
    )
    rng = np.random.default_rng(2)
    ns = np.repeat(np.arange(1, 9), 50)
    times = 0.015 + 0.0025 * ns + rng.normal(0.0, 1e-4, size=ns.shape)
    noisy = LinearCost.fit(ns, times)
    # Standard errors of the slope and intercept for σ = 1e-4 are ~2.2e-6 and ~1.1e-5.
    assert abs(noisy.b - 0.0025) < 4.5 * 2.2e-6 and abs(noisy.a - 0.015) < 4.5 * 1.1e-5
    with pytest.raises(ValueError, match="at least two distinct n"):
        LinearCost.fit([4, 4, 4], [0.1, 0.1, 0.1])
    with pytest.raises(ValueError, match="equal length"):
        LinearCost.fit([1, 2, 3], [0.1, 0.2])


def test_table_cost():
    table = TableCost.from_measurements({5: 0.04, 1: 0.02, 3: 0.03})
    assert table.times == ((1, 0.02), (3, 0.03), (5, 0.04))
    assert table(3) == 0.03 and table.gammas() == [2, 4]
    with pytest.raises(ValueError, match=r"n=4 positions; measured n: \[1, 3, 5\]"):
        table(4)
    with pytest.raises(ValueError, match="empty"):
        TableCost.from_measurements({})


def test_estimate_alpha_exact_counts():
    # γ = 3; counts 0,1,2,2,3: position 0 reached 5x accepted 4x; 1: 4/3; 2: 3/1.
    np.testing.assert_allclose(estimate_alpha([0, 1, 2, 2, 3], 3), [4 / 5, 3 / 4, 1 / 3])
    assert pooled_alpha([0, 1, 2, 2, 3], 3) == pytest.approx(8 / (1 + 2 + 3 + 3 + 3))
    # A position no cycle reached has no estimate.
    est = estimate_alpha([0, 0, 1], 3)
    assert est[0] == pytest.approx(1 / 3) and est[1] == 0.0 and np.isnan(est[2])
    with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\]"):
        expected_tokens_per_cycle(est, 3)


def test_estimate_alpha_recovers_simulated_rates():
    rng = np.random.default_rng(3)
    alpha = np.array([0.9, 0.7, 0.5, 0.8])
    counts = _simulate_emitted(rng, alpha, NUM_CYCLES) - 1
    est = estimate_alpha(counts, len(alpha))
    reached = np.array([(counts >= i).sum() for i in range(len(alpha))])
    stderr = np.sqrt(alpha * (1 - alpha) / reached)
    assert np.all(np.abs(est - alpha) / stderr < Z_BOUND), (est, alpha)
    # Negative control: the unconditional fraction of cycles accepting position i is not α_i.
    naive = np.array([(counts > i).mean() for i in range(len(alpha))])
    assert np.any(np.abs(naive - alpha) / stderr > Z_BOUND)

    constant = _simulate_emitted(rng, np.full(4, 0.75), NUM_CYCLES) - 1
    trials = np.minimum(constant + 1, 4).sum()
    z = (pooled_alpha(constant, 4) - 0.75) / np.sqrt(0.75 * 0.25 / trials)
    assert abs(z) < Z_BOUND, z
    # Negative control: accepted / proposed (γ per cycle) is biased low.
    assert abs((constant.sum() / (4 * NUM_CYCLES) - 0.75) / np.sqrt(0.75 * 0.25 / trials)) > Z_BOUND


def test_validation_names_the_bad_value():
    with pytest.raises(ValueError, match=r"gamma must be an integer >= 1, got 0"):
        expected_tokens_per_cycle(0.5, 0)
    with pytest.raises(ValueError, match=r"length >= gamma=4, got shape \(3,\)"):
        expected_tokens_per_cycle([0.5, 0.5, 0.5], 4)
    with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\]"):
        expected_tokens_per_cycle(1.5, 2)
    with pytest.raises(ValueError, match=r"t_plain=0"):
        speedup(0.5, 2, 0, 0.01, LinearCost(0.01, 0.001))
    with pytest.raises(ValueError, match=r"accepted_counts must lie in \[0, gamma=2\]"):
        estimate_alpha([0, 3], 2)
    with pytest.raises(ValueError, match=r"integer array"):
        pooled_alpha([0.5, 1.0], 2)
    with pytest.raises(ValueError, match=r"gammas is empty"):
        best_gamma(0.5, 0.02, 0.01, LinearCost(0.01, 0.001), gammas=[])
