"""The int4 nibble layout (the one place it is written) and the pure-jnp matmul oracle; no Pallas.

  packed [..., K/8, N] uint32   row 8r + j of q is nibble j of word r: (packed[r] >> 4j) & 0xF

`jaxinfer.qtensor` packs its `Int4Weight` with these functions and the kernel unpacks its tiles
with `unpack_int4`, so the weights, the oracle and the kernel share one definition.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _nibble_shifts() -> jax.Array:
    """`[8, 1]` uint32 shifts 4j of nibble j (an iota, so the kernel body can build it too)."""
    return 4 * lax.broadcasted_iota(jnp.uint32, (8, 1), 0)


def pack_int4(q: jax.Array) -> jax.Array:
    """Packs 4-bit codes along the input axis.

    Args:
      q: `[..., K, N]` integers in 0..15 (higher bits are not masked: keep codes in range).

    Returns:
      `[..., K/8, N]` uint32; row 8r + j of q is bits 4j..4j+3 of word r.
    """
    *lead, k, n = q.shape
    if k % 8:
        raise ValueError(f"pack_int4: input dimension {k} must be a multiple of 8")
    q = q.astype(jnp.uint32).reshape(*lead, k // 8, 8, n)  # [..., K/8, 8, N]
    # The nibbles do not overlap, so a sum is a bitwise or.
    return jnp.sum(q << _nibble_shifts(), axis=-2, dtype=jnp.uint32)  # [..., K/8, N]


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_int4`: `[..., K/8, N]` uint32 -> `[..., K, N]` int32 in 0..15."""
    *lead, rows, n = packed.shape
    q = (packed.astype(jnp.uint32)[..., None, :] >> _nibble_shifts()) & 0xF  # [..., K/8, 8, N]
    return q.reshape(*lead, rows * 8, n).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("group_size",))
def int4_matmul_reference(
    x: jax.Array,
    packed: jax.Array,
    scales: jax.Array,
    zeros: jax.Array,
    *,
    group_size: int,
    perm: jax.Array | None = None,
    mins: jax.Array | None = None,
) -> jax.Array:
    """Pure-jnp oracle: dequantize to float32 with the formula above, then `jnp.dot`.

    Args:
      x, packed, scales, zeros, group_size, perm, mins: as in `int4_matmul`.

    Returns:
      `[M, N]` in x's dtype.
    """
    q = unpack_int4(packed)  # [K, N]
    z = jnp.repeat(zeros, group_size, axis=0)  # [K, N]
    s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)  # [K, N]
    w = (q - z).astype(jnp.float32) * s  # [K, N]
    if mins is not None:
        w = w + jnp.repeat(mins.astype(jnp.float32), group_size, axis=0)  # [K, N]
    xf = x.astype(jnp.float32)
    if perm is not None:
        xf = xf[:, perm]
    y = jnp.dot(xf, w, precision=lax.Precision.HIGHEST)  # [M, N]
    return y.astype(x.dtype)
