"""`jaxinfer.ops.argmax` equals `jnp.argmax`: ties, NaN, infinities, any axis, any dtype."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.ops.argmax import argmax


@st.composite
def _arrays(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    # Few distinct values, so ties are common; NaN and infinities mixed in.
    pool = draw(st.sampled_from([[0.0, 1.0, -1.0], [np.inf, -np.inf, 2.0], [np.nan, 3.0, 1.0]]))
    seed = draw(st.integers(0, 2**31 - 1))
    x = np.random.RandomState(seed).choice(np.asarray(pool, np.float32), size=shape)
    return x, axis


@settings(max_examples=100, deadline=None)  # each example compiles its shape: 300 took 41 s
@given(_arrays())
def test_matches_jnp_argmax(case):
    x, axis = case
    got = np.asarray(argmax(jnp.asarray(x), axis))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis)))
    np.testing.assert_array_equal(got, np.argmax(x, axis))  # numpy: first NaN wins too
    assert got.dtype == np.int32


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int32, jnp.bool_])
def test_other_dtypes(dtype):
    x = np.random.RandomState(0).randint(0, 3, (5, 4096)).astype(np.float32)
    x = jnp.asarray(x).astype(dtype)
    np.testing.assert_array_equal(argmax(x), jnp.argmax(x, axis=-1))


def test_vocabulary_rows_with_a_single_nan():
    x = np.random.RandomState(1).randn(8, 4096).astype(np.float32)
    x[3, 4000] = np.nan
    np.testing.assert_array_equal(argmax(jnp.asarray(x)), np.argmax(x, -1))
    assert int(argmax(jnp.asarray(x))[3]) == 4000


def test_empty_axis_raises():
    with pytest.raises(ValueError, match="empty axis"):
        argmax(jnp.zeros((3, 0)))
