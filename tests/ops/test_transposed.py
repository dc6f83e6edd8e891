"""`TransposedDense` (the CPU layout's dense weight) applies as `x @ w` on every path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import transposed
from jaxinfer.ops.linear import linear
from jaxinfer.transposed import REDUCE_MAX_ROWS, TransposedDense, transpose_dense


@pytest.mark.parametrize("rows", [1, 2, 5, REDUCE_MAX_ROWS, REDUCE_MAX_ROWS + 1, 200])
def test_linear_equals_the_dense_product(rows):
    """Below, inside and above the rows the multiply-and-sum path takes."""
    rng = np.random.RandomState(rows)
    w = rng.randn(96, 80).astype(np.float32)  # [in, out]
    x = rng.randn(rows, 96).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), transpose_dense(jnp.asarray(w))))
    assert got.shape == (rows, 80) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_kept_dense_form_gives_the_same_product(rows):
    """With `w` kept (the head), one row takes `x @ w`, more rows the transposed form."""
    rng = np.random.RandomState(9)
    w = jnp.asarray(rng.randn(64, 50).astype(np.float32))
    x = jnp.asarray(rng.randn(rows, 64).astype(np.float32))
    kept = transpose_dense(w, keep=True)
    assert kept.w is w
    np.testing.assert_allclose(
        np.asarray(linear(x, kept)), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-4
    )
    bad = TransposedDense(kept.wt, jnp.zeros_like(w))  # tells which operand each path reads
    got = np.asarray(linear(x, bad))
    assert (np.abs(got).max() == 0) == (rows == 1)


def test_leading_axes_bias_and_bfloat16():
    rng = np.random.RandomState(0)
    w = jnp.asarray(rng.randn(48, 40).astype(np.float32))
    b = jnp.asarray(rng.randn(40).astype(np.float32))
    x = jnp.asarray(rng.randn(2, 3, 48).astype(np.float32))  # [B, S, in]: 6 rows
    got = linear(x, transpose_dense(w), b)
    np.testing.assert_allclose(np.asarray(got), np.asarray(linear(x, w, b)), rtol=1e-5, atol=1e-5)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)  # takes the dot_general path
    got = linear(xb, transpose_dense(wb))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(linear(xb, wb), np.float32), rtol=2e-2, atol=2e-2
    )


def test_the_sum_reads_one_weight_pass_per_projection():
    """Sibling projections of one activation (q/k/v, gate/up) must not share, and so
    materialise, the activation's broadcast to `[out, M, in]`: the barrier keeps each sum its
    own fusion over the weight. Without it XLA's CSE makes one broadcast buffer per shape."""

    def two(x, a, b):
        return linear(x, a) + linear(x, b)

    a = TransposedDense(jnp.ones((256, 64)))
    b = TransposedDense(jnp.ones((256, 64)))
    hlo = jax.jit(two).lower(jnp.ones((4, 64)), a, b).compile().as_text()
    assert "f32[256,4,64]" not in hlo.replace("{2,1,0}", "").split("ENTRY")[1]


def test_shape_dtype_and_bad_input():
    w = transpose_dense(jnp.ones((12, 7)))
    assert w.shape == (12, 7) and w.wt.shape == (7, 12) and w.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(w.dense()), np.ones((12, 7)))
    assert jax.tree.leaves(w)[0] is w.wt  # a pytree: jit, tree maps and sharding see the array
    with pytest.raises(ValueError, match="2-D"):
        transpose_dense(jnp.ones((2, 3, 4)))
    with pytest.raises(ValueError, match=r"x \[\.\.\., 5\]"):
        transposed.apply(jnp.ones((3, 5)), w)


@pytest.mark.parametrize("out", [80, 50])
def test_two_to_sixteen_rows_take_the_blocked_product_where_out_divides(out):
    """`out` divisible by ROW_BLOCKS: a batched dot over the blocks, no multiply-and-sum;
    otherwise the sum. Both equal the float64 product."""
    rng = np.random.RandomState(out)
    w = rng.randn(96, out).astype(np.float32)
    x = rng.randn(5, 96).astype(np.float32)
    fn = jax.jit(linear)
    td = transpose_dense(jnp.asarray(w))
    hlo = fn.lower(jnp.asarray(x), td).as_text()
    blocked = out % transposed.ROW_BLOCKS == 0
    assert ("dot_general" in hlo) == blocked and ("reduce" in hlo) != blocked
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(fn(jnp.asarray(x), td)), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [2, 4, 5, 7, 8, 9, 13, 16])
def test_the_blocked_product_pads_rows_above_four_to_a_multiple_of_eight(rows):
    """5-7 rows are computed as 8 and 9-15 as 16 (zero rows appended), 2-4 and multiples of 8
    as they come; the padding never reaches the result, which equals the float64 product."""
    rng = np.random.RandomState(rows)
    w = rng.randn(64, 40).astype(np.float32)
    x = rng.randn(rows, 64).astype(np.float32)
    td = transpose_dense(jnp.asarray(w))
    fn = jax.jit(linear)
    hlo = fn.lower(jnp.asarray(x), td).as_text()
    step = transposed.PAD_ROWS
    padded = -(-rows // step) * step if rows > transposed.PAD_ABOVE else rows
    assert (f"tensor<{padded}x64xf32>" in hlo) and (("pad" in hlo) == (padded != rows))
    got = np.asarray(fn(jnp.asarray(x), td))
    assert got.shape == (rows, 40)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
