"""RTN: the min-max grids (symmetric and asymmetric) and their rounding error bound."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import qtensor as formats
from jaxinfer.quant.rtn import group_params, quantize_int8, rtn_quantize


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("sym", [False, True])
def test_rtn_error_within_half_a_step(bits, sym):
    rng = np.random.default_rng(bits)
    w = rng.normal(size=(64, 16)).astype(np.float32)
    qw = rtn_quantize(jnp.asarray(w), bits=bits, group_size=16, sym=sym)
    q = np.asarray(formats.unpack_int4(qw.packed))
    assert q.min() >= 0 and q.max() <= 2**bits - 1
    step = np.repeat(np.asarray(qw.scales), 16, axis=0)
    err = np.abs(np.asarray(formats.dequantize(qw)) - w)
    assert np.all(err <= step / 2 + 1e-6)  # no clipping: the grid covers each group's range


def test_asymmetric_grid_hits_min_and_max():
    w = np.array([[-1.0], [-0.25], [0.5], [2.0]] * 2, np.float32)  # one group of 8, one column
    qw = rtn_quantize(jnp.asarray(w), bits=4, group_size=8)
    scale, zero = float(qw.scales[0, 0]), int(qw.zeros[0, 0])
    assert scale == pytest.approx(3.0 / 15)  # (max - min) / (2**4 - 1)
    assert zero == round(1.0 / scale)
    deq = np.asarray(formats.dequantize(qw))
    assert deq.min() == pytest.approx(-1.0, abs=scale / 2) and deq.max() == pytest.approx(2.0)


def test_symmetric_grid_represents_absmax_exactly():
    w = np.array([[-3.0], [1.0], [0.5], [2.0]] * 2, np.float32)
    qw = rtn_quantize(jnp.asarray(w), bits=4, group_size=8, sym=True)
    assert int(qw.zeros[0, 0]) == 8
    assert float(qw.scales[0, 0]) == pytest.approx(3.0 / 7)
    assert float(formats.dequantize(qw).min()) == pytest.approx(-3.0)


def test_all_zero_group_dequantizes_to_zero():
    qw = rtn_quantize(jnp.zeros((16, 3)), bits=4, group_size=8)
    np.testing.assert_array_equal(np.asarray(formats.dequantize(qw)), 0.0)


def test_per_channel_and_scale_dtype():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(32, 4)), jnp.bfloat16)
    qw = rtn_quantize(w, bits=4, group_size=None)
    assert qw.group_size == 32 and qw.scales.shape == (1, 4) and qw.scales.dtype == jnp.bfloat16
    # Codes are chosen for the bf16-rounded scales that are stored.
    s, z = group_params(w.astype(jnp.float32), bits=4, sym=False, scale_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(qw.scales[0], np.float32))


def test_clip_shrinks_the_range():
    w = jnp.asarray(np.linspace(-1, 1, 16, dtype=np.float32)[:, None])
    full = rtn_quantize(w, bits=4, group_size=16)
    half = rtn_quantize(w, bits=4, group_size=16, clip=jnp.full((1, 1), 0.5))
    assert float(half.scales[0, 0]) == pytest.approx(float(full.scales[0, 0]) / 2)
    step = float(half.scales[0, 0])
    assert float(jnp.abs(formats.dequantize(half)).max()) <= 0.5 + step / 2 + 1e-6


def test_int8_per_channel():
    w = np.random.default_rng(1).normal(size=(16, 5)).astype(np.float32)
    w8 = quantize_int8(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(w8.scales), np.abs(w).max(0) / 127, rtol=1e-6)
    assert np.asarray(w8.q).dtype == np.int8 and np.abs(np.asarray(w8.q)).max() == 127
