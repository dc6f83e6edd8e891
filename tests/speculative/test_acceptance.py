"""Tests of speculative acceptance: exactness by enumeration and by sampling, edge cases, greedy
and coupled modes against plain loops written here.

The setup of the exactness tests: per-position target distributions p_0..p_γ and draft
distributions q_0..q_{γ-1} that do not depend on the prefix, and drafted tokens x_i ~ q_i drawn
independently. In a real model p_j is p(· | committed prefix); here the prefix is ignored, which
keeps the enumeration finite without changing the claim. What is tested, exactly:

  (E1) the law of the emitted sequence (num_emitted, tokens) equals the law implied by the rule,
       P(n = k+1, x_<k, c) = Π_{i<k} min(p_i(x_i), q_i(x_i)) · (max(0, p_k(c) − q_k(c)) if k < γ
       else p_γ(c)), computed here in float64 without the implementation;
  (E2) for every position j and every emitted prefix s_<j, conditioned on the cycle reaching j
       with that prefix (num_emitted > j), the token at j is distributed as p_j. This is the
       property that makes the speculative loop exact: each committed token follows p given
       everything committed before it, whichever way (accepted draft, correction, bonus) it
       was produced. In particular the first token is distributed as p_0;
  (E3) P(num_emitted > j) = Π_{i<j} α_i with α_i = Σ_x min(p_i(x), q_i(x)).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import chi2

from jaxinfer.speculative import (
    PAD_TOKEN,
    acceptance_probs,
    correction_probs,
    coupled_accept,
    expected_acceptance,
    greedy_accept,
    rejection_sample,
    rejection_sample_with_noise,
)
from jaxinfer.speculative.speedup import estimate_alpha

EXACT_TOL = 1e-6  # float32 probabilities, sums accumulated in float64


def _random_dist(rng: np.random.Generator, shape: tuple[int, ...], zero_frac: float) -> np.ndarray:
    """Dirichlet(0.5) rows with about `zero_frac` of the entries set to exactly zero: float32."""
    d = rng.dirichlet(np.full(shape[-1], 0.5), size=shape[:-1])
    zero = rng.random(shape) < zero_frac
    zero[..., 0] &= ~np.all(zero, axis=-1)  # keep at least one token alive per row
    d = np.where(zero, 0.0, d)
    return (d / d.sum(-1, keepdims=True)).astype(np.float32)


def _log(x: np.ndarray) -> np.ndarray:
    """log with log 0 = -inf, quietly: zero-mass tokens become -inf logits."""
    with np.errstate(divide="ignore"):
        return np.log(x)


# ---------------------------------------------------------------------------------------------
# (E1-E3) Exactness by enumeration.
# ---------------------------------------------------------------------------------------------


def _law_from_implementation(p: np.ndarray, q: np.ndarray) -> list[np.ndarray]:
    """Law of the emitted sequence from the implementation's per-step probabilities.

    Returns laws[k] `[V]*(k+1)`: P(num_emitted = k+1, tokens = (x_0..x_{k-1}, c)). Every draft
    sequence x in V^γ goes through the jitted `acceptance_probs` (one batched call); the
    stopping row comes from the jitted `correction_probs`. That the sampler consumes exactly
    these per-step probabilities is checked by `test_sampler_consumes_noise_as_documented`.
    """
    gamma, v = q.shape
    drafts = np.array(list(itertools.product(range(v), repeat=gamma)), np.int32)  # [V^γ, γ]
    n = drafts.shape[0]
    acc = acceptance_probs(
        jnp.broadcast_to(p, (n, *p.shape)), jnp.broadcast_to(q, (n, *q.shape)), drafts
    )
    acc = np.asarray(acc, np.float64).reshape([v] * gamma + [gamma])  # [V]*γ + [γ]
    corr = np.asarray(correction_probs(p[None], q[None])[0], np.float64)  # [γ+1, V]
    weight = np.ones([v] * gamma)  # Π_i q_i(x_i) as an outer product, [V]*γ
    for i in range(gamma):
        weight = weight * q[i].astype(np.float64).reshape(
            [v if a == i else 1 for a in range(gamma)]
        )
    laws = []
    for k in range(gamma + 1):
        f = weight * np.prod(acc[..., :k], axis=-1)
        if k < gamma:
            f = f * (1.0 - acc[..., k])
        f = f.sum(axis=tuple(range(k, gamma)))  # later drafts are never looked at: [V]*k
        laws.append(f[..., None] * corr[k])
    return laws


def _law_from_rule(p: np.ndarray, q: np.ndarray, correction_from_p: bool = False) -> list:
    """The law the rule implies, in float64, built recursively position by position.

    With `correction_from_p` the rule is broken the way a common bug breaks it (resampling from
    p instead of the residual after a rejection); used as a negative control.
    """
    p64, q64 = p.astype(np.float64), q.astype(np.float64)
    gamma = q.shape[0]
    laws, prefix = [], np.ones(())  # prefix[x_<k] = P(first k drafts are x_<k and accepted)
    for k in range(gamma + 1):
        if k == gamma:
            stop = p64[k]
        elif correction_from_p:
            stop = (1.0 - np.minimum(p64[k], q64[k]).sum()) * p64[k]
        else:
            stop = np.maximum(p64[k] - q64[k], 0.0)
        laws.append(prefix[..., None] * stop)
        if k < gamma:
            prefix = prefix[..., None] * np.minimum(p64[k], q64[k])
    return laws


def _reach_joint(laws: list[np.ndarray], j: int) -> np.ndarray:
    """P(num_emitted > j, tokens_0..j = (s, t)) `[V]*(j+1)` from the law of the sequence."""
    return sum(laws[k].sum(axis=tuple(range(j + 1, k + 1))) for k in range(j, len(laws)))


def _exactness_error(laws: list[np.ndarray], p: np.ndarray) -> float:
    """max over j, s, t of |P(n > j, s, t) − P(n > j, s) p_j(t)|: zero iff (E2) holds."""
    err = 0.0
    for j in range(len(laws)):
        joint = _reach_joint(laws, j)  # [V]*(j+1)
        expected = joint.sum(-1, keepdims=True) * p[j].astype(np.float64)
        err = max(err, float(np.abs(joint - expected).max()))
    return err


ENUM_CASES = [  # (V, γ, seed, zero_frac, tie a position: p_1 = q_1)
    (2, 1, 0, 0.0, False),
    (8, 1, 1, 0.3, False),
    (8, 2, 2, 0.3, True),
    (6, 3, 3, 0.4, False),
    (5, 4, 4, 0.3, True),
    (8, 4, 5, 0.25, False),
]


@pytest.mark.parametrize("v, gamma, seed, zero_frac, tie", ENUM_CASES)
def test_exact_by_enumeration(v, gamma, seed, zero_frac, tie):
    rng = np.random.default_rng(seed)
    p = _random_dist(rng, (gamma + 1, v), zero_frac)  # [γ+1, V]
    q = _random_dist(rng, (gamma, v), zero_frac)  # [γ, V]
    if tie:
        q[1] = p[1]  # residual all zero at position 1: it can never be rejected
    laws = _law_from_implementation(p, q)
    rule = _law_from_rule(p, q)

    assert abs(sum(law.sum() for law in laws) - 1.0) < EXACT_TOL
    # (E1) the implementation's law of emitted sequences is the rule's.
    for k in range(gamma + 1):
        np.testing.assert_allclose(laws[k], rule[k], rtol=0, atol=EXACT_TOL)
    # (E2) conditioned on reaching j with any prefix, the token at j follows p_j.
    assert _exactness_error(laws, p) < EXACT_TOL
    np.testing.assert_allclose(_reach_joint(laws, 0), p[0], rtol=0, atol=EXACT_TOL)
    # (E3) the cycle reaches j with probability Π_{i<j} α_i.
    alpha = np.minimum(p[:gamma], q).astype(np.float64).sum(-1)  # [γ]
    for j in range(gamma + 1):
        assert abs(_reach_joint(laws, j).sum() - np.prod(alpha[:j])) < EXACT_TOL
    np.testing.assert_allclose(
        np.asarray(expected_acceptance(p[None], q[None])[0]), alpha, rtol=0, atol=EXACT_TOL
    )
    # Negative control: the check has the power to see a plausible bug.
    assert _exactness_error(_law_from_rule(p, q, correction_from_p=True), p) > 1e-3


def test_sampler_consumes_noise_as_documented():
    """Accept iff u_i < min(1, p/q); the stopping token is argmax(log residual + g).

    The reference is a plain Python loop over sequences in float64, not the implementation.
    """
    rng = np.random.default_rng(7)
    b, gamma, v = 256, 3, 8
    p = _random_dist(rng, (b, gamma + 1, v), 0.3)
    q = _random_dist(rng, (b, gamma, v), 0.3)
    drafts = np.stack(
        [[rng.choice(v, p=q[r, i] / q[r, i].sum()) for i in range(gamma)] for r in range(b)]
    ).astype(np.int32)
    uniforms = rng.random((b, gamma)).astype(np.float32)
    gumbel = rng.gumbel(size=(b, v)).astype(np.float32)
    tokens, num_emitted = rejection_sample_with_noise(p, q, drafts, uniforms, gumbel)
    tokens, num_emitted = np.asarray(tokens), np.asarray(num_emitted)

    p64, q64 = p.astype(np.float64), q.astype(np.float64)
    for r in range(b):
        out = []
        for i in range(gamma + 1):
            if i == gamma:
                stop = p64[r, i]
            else:
                x = drafts[r, i]
                if uniforms[r, i] < min(1.0, p64[r, i, x] / q64[r, i, x]):
                    out.append(x)
                    continue
                stop = np.maximum(p64[r, i] - q64[r, i], 0.0)
                stop = stop / stop.sum() if stop.sum() > 0 else p64[r, i]
            out.append(int(np.argmax(_log(stop) + gumbel[r])))
            break
        assert num_emitted[r] == len(out)
        assert tokens[r].tolist() == out + [PAD_TOKEN] * (gamma + 1 - len(out))
    assert set(num_emitted.tolist()) == set(range(1, gamma + 2))  # every outcome exercised


# ---------------------------------------------------------------------------------------------
# Exactness by sampling: temperature 0.7, top-p 0.9, V = 32, γ = 4, 100k cycles per pair.
# ---------------------------------------------------------------------------------------------

NUM_SAMPLES = 100_000
NUM_PAIRS = 5
SAMPLE_V, SAMPLE_GAMMA = 32, 4
# Family-wise significance 1e-3 over NUM_PAIRS * (γ+1) chi-square tests (Bonferroni).
CHI2_THRESHOLD = 1e-3 / (NUM_PAIRS * (SAMPLE_GAMMA + 1))
# |z| bound for the mean of num_emitted: two-sided p = 6.3e-5 per pair, 3.2e-4 over 5 pairs.
Z_MEAN = 4.0
# |z| bound for each per-position α estimate: two-sided p = 6.8e-6, 1.4e-4 over 20 positions.
Z_ALPHA = 4.5


def _process(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Temperature then top-p (keep the smallest top set with mass >= top_p), float64."""
    z = logits / temperature
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1)
    sorted_p = np.take_along_axis(probs, order, -1)
    mass_before = np.cumsum(sorted_p, -1) - sorted_p  # keep a token while the mass above < top_p
    keep = np.zeros_like(probs, bool)
    np.put_along_axis(keep, order, mass_before < top_p, -1)
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum(-1, keepdims=True)


