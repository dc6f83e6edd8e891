"""Pure-jnp oracles of the int8 matmuls (no Pallas): dequantize in float32, or int32 dots."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


@jax.jit
def int8_matmul_reference(x: jax.Array, w: jax.Array, w_scales: jax.Array) -> jax.Array:
    """Pure-jnp oracle for `int8_matmul`: dequantize in float32, then `jnp.dot`.

    Args:
      x: `[M, K]` float activations.
      w: `[K, N]` int8.
      w_scales: `[N]` float.

    Returns:
      `[M, N]` in x's dtype.
    """
    wf = w.astype(jnp.float32) * w_scales.astype(jnp.float32)[None, :]  # [K, N]
    y = jnp.dot(x.astype(jnp.float32), wf, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def int8_int8_matmul_reference(
    x: jax.Array,
    x_scales: jax.Array,
    w: jax.Array,
    w_scales: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """Pure-jnp oracle for `int8_int8_matmul`: int32 `jnp.dot`, then both scales in float32.

    Args:
      x, x_scales, w, w_scales, out_dtype: as in `int8_int8_matmul`.

    Returns:
      `[M, N]` in `out_dtype`.
    """
    acc = jnp.dot(x.astype(jnp.int32), w.astype(jnp.int32))  # [M, N] int32
    y = acc.astype(jnp.float32) * x_scales.astype(jnp.float32)[:, None]
    return (y * w_scales.astype(jnp.float32)[None, :]).astype(out_dtype)
