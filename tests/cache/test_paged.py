"""init_cache: shapes per format, and bad sizes named in the error."""

import jax.numpy as jnp
import pytest

import jaxinfer as ji

CFG = ji.preset("tiny-llama")


@pytest.mark.parametrize("kv_format, dtype", [("float", None), ("int8", jnp.int8)])
def test_shapes(kv_format, dtype):
    cache = ji.init_cache(CFG, 5, 8, kv_format=kv_format)
    shape = (CFG.num_layers, 5, CFG.num_kv_heads, 8, CFG.head_dim)
    assert cache.k.shape == cache.v.shape == shape
    assert cache.k.dtype == (dtype or jnp.dtype(CFG.dtype))
    if kv_format == "int8":
        assert cache.k_scale.shape == shape[:-1]


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
