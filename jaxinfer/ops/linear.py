"""`linear(x, w, b)`: the one place a weight is applied, dispatching on the weight's type.

The model calls this for every projection, so quantized weight pytrees plug in without the model
branching on quantization. A dense weight is an array `[in, out]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops.attention import resolve_backend
from jaxinfer.quant.formats import Int4Weight, Int8Weight, dequantize_rows, quantize_per_token


def linear(x: jax.Array, w, b: jax.Array | None = None, *, backend: str = "auto") -> jax.Array:
    """y = x @ w (+ b), in x's dtype.

    Args:
      x: activations `[..., in]`.
      w: a dense `[in, out]` array or a quantized weight pytree (see `jaxinfer.quant.formats`).
      b: optional bias `[out]`.
      backend: for quantized weights, "xla" and "reference" dequantize and dot in XLA; "pallas"
        and "pallas-interpret" run the kernels of `pallas_kernels`; "auto" picks Pallas on GPU.

    Returns:
      `[..., out]` in x's dtype.
    """
    if isinstance(w, jax.Array | jnp.ndarray):
        y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    elif resolve_backend(backend).startswith("pallas") and isinstance(w, Int4Weight | Int8Weight):
        y = _pallas_linear(x, w, interpret=resolve_backend(backend) == "pallas-interpret")
    elif isinstance(w, Int4Weight):
        y = _int4_linear(x, w)
    elif isinstance(w, Int8Weight):
        y = _int8_w8a8(x, w) if w.act_quant else _int8_w8a16(x, w)
    else:
        raise TypeError(f"linear: unsupported weight type {type(w).__name__}")
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


# ------------------------------------------------------------------- quantized weights (XLA path)
# Dequantize-and-dot. Int4: the same arithmetic as `quant.formats.dequantize` followed by the
# dense path, so `linear(x, w) == linear(x, dequantize(w))` (bit-exact without act-order perm).
# Int8: the per-column scale is applied after the reduction (equal up to float rounding). The
# Pallas kernels (pallas_kernels/int4_matmul.py, int8_matmul.py) compute the same products and
# plug in here.


def _int4_linear(x: jax.Array, w: Int4Weight) -> jax.Array:
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)  # [..., in] in the weight's stored row order
    wd = dequantize_rows(w, x.dtype)  # [in, out]
    return jnp.dot(x, wd, preferred_element_type=jnp.float32)


def _int8_w8a16(x: jax.Array, w: Int8Weight) -> jax.Array:
    # The per-output-channel scale is constant along `in`: applied once after the reduction.
    y = jnp.dot(x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)  # int8 exact in bf16
    return y * w.scales.astype(jnp.float32)


def _int8_w8a8(x: jax.Array, w: Int8Weight) -> jax.Array:
    xq, xs = quantize_per_token(x)  # [..., in] int8, [...] float32
    acc = jax.lax.dot_general(
        xq, w.q, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )  # [..., out] int32, exact
    return acc.astype(jnp.float32) * xs[..., None] * w.scales.astype(jnp.float32)


# ------------------------------------------------------------------- quantized weights (Pallas)
# The same products computed by the kernels on tiles (the weight is read once, as stored).


def _pallas_linear(x: jax.Array, w, *, interpret: bool) -> jax.Array:
    from pallas_kernels.int4_matmul import int4_matmul
    from pallas_kernels.int8_matmul import int8_int8_matmul, int8_matmul

    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    if isinstance(w, Int4Weight):
        y = int4_matmul(
            x2, w.packed, w.scales.astype(x.dtype), w.zeros,
            group_size=w.group_size, perm=w.perm, interpret=interpret,
        )  # fmt: skip
    elif w.act_quant:
        xq, xs = quantize_per_token(x2)  # [M, in] int8, [M] float32
        y = int8_int8_matmul(xq, xs, w.q, w.scales, interpret=interpret)
    else:
        y = int8_matmul(x2, w.q, w.scales, interpret=interpret)
    return y.astype(jnp.float32).reshape(*lead, y.shape[-1])