def _sample_pair(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    target_logits = 2.0 * rng.standard_normal((SAMPLE_GAMMA + 1, SAMPLE_V))
    draft_logits = target_logits[:SAMPLE_GAMMA] + rng.standard_normal((SAMPLE_GAMMA, SAMPLE_V))
    p = _process(target_logits, 0.7, 0.9).astype(np.float32)  # [γ+1, V]
    q = _process(draft_logits, 0.7, 0.9).astype(np.float32)  # [γ, V]
    return p, q


def _draft(key, q):
    return jax.random.categorical(key, jnp.log(q)).astype(jnp.int32)  # [γ]


@jax.jit
def _run_rejection(keys, p, q):
    def one(key):
        k_draft, k_accept = jax.random.split(key)
        x = _draft(k_draft, q)
        tokens, n = rejection_sample(k_accept, p[None], q[None], x[None])
        return tokens[0], n[0]

    return jax.vmap(one)(keys)  # [N, γ+1], [N]


@jax.jit
def _run_always_accept(keys, p, q):
    """Negative control: commits every drafted token, then a bonus from p_γ."""

    def one(key):
        k_draft, k_bonus = jax.random.split(key)
        bonus = jax.random.categorical(k_bonus, jnp.log(p[-1]))
        return jnp.append(_draft(k_draft, q), bonus.astype(jnp.int32)), jnp.int32(q.shape[0] + 1)

    return jax.vmap(one)(keys)


@jax.jit
def _run_resample_from_p(keys, p, q):
    """Negative control: the right acceptance test, but a rejection resamples from p itself."""

    def one(key):
        k_draft, k_u, k_g = jax.random.split(key, 3)
        x = _draft(k_draft, q)
        u = jax.random.uniform(k_u, x.shape)
        accept = (u < acceptance_probs(p[None], q[None], x[None])[0]).astype(jnp.int32)
        n = jnp.sum(jnp.cumprod(accept))
        last = jax.random.categorical(k_g, jnp.log(p[n])).astype(jnp.int32)
        committed = jnp.where(jnp.arange(x.shape[0] + 1) == n, last, jnp.append(x, 0))
        return jnp.where(jnp.arange(x.shape[0] + 1) <= n, committed, PAD_TOKEN), n + 1

    return jax.vmap(one)(keys)


def _chi2_pvalues(tokens: np.ndarray, num_emitted: np.ndarray, p: np.ndarray) -> list[float]:
    """Per position j: p-value of tokens[:, j] ~ p_j among the cycles that reached j.

    Bins with expected count < 5 are pooled; a token of probability zero that occurs gives
    p-value 0 (an impossible event is not a fluctuation).
    """
    pvalues = []
    for j in range(p.shape[0]):
        reached = num_emitted > j
        counts = np.bincount(tokens[reached, j], minlength=p.shape[1]).astype(np.float64)
        expected = reached.sum() * p[j].astype(np.float64)
        if np.any(counts[expected == 0] > 0):
            pvalues.append(0.0)
            continue
        big = expected >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        obs, exp = obs[exp > 0], exp[exp > 0]
        stat = np.sum((obs - exp) ** 2 / exp)
        pvalues.append(float(chi2.sf(stat, len(obs) - 1)))
    return pvalues


def _reach_probs(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    alpha = np.minimum(p[:-1], q).astype(np.float64).sum(-1)  # [γ]
    return alpha, np.concatenate([[1.0], np.cumprod(alpha)])  # [γ], [γ+1] P(n > j)


def test_exact_by_sampling():
    control_pvalues = {"always_accept": [], "resample_from_p": []}
    for pair in range(NUM_PAIRS):
        p, q = _sample_pair(pair)
        keys = jax.random.split(jax.random.key(pair), NUM_SAMPLES)
        tokens, n = (np.asarray(a) for a in _run_rejection(keys, p, q))

        # Committed slots, then padding.
        slot = np.arange(SAMPLE_GAMMA + 1)[None, :]
        assert np.all((tokens >= 0) == (slot < n[:, None]))
        assert np.all(tokens[slot >= n[:, None]] == PAD_TOKEN)
        # Each committed token follows p_j among the cycles that reached j.
        pvalues = _chi2_pvalues(tokens, n, p)
        assert min(pvalues) > CHI2_THRESHOLD, (pair, pvalues)

        # Mean tokens per cycle: 1 + Σ_j Π_{i≤j} α_i, within Z_MEAN standard errors.
        alpha, reach = _reach_probs(p, q)
        law = reach - np.append(reach[1:], 0.0)  # P(n = k+1)
        k = np.arange(1, SAMPLE_GAMMA + 2)
        mean, var = np.sum(k * law), np.sum(k**2 * law) - np.sum(k * law) ** 2
        assert abs(mean - (1.0 + np.sum(np.cumprod(alpha)))) < 1e-12
        z = (n.mean() - mean) / np.sqrt(var / NUM_SAMPLES)
        assert abs(z) < Z_MEAN, (pair, n.mean(), mean, z)

        # Per-position α recovered from the cycle log (binomial standard error).
        alpha_hat = estimate_alpha(n - 1, SAMPLE_GAMMA)
        reached = np.array([(n - 1 >= i).sum() for i in range(SAMPLE_GAMMA)])
        z_alpha = (alpha_hat - alpha) / np.sqrt(alpha * (1 - alpha) / reached)
        assert np.all(np.abs(z_alpha) < Z_ALPHA), (pair, alpha_hat, alpha)

        # Negative controls: the same test must reject both broken samplers.
        ctl_tokens, ctl_n = (np.asarray(a) for a in _run_always_accept(keys, p, q))
        control_pvalues["always_accept"].append(min(_chi2_pvalues(ctl_tokens, ctl_n, p)))
        assert abs((ctl_n.mean() - mean) / np.sqrt(var / NUM_SAMPLES)) > Z_MEAN
        ctl_tokens, ctl_n = (np.asarray(a) for a in _run_resample_from_p(keys, p, q))
        control_pvalues["resample_from_p"].append(min(_chi2_pvalues(ctl_tokens, ctl_n, p)))
    for name, pvalues in control_pvalues.items():
        assert max(pvalues) < CHI2_THRESHOLD, (name, pvalues)


# ---------------------------------------------------------------------------------------------
# Edge cases: draft = target, zero mass, batch independence, validation.
# ---------------------------------------------------------------------------------------------


def test_draft_equals_target_accepts_everything():
    rng = np.random.default_rng(11)
    b, gamma, v = 512, 4, 8
    p = _random_dist(rng, (b, gamma + 1, v), 0.4)
    q = p[:, :gamma].copy()
    drafts = jax.random.categorical(jax.random.key(0), jnp.log(q)).astype(jnp.int32)  # [B, γ]
    acc = np.asarray(acceptance_probs(p, q, drafts))
    assert np.all(acc == 1.0)
    corr = np.asarray(correction_probs(p, q))
    assert np.all(np.isfinite(corr))
    np.testing.assert_array_equal(corr[:, :gamma], p[:, :gamma])  # empty residual falls back to p
    np.testing.assert_allclose(np.asarray(expected_acceptance(p, q)), 1.0, rtol=0, atol=1e-6)
    tokens, n = (np.asarray(a) for a in rejection_sample(jax.random.key(1), p, q, drafts))
    assert np.all(n == gamma + 1)
    np.testing.assert_array_equal(tokens[:, :gamma], np.asarray(drafts))
    assert np.all(np.take_along_axis(p[:, gamma], tokens[:, gamma : gamma + 1], -1) > 0)


def test_zero_mass_edge_cases_do_not_nan():
    v = 4
    # Row 0: q(x) = 0 where p(x) > 0 (drafted anyway) -> accepted.
    # Row 1: p(x) = 0 where q(x) > 0 -> always rejected, correction from p's support.
    # Row 2: q(x) = p(x) = 0 (drafted anyway) -> rejected, no NaN.
    # Row 3: p <= q everywhere through rounding (residual empty) and a forced rejection.
    p = np.array(
        [
            [[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]],
            [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]],
            [[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]],
            [[0.4999999, 0.4999999, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]],
        ],
        np.float32,
    )  # [B=4, γ+1=2, V]
    q = np.array(
        [
            [[0.0, 0.0, 1.0, 0.0]],
            [[1.0, 0.0, 0.0, 0.0]],
            [[0.0, 0.0, 0.0, 1.0]],
            [[0.5, 0.5, 0.0, 0.0]],
        ],
        np.float32,
    )
    drafts = np.array([[0], [0], [0], [1]], np.int32)
    acc = np.asarray(acceptance_probs(p, q, drafts))
    np.testing.assert_array_equal(acc[:3, 0], [1.0, 0.0, 0.0])
    assert 0.999 < acc[3, 0] < 1.0
    corr = np.asarray(correction_probs(p, q))
    assert np.all(np.isfinite(corr))
    np.testing.assert_array_equal(corr[3, 0], p[3, 0])  # empty residual falls back to p
    uniforms = np.array([[0.5], [0.0], [0.0], [0.9999999]], np.float32)  # row 3 rejected
    for seed in range(8):
        gumbel = np.asarray(jax.random.gumbel(jax.random.key(seed), (4, v)))
        tokens, n = (
            np.asarray(a) for a in rejection_sample_with_noise(p, q, drafts, uniforms, gumbel)
        )
        np.testing.assert_array_equal(n, [2, 1, 1, 1])
        assert tokens[0, 0] == 0 and p[0, 1, tokens[0, 1]] > 0
        assert tokens[1, 0] == 1 and tokens[2, 0] in (1, 2) and tokens[3, 0] in (0, 1)
        assert np.all(tokens[1:, 1] == PAD_TOKEN)
    # The randomly keyed path on the same inputs stays finite and within the supports.
    tokens, n = rejection_sample(jax.random.key(0), p, q, drafts)
    assert np.all(np.asarray(tokens)[:, 0] >= 0) and np.all(np.asarray(n) >= 1)


def test_per_sequence_keys_make_rows_independent_of_the_batch():
    rng = np.random.default_rng(3)
    b, gamma, v = 6, 3, 8
    p, q = _random_dist(rng, (b, gamma + 1, v), 0.2), _random_dist(rng, (b, gamma, v), 0.2)
    drafts = jax.random.categorical(jax.random.key(5), jnp.log(q)).astype(jnp.int32)
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 17))(jnp.arange(b))
    full_tokens, full_n = rejection_sample(keys, p, q, drafts)
    half_tokens, half_n = rejection_sample(keys[:3], p[:3], q[:3], drafts[:3])
    np.testing.assert_array_equal(np.asarray(full_tokens)[:3], np.asarray(half_tokens))
    np.testing.assert_array_equal(np.asarray(full_n)[:3], np.asarray(half_n))
    # Raw uint32 key data is the same key as its typed wrapper.
    raw_tokens, _ = rejection_sample(jax.random.key_data(keys), p, q, drafts)
    np.testing.assert_array_equal(np.asarray(raw_tokens), np.asarray(full_tokens))


