"""`argmax` as two vectorised reductions, for the sampling and acceptance hot paths.

`jnp.argmax` lowers to one variadic (value, index) reduce, which XLA's CPU backend runs as a
scalar loop: 18 us for one row of 4096 logits and 290 us for 32 rows, more than a whole layer of
a small model's decode step. Here a max reduce and a min reduce over the matching indices both
vectorise (2 us and 70 us). Same result as `jnp.argmax`, ties and NaN included: the first index of
the maximum, or of the first NaN when there is one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def argmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Index of the maximum along `axis` (first on ties, first NaN if any), int32.

    Args:
      x: any real array with a non-empty `axis`.
      axis: the reduced axis.

    Returns:
      `x.shape` without `axis`, int32; equal to `jnp.argmax(x, axis)`.
    """
    axis = axis % x.ndim
    n = x.shape[axis]
    if n == 0:
        raise ValueError(f"argmax over an empty axis {axis} of shape {x.shape}")
    hit = x == jnp.max(x, axis=axis, keepdims=True)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        # XLA's vectorised CPU max may skip a NaN, so a row with one picks its first NaN here.
        nan = jnp.isnan(x)
        hit = jnp.where(jnp.any(nan, axis=axis, keepdims=True), nan, hit)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.min(jnp.where(hit, iota, jnp.int32(n)), axis=axis)
