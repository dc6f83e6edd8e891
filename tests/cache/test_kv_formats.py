"""KV-cache quantization: int8 and fp8 (e4m3) with per-(token, head) float32 scales."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cache.kv_formats import (
    dequantize_kv,
    kv_bytes_per_token,
    kv_storage_dtype,
    quantize_kv,
)


def kv_vectors(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(7, 3, 16)) * np.exp(rng.normal(size=(7, 3, 1)))  # [T, K, D]
    x[2, 1] = 0.0  # an all-zero head vector
    x[4, 0, 5] = 40.0  # an outlier sets its vector's scale
    return x.astype(np.float32)


def test_int8_roundtrip_within_half_a_step():
    x = kv_vectors()
    q, scale = quantize_kv(jnp.asarray(x), "int8")
    assert q.dtype == jnp.int8 and q.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    np.testing.assert_allclose(np.asarray(scale), np.where(
        np.abs(x).max(-1) > 0, np.abs(x).max(-1) / 127, 1.0), rtol=1e-6)  # fmt: skip
    back = np.asarray(dequantize_kv(q, scale, jnp.float32))
    assert np.all(np.abs(back - x) <= np.asarray(scale)[..., None] / 2 * (1 + 1e-5))
    np.testing.assert_array_equal(back[2, 1], 0.0)
    assert np.abs(np.asarray(q)).max() == 127


def test_fp8_roundtrip_relative_error():
    x = kv_vectors(1)
    q, scale = quantize_kv(jnp.asarray(x), "fp8")
    assert q.dtype == jnp.float8_e4m3fn
    back = np.asarray(dequantize_kv(q, scale, jnp.float32))
    s = np.asarray(scale)[..., None]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, plus an absolute
    # floor of half the smallest subnormal step (2^-10 of the scale) near zero.
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-4 + s * 2.0**-10 + 1e-7)
    np.testing.assert_allclose(np.abs(back).max(-1), np.abs(x).max(-1), rtol=1e-6)  # max exact
    # Negative control: int8 on the same data is not within fp8's relative bound everywhere.
    q8, s8 = quantize_kv(jnp.asarray(x), "int8")
    back8 = np.asarray(dequantize_kv(q8, s8))
    assert np.any(np.abs(back8 - x) > np.abs(x) * 2.0**-4 + s * 2.0**-10 + 1e-7)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dequantize_output_dtype(dtype):
    q, s = quantize_kv(jnp.ones((2, 4), dtype), "int8")
    out = dequantize_kv(q, s, dtype)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0)


def test_bytes_per_token_and_bad_format():
    assert kv_bytes_per_token(2, 4, 16, "float", 2) == 2 * 2 * 4 * 16 * 2
    assert kv_bytes_per_token(2, 4, 16, "int8") == 2 * 2 * 4 * (16 + 4)
    assert kv_storage_dtype("fp8") == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="'int4'"):
        quantize_kv(jnp.ones((2, 4)), "int4")