def test_validation_names_the_bad_value():
    p, q = np.full((2, 4, 8), 1 / 8, np.float32), np.full((2, 3, 8), 1 / 8, np.float32)
    drafts = np.zeros((2, 3), np.int32)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"draft_tokens must have shape \[B, γ\] = \(2, 3\)"):
        rejection_sample(key, p, q, drafts[:, :2])
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[B, γ, V\]"):
        rejection_sample(key, p, q[:, :, :4], drafts)
    with pytest.raises(ValueError, match=r"integer array, got dtype float32"):
        rejection_sample(key, p, q, drafts.astype(np.float32))
    with pytest.raises(ValueError, match=r"one key per sequence \[B\] = \(2,\), got shape \(3,\)"):
        rejection_sample(jax.random.split(key, 3), p, q, drafts)
    with pytest.raises(ValueError, match=r"gumbel must have shape \[B, V\]"):
        rejection_sample_with_noise(p, q, drafts, np.zeros((2, 3)), np.zeros((2, 7)))
    with pytest.raises(ValueError, match=r"gumbel must have the shape of target_logprobs"):
        coupled_accept(np.log(p), drafts, np.zeros((2, 3, 8)))
    with pytest.raises(ValueError, match=r"γ\+1 >= 2"):
        greedy_accept(p[:, :1], np.zeros((2, 0), np.int32))


