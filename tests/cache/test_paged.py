"""init_cache: shapes per format, and bad sizes named in the error."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji

CFG = ji.preset("tiny-llama")


@pytest.mark.parametrize("kv_format, dtype", [("float", None), ("int8", jnp.int8)])
def test_shapes(kv_format, dtype):
    cache = ji.init_cache(CFG, 5, 8, kv_format=kv_format)
    shape = (CFG.num_layers, 5, CFG.num_kv_heads, 8, CFG.head_dim)
    chex.assert_shape([cache.k, cache.v], shape)
    chex.assert_type([cache.k, cache.v], dtype or jnp.dtype(CFG.dtype))
    if kv_format == "int8":
        chex.assert_shape([cache.k_scale, cache.v_scale], shape[:-1])


@pytest.mark.parametrize(
    "num_blocks, block_size, match",
    [
        (1, 16, "num_blocks=1 is invalid: need >= 2"),
        (4, 0, "block_size=0 is invalid"),
        (4, True, "block_size=True is invalid"),
        (4, 8.0, "block_size=8.0 is invalid"),
    ],
)
def test_bad_sizes_raise(num_blocks, block_size, match):
    with pytest.raises(ValueError, match=match):
        ji.init_cache(CFG, num_blocks, block_size)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8, jnp.float32])
def test_take_and_scatter_equal_plain_indexing_bit_for_bit(dtype):
    """float8 pools are indexed through a uint8 view on a CPU (see take_pages): same bytes."""
    from jaxinfer.cache.paged import _scatter, take_pages

    rng = np.random.RandomState(0)
    shape = (2, 6, 3, 4, 8)
    bits = rng.randint(0, 256, shape).astype(np.uint8)  # every float8 pattern, NaNs included
    if jnp.dtype(dtype).itemsize == 1:
        pages = jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype)
    else:
        pages = jnp.asarray(rng.standard_normal(shape), dtype)
    index = (1, jnp.asarray([[4, 0], [2, 2]]))

    def as_bits(x):
        x = jnp.asarray(x)
        return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8)) if x.dtype.itemsize == 1 \
            else np.asarray(x).view(np.uint8)  # fmt: skip

    got = jax.jit(lambda p: take_pages(p, index, "cpu"))(pages)
    assert got.dtype == pages.dtype and got.shape == (2, 2, 3, 4, 8)
    np.testing.assert_array_equal(as_bits(got), as_bits(pages[index]))

    blk, off = jnp.asarray([5, 1]), jnp.asarray([3, 0])
    values = jnp.asarray(rng.standard_normal((2, 3, 8)) * 4, jnp.float32)
    where = (0, blk, slice(None), off)
    got = jax.jit(lambda p, v: _scatter(p, where, v, "cpu"))(pages, values)
    want = pages.at[where].set(values.astype(dtype))
    np.testing.assert_array_equal(as_bits(got), as_bits(want))
    assert not np.array_equal(as_bits(got), as_bits(pages))  # something was written


def test_float8_pools_take_the_plain_ops_off_cpu():
    from jaxinfer.cache import paged

    assert paged._through_bytes(jnp.float8_e4m3fn, "cpu")
    assert not paged._through_bytes(jnp.int8, "cpu")
    assert not paged._through_bytes(jnp.float32, "cpu")
    assert not paged._through_bytes(jnp.float8_e4m3fn, "gpu")
