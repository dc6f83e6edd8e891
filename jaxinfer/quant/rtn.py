"""Round-to-nearest (RTN) quantization: min-max grid per group, the baseline every method beats.

The grid of a group (one output column, G consecutive input rows) is

  asymmetric  scale = (max - min) / (2**bits - 1),  zero = round(-min / scale)
              with min <= 0 <= max (the range always contains 0, so the zero point is a code)
  symmetric   scale = absmax / (2**(bits-1) - 1),   zero = 2**(bits-1)
              (codes zero ± (2**(bits-1) - 1) hit ±absmax exactly; the lowest code is unused)

and a weight is coded q = clip(round(w / scale) + zero, 0, 2**bits - 1). Scales are rounded to
the activation dtype *before* coding, so the codes are optimal for the scales that are stored.
GPTQ and AWQ reuse these functions for their grids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.qtensor import (
    Int4Weight,
    Int8Weight,
    check_int4_static,
    make_int4,
    resolve_group_size,
)


def group_params(
    w: jax.Array,
    *,
    bits: int,
    sym: bool,
    scale_dtype=jnp.float32,
    clip: jax.Array | float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Min-max grid of groups of rows.

    Args:
      w: `[..., G, out]` one group of input rows per leading index (reduced over axis -2).
      bits: code width (2..8).
      sym: symmetric grid (fixed zero point) instead of asymmetric.
      scale_dtype: dtype the scales are stored in; the returned float32 scales are rounded to it.
      clip: optional shrink ratio of the range (AWQ clipping), broadcastable to `[..., out]`.

    Returns:
      (scales `[..., out]` float32 holding `scale_dtype` values, zeros `[..., out]` int32).
    """
    maxq = 2**bits - 1
    w = w.astype(jnp.float32)
    wmin = jnp.minimum(jnp.min(w, axis=-2), 0.0)  # [..., out]
    wmax = jnp.maximum(jnp.max(w, axis=-2), 0.0)
    if clip is not None:
        wmin, wmax = wmin * clip, wmax * clip
    if sym:
        half = 2 ** (bits - 1)
        absmax = jnp.maximum(-wmin, wmax)
        scale = absmax / (half - 1)
        zero = jnp.full(scale.shape, half, jnp.int32)
    else:
        scale = (wmax - wmin) / maxq
        zero = None
    # An all-zero group gets scale 1: every weight codes to the zero point and dequantizes to 0.
    scale = jnp.where(scale > 0, scale, 1.0).astype(scale_dtype).astype(jnp.float32)
    scale = jnp.where(scale > 0, scale, 1.0)  # scale_dtype underflow (fp16) guard
    if zero is None:
        zero = jnp.clip(jnp.round(-wmin / scale), 0, maxq).astype(jnp.int32)
    return scale, zero


def quantize_codes(w: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> jax.Array:
    """q = clip(round(w / scale) + zero, 0, 2**bits - 1) as int32 (broadcasting)."""
    q = jnp.round(w.astype(jnp.float32) / scale) + zero.astype(jnp.float32)
    return jnp.clip(q, 0, 2**bits - 1).astype(jnp.int32)


def _grouped(w: jax.Array, group_size: int) -> jax.Array:
    *lead, d_in, d_out = w.shape
    return w.reshape(*lead, d_in // group_size, group_size, d_out)  # [..., in/G, G, out]


def rtn_params(
    w: jax.Array,
    *,
    bits: int,
    group_size: int,
    sym: bool,
    scale_dtype=jnp.float32,
    clip: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-group grid of a whole weight.

    Args:
      w: `[..., in, out]` float.
      bits, sym, scale_dtype: as in `group_params`.
      group_size: G dividing `in`.
      clip: optional `[..., in/G, out]` range shrink ratios.

    Returns:
      (scales `[..., in/G, out]` float32, zeros `[..., in/G, out]` int32).
    """
    return group_params(
        _grouped(w, group_size), bits=bits, sym=sym, scale_dtype=scale_dtype, clip=clip
    )


def rtn_codes(w: jax.Array, scales: jax.Array, zeros: jax.Array, bits: int) -> jax.Array:
    """Codes `[..., in, out]` of `w` on per-group grids `[..., in/G, out]`."""
    *lead, d_in, d_out = w.shape
    group_size = d_in // scales.shape[-2]
    q = quantize_codes(_grouped(w, group_size), scales[..., None, :], zeros[..., None, :], bits)
    return q.reshape(*lead, d_in, d_out)


def rtn_fake_quantize(
    w: jax.Array, *, bits: int, group_size: int, sym: bool, scale_dtype=jnp.float32, clip=None
) -> jax.Array:
    """The dequantized RTN weight `[..., in, out]` float32 (no packing)."""
    s, z = rtn_params(
        w, bits=bits, group_size=group_size, sym=sym, scale_dtype=scale_dtype, clip=clip
    )
    q = rtn_codes(w, s, z, bits)
    deq = (_grouped(q, group_size) - z[..., None, :]).astype(jnp.float32) * s[..., None, :]
    return deq.reshape(w.shape)


def rtn_quantize(
    w: jax.Array,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    sym: bool = False,
    scale_dtype=None,
    clip: jax.Array | None = None,
) -> Int4Weight:
    """Round-to-nearest quantization of a dense weight into an `Int4Weight`.

    Args:
      w: `[..., in, out]` dense weight (leading axes, e.g. layers, are kept).
      bits: 2, 3 or 4.
      group_size: G dividing `in` (multiple of 8); None or -1 for per-channel.
      sym: symmetric grid instead of asymmetric min-max.
      scale_dtype: dtype of the stored scales (the activation dtype); defaults to w's dtype.
      clip: optional `[..., in/G, out]` range shrink ratios (AWQ clipping).

    Returns:
      The quantized weight; raises ValueError for unsupported bits or group size.
    """
    d_in = w.shape[-2]
    group_size = resolve_group_size(group_size, d_in)
    check_int4_static(tuple(w.shape[-2:]), group_size, bits)
    scale_dtype = jnp.dtype(scale_dtype or w.dtype)
    s, z = rtn_params(
        w, bits=bits, group_size=group_size, sym=sym, scale_dtype=scale_dtype, clip=clip
    )
    q = rtn_codes(w, s, z, bits)
    return make_int4(q, s.astype(scale_dtype), z, bits=bits, group_size=group_size)


def quantize_int8(w: jax.Array, *, act_quant: bool = False) -> Int8Weight:
    """Symmetric per-output-channel int8 quantization: scale = absmax / 127 per column.

    Args:
      w: `[..., in, out]` dense weight.
      act_quant: True for W8A8 (activations quantized per token at run time), False for W8A16.

    Returns:
      The `Int8Weight` with float32 scales `[..., out]`.
    """
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2)  # [..., out]
    scales = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w32 / scales[..., None, :]), -127, 127).astype(jnp.int8)
    return Int8Weight(q=q, scales=scales, act_quant=act_quant, shape=tuple(w.shape[-2:]))