# ---------------------------------------------------------------------------------------------
# Greedy and coupled acceptance against plain loops.
# ---------------------------------------------------------------------------------------------


def _reference_accept(choice: np.ndarray, drafts: np.ndarray) -> tuple[list, list]:
    """Plain loop: commit the target's choice while the draft agrees, then one more."""
    tokens, nums = [], []
    gamma = drafts.shape[1]
    for r in range(drafts.shape[0]):
        out = []
        for j in range(gamma + 1):
            out.append(int(choice[r, j]))
            if j == gamma or drafts[r, j] != choice[r, j]:
                break
        nums.append(len(out))
        tokens.append(out + [PAD_TOKEN] * (gamma + 1 - len(out)))
    return tokens, nums


def _drafts_with_mismatch(rng, choice: np.ndarray, v: int) -> np.ndarray:
    """Drafts that agree with `choice` up to a random position per row (or everywhere)."""
    b, g1 = choice.shape
    drafts = choice[:, : g1 - 1].copy()
    first_bad = rng.integers(0, g1, size=b)  # γ means: all agree
    for r in range(b):
        for j in range(first_bad[r], g1 - 1):
            drafts[r, j] = (
                (choice[r, j] + rng.integers(1, v)) % v if j == first_bad[r] else rng.integers(v)
            )
    return drafts.astype(np.int32)


