"""GPTQ against a plain float64 numpy Algorithm 1, and against RTN on correlated inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import qtensor as formats
from jaxinfer.ops.linear import linear
from jaxinfer.quant.gptq import gptq_quantize, hessian
from jaxinfer.quant.rtn import rtn_quantize

N_IN, N_OUT, TOKENS = 128, 32, 512  # one shape for every test: GPTQ compiles per shape


def np_grid(w, bits, sym):
    """The documented min-max grid of one group `w [G, m]`, float64 (scales rounded to f32)."""
    maxq = 2**bits - 1
    wmin, wmax = np.minimum(w.min(0), 0.0), np.maximum(w.max(0), 0.0)
    if sym:
        half = 2 ** (bits - 1)
        scale = np.maximum(-wmin, wmax) / (half - 1)
        zero = np.full(scale.shape, float(half))
    else:
        scale = (wmax - wmin) / maxq
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32).astype(np.float64)
    if not sym:
        zero = np.clip(np.round(-wmin / scale), 0, maxq)
    return scale, zero


def np_gptq(w, H, *, bits, group, sym=False, damp=0.01, act_order=False, static_groups=True):
    """Algorithm 1 of Frantar et al., one input row (the paper's column) at a time, float64.

    Returns the codes in stored order (original order, or sweep order for dynamic act-order
    groups) and the permutation.
    """
    W, H = w.astype(np.float64).copy(), H.astype(np.float64).copy()
    n = W.shape[0]
    maxq = 2**bits - 1
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(n)
    fixed = group == n or (act_order and static_groups)
    grids = [np_grid(W[g * group : (g + 1) * group], bits, sym) for g in range(n // group)]
    W, H = W[perm], H[perm][:, perm]
    H += damp * np.mean(np.diag(H)) * np.eye(n)
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # upper: H^-1 = U^T U
    Q = np.zeros(W.shape, np.int64)
    for i in range(n):
        if fixed:
            s, z = grids[perm[i] // group]
        elif i % group == 0:
            s, z = np_grid(W[i : i + group], bits, sym)
        q = np.clip(np.round(W[i] / s) + z, 0, maxq)
        e = (W[i] - (q - z) * s) / U[i, i]
        W[i:] -= np.outer(U[i, i:], e)
        Q[i] = q
    if fixed:
        out = np.zeros_like(Q)
        out[perm] = Q
        return out, None
    return Q, (perm if act_order else None)


def correlated_layer(seed, outliers=False):
    """A random weight and inputs with correlated channels of very different scales."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(N_IN, N_IN)) / np.sqrt(N_IN)
    x = rng.normal(size=(TOKENS, N_IN)) @ mix + 0.2 * rng.normal(size=(TOKENS, N_IN))
    x *= np.exp(rng.normal(size=N_IN))
    if outliers:
        x[:, rng.choice(N_IN, 4, replace=False)] *= 20
    w = rng.normal(size=(N_IN, N_OUT))
    return w.astype(np.float32), x.astype(np.float32)


def out_err(x, w, w_hat):
    return float(np.sum((x @ w - x @ np.asarray(w_hat, np.float64)) ** 2))


CASES = [  # bits, group, sym, act_order, static_groups
    (4, 32, False, False, True),
    (3, 64, True, True, True),
    (4, 32, False, True, False),
    (2, None, False, False, True),
]


@pytest.mark.parametrize("bits, group, sym, act_order, static_groups", CASES)
def test_codes_match_float64_algorithm1(bits, group, sym, act_order, static_groups):
    w, x = correlated_layer(seed=bits)
    H = hessian(jnp.asarray(x))
    qw, rel = gptq_quantize(
        jnp.asarray(w), H, bits=bits, group_size=group, sym=sym, act_order=act_order,
        static_groups=static_groups, blocksize=64,
    )  # fmt: skip
    g = N_IN if group is None else group
    ref, ref_perm = np_gptq(
        w, np.asarray(H), bits=bits, group=g, sym=sym, act_order=act_order,
        static_groups=static_groups,
    )  # fmt: skip
    q = np.asarray(formats.unpack_int4(qw.packed))
    if ref_perm is None:
        assert qw.perm is None
    else:
        np.testing.assert_array_equal(np.asarray(qw.perm), ref_perm)
    agree = np.mean(q == ref)
    assert agree >= 0.999, f"only {agree:.4%} of codes agree"
    assert np.abs(q - ref).max() <= 1  # the rest are rounding ties
    # The reported error is the relative output error on the calibration inputs.
    deq = np.asarray(formats.dequantize(qw), np.float64)
    expected = out_err(x, w, deq) / float(np.sum((x @ w.astype(np.float64)) ** 2))
    assert float(rel) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("seed", range(4))
def test_gptq_output_error_le_rtn(seed):
    w, x = correlated_layer(seed=10 + seed, outliers=seed % 2 == 1)
    H = hessian(jnp.asarray(x))
    for bits, group, sym, act_order, static_groups in CASES:
        qw, _ = gptq_quantize(
            jnp.asarray(w), H, bits=bits, group_size=group, sym=sym, act_order=act_order,
            static_groups=static_groups, blocksize=64,
        )  # fmt: skip
        rtn = rtn_quantize(jnp.asarray(w), bits=bits, group_size=group, sym=sym)
        e_gptq = out_err(x, w, formats.dequantize(qw))
        e_rtn = out_err(x, w, formats.dequantize(rtn))
        assert e_gptq <= e_rtn, (bits, group, act_order, e_gptq, e_rtn)


def test_act_order_perm_is_consistent_with_linear():
    w, x = correlated_layer(seed=3)
    qw, _ = gptq_quantize(
        jnp.asarray(w), hessian(jnp.asarray(x)), bits=4, group_size=32, act_order=True,
        static_groups=False, blocksize=64,
    )  # fmt: skip
    assert qw.perm is not None and sorted(np.asarray(qw.perm)) == list(range(N_IN))
    y = linear(jnp.asarray(x), qw)  # gathers x by perm
    np.testing.assert_allclose(
        np.asarray(y), x @ np.asarray(formats.dequantize(qw)), rtol=1e-4, atol=1e-3
    )


def test_dead_inputs_keep_their_weights():
    w, x = correlated_layer(seed=4)
    x[:, :8] = 0.0  # inputs that never fire
    qw, _ = gptq_quantize(jnp.asarray(w), hessian(jnp.asarray(x)), bits=4, group_size=32,
                          blocksize=64)  # fmt: skip
    rtn = rtn_quantize(jnp.asarray(w), bits=4, group_size=32)
    # The first group's grid comes from the untouched weights: rows 0..7 round like RTN.
    np.testing.assert_array_equal(
        np.asarray(formats.dequantize(qw))[:8], np.asarray(formats.dequantize(rtn))[:8]
    )


def test_singular_hessian_names_the_layer():
    w, x = correlated_layer(seed=5)
    x[:, 1] = x[:, 0]  # duplicated channel: H is singular
    x[:, 7] = -2 * x[:, 3]
    H = hessian(jnp.asarray(x))
    with pytest.raises(ValueError, match="layer 3 w_down.*singular after dampening"):
        gptq_quantize(jnp.asarray(w), H, damp=0.0, group_size=32, blocksize=64,
                      name="layer 3 w_down")  # fmt: skip
    # Negative control: the default dampening makes the same Hessian usable.
    qw, rel = gptq_quantize(jnp.asarray(w), H, group_size=32, blocksize=64, name="layer 3")
    assert np.isfinite(float(rel)) and float(rel) < 0.05


def test_bad_inputs_raise():
    w, x = correlated_layer(seed=6)
    H = hessian(jnp.asarray(x))
    with pytest.raises(ValueError, match="group_size=48"):
        gptq_quantize(jnp.asarray(w), H, group_size=48)
    with pytest.raises(ValueError, match="bits=8"):
        gptq_quantize(jnp.asarray(w), H, bits=8)
    with pytest.raises(ValueError, match="expected w \\[in, out\\]"):
        gptq_quantize(jnp.asarray(w), H[:64, :64])
    with pytest.raises(ValueError, match="NaN or Inf"):
        gptq_quantize(jnp.asarray(w), H.at[0, 0].set(jnp.nan))
    x[3, 5] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        hessian(jnp.asarray(x))
    with pytest.raises(ValueError, match="empty"):
        hessian(jnp.zeros((0, N_IN)))