def test_greedy_accept_matches_argmax_loop():
    rng = np.random.default_rng(21)
    b, gamma, v = 64, 4, 16
    logits = rng.standard_normal((b, gamma + 1, v)).astype(np.float32)
    drafts = _drafts_with_mismatch(rng, logits.argmax(-1), v)
    tokens, n = greedy_accept(logits, drafts)
    ref_tokens, ref_n = _reference_accept(logits.argmax(-1), drafts)
    assert np.asarray(tokens).tolist() == ref_tokens
    assert np.asarray(n).tolist() == ref_n
    assert set(ref_n) == set(range(1, gamma + 2))


def _gumbel(seeds: np.ndarray, positions: np.ndarray, v: int) -> np.ndarray:
    """Per-request noise, gumbel(fold_in(key(seed), position)): `[B, P, V]`."""

    def row(seed, pos):
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), pos), (v,))

    return np.asarray(jax.vmap(jax.vmap(row, (None, 0)), (0, 0))(seeds, positions))


def test_coupled_accept_matches_gumbel_max_loop():
    rng = np.random.default_rng(22)
    b, gamma, v = 64, 4, 16
    logp = _log(_random_dist(rng, (b, gamma + 1, v), 0.2))  # -inf on zero-mass tokens
    seeds = rng.integers(0, 2**31, size=b)
    noise = _gumbel(seeds, rng.integers(0, 1000, size=b)[:, None] + np.arange(gamma + 1), v)
    plain = np.argmax(logp + noise, -1)  # the target's own Gumbel-max samples [B, γ+1]
    drafts = _drafts_with_mismatch(rng, plain, v)
    tokens, n = coupled_accept(logp, drafts, noise)
    ref_tokens, ref_n = _reference_accept(plain, drafts)
    assert np.asarray(tokens).tolist() == ref_tokens
    assert np.asarray(n).tolist() == ref_n
    assert set(ref_n) == set(range(1, gamma + 2))


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_multi_cycle_stream_equals_plain_decoding(mode):
    """Cycles of draft + accept reproduce plain decoding of the target, token for token.

    Target and draft distributions depend on the absolute position (a table per sequence); the
    drafter is greedy / Gumbel-max on q with the same per-position noise as the target.
    """
    rng = np.random.default_rng(23 if mode == "greedy" else 24)
    b, gamma, v, length = 8, 3, 8, 24
    width = length + gamma + 1  # positions a cycle may look at
    logp = _log(_random_dist(rng, (b, width, v), 0.2))
    logq = _log(_random_dist(rng, (b, width, v), 0.2)) + 3.0 * np.exp(logp)  # correlated
    seeds = rng.integers(0, 2**31, size=b)
    noise = _gumbel(seeds, np.broadcast_to(np.arange(width), (b, width)), v)
    if mode == "greedy":
        noise = np.zeros_like(noise)
    plain = np.argmax(logp + noise, -1)[:, :length]  # plain decoding [B, length]

    streams = [[] for _ in range(b)]
    pos = np.zeros(b, np.int64)
    rows = np.arange(b)[:, None]
    cycles = 0
    while np.any(pos < length):
        window = pos[:, None] + np.arange(gamma + 1)  # [B, γ+1]
        drafts = np.argmax(logq[rows, window[:, :gamma]] + noise[rows, window[:, :gamma]], -1)
        if mode == "greedy":
            tokens, n = greedy_accept(logp[rows, window], drafts.astype(np.int32))
        else:
            tokens, n = coupled_accept(
                logp[rows, window], drafts.astype(np.int32), noise[rows, window]
            )
        tokens, n = np.asarray(tokens), np.asarray(n)
        for r in range(b):
            streams[r].extend(tokens[r, : n[r]].tolist())
        pos = np.minimum(pos + n, length)
        cycles += 1
    for r in range(b):
        assert streams[r][:length] == plain[r].tolist()
    assert cycles < length  # some drafts were accepted: the loop did speculate
