"""`linear(x, w, b)`: the one place a weight is applied, dispatching on the weight's type.

The model calls this for every projection, so quantized weight pytrees plug in without the model
branching on quantization. A dense weight is an array `[in, out]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import transposed
from jaxinfer.ops.backend import is_pallas, resolve_backend
from jaxinfer.qtensor import (
    ColumnBlocks,
    Int4Weight,
    Int8Weight,
    dequantize,
    dequantize_rows,
    quantize_per_token,
)


def linear(x: jax.Array, w, b: jax.Array | None = None, *, backend: str = "auto") -> jax.Array:
    """y = x @ w (+ b), in x's dtype.

    Args:
      x: activations `[..., in]`.
      w: a dense `[in, out]` array, a `TransposedDense` (dense or int8), a quantized weight
        pytree or one in `ColumnBlocks` (see `jaxinfer.qtensor`).
      b: optional bias `[out]`.
      backend: for quantized weights, "xla" and "reference" dequantize and dot in XLA; "pallas"
        and "pallas-interpret" run the kernels of `pallas_kernels`; "auto" picks Pallas on GPU.

    Returns:
      `[..., out]` in x's dtype.
    """
    if isinstance(w, jax.Array | jnp.ndarray):
        y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    elif isinstance(w, transposed.TransposedDense):
        if w.scale is not None and is_pallas(backend := resolve_backend(backend)):
            # An int8 weight in the CPU layout, on the Pallas path (interpret mode on a CPU):
            # back to the kernel's [in, out] operand, so the kernel is what runs.
            q = jnp.swapaxes(w.wt, -1, -2)
            return linear(x, Int8Weight(q, w.scale, False, q.shape), b, backend=backend)
        y = transposed.apply(x, w)
    elif isinstance(w, ColumnBlocks):
        if is_pallas(resolve_backend(backend)):  # the kernel's operand, [in, out] again
            return linear(x, w.whole(), b, backend=backend)
        y = _column_blocks(x, w)
    elif _has_kernel(w) and is_pallas(backend := resolve_backend(backend)):
        # Not a cycle breaker: the Pallas backend (and Pallas itself) loads only when it is used.
        from jaxinfer.ops import pallas

        y = pallas.linear(x, w, interpret=backend == "pallas-interpret")
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
# Dequantize-and-dot. Int4 (with or without `mins`) and grouped Int8: the same arithmetic as
# `qtensor.dequantize` followed by the dense path, so `linear(x, w) == linear(x, dequantize(w))`
# (bit-exact without act-order perm).
# Int8: the per-column scale is applied after the reduction (equal up to float rounding). The
# Pallas kernels (`ops/pallas.py` over pallas_kernels/int4_matmul/, int8_matmul/) compute the
# same products.


def _column_blocks(x: jax.Array, w: ColumnBlocks) -> jax.Array:
    """`linear` of a weight in column blocks: up to NARROW_SCAN_MAX_ROWS rows one block is
    dequantized and multiplied at a time; above, every block at once and one batched product
    (a prefill amortises the whole dequantization over its rows; `jaxinfer.transposed`)."""
    d_in = w.shape[0]
    x2 = x.reshape(-1, d_in)  # [M, in]
    if w.perm is not None:
        x2 = jnp.take(x2, w.perm, axis=-1)  # [M, in] in the weights' stored row order
    if x2.shape[0] <= transposed.NARROW_SCAN_MAX_ROWS:

        def block(wb):  # one block [in, ob] -> [M, ob]
            return jnp.dot(x2, _dequantized(wb, x.dtype), preferred_element_type=jnp.float32)

        y = transposed.scan_blocks(block, w.blocks)  # [M, out]
    else:
        wd = _dequantized(w.blocks, x.dtype)  # [nb, in, ob]
        ys = jnp.einsum("mi,bio->bmo", x2, wd, preferred_element_type=jnp.float32)
        y = jnp.transpose(ys, (1, 0, 2)).reshape(x2.shape[0], w.out)
    return y.reshape(*x.shape[:-1], w.out)


def _dequantized(w, dtype) -> jax.Array:
    """A weight-only Int4Weight or grouped Int8Weight in stored row order, `[..., in, out]`."""
    return dequantize_rows(w, dtype) if isinstance(w, Int4Weight) else dequantize(w, dtype)


def _has_kernel(w) -> bool:
    # A grouped Int8Weight (GGUF Q8_0) has no Pallas kernel yet: it takes the XLA path.
    return isinstance(w, Int4Weight) or (isinstance(w, Int8Weight) and w.group_size is None)


def _int4_linear(x: jax.Array, w: Int4Weight) -> jax.Array:
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)  # [..., in] in the weight's stored row order
    wd = dequantize_rows(w, x.dtype)  # [in, out]
    return jnp.dot(x, wd, preferred_element_type=jnp.float32)


def _int8_w8a16(x: jax.Array, w: Int8Weight) -> jax.Array:
    if w.group_size is not None:  # grouped scales vary along `in`: dequantize, then dot
        return jnp.dot(x, dequantize(w, x.dtype), preferred_element_type=jnp.float32)
    # The per-output-channel scale is constant along `in`: applied once after the reduction.
    y = jnp.dot(x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)  # int8 exact in bf16
    return y * w.scales.astype(jnp.float32)


def _int8_w8a8(x: jax.Array, w: Int8Weight) -> jax.Array:
    xq, xs = quantize_per_token(x)  # [..., in] int8, [...] float32
    acc = jax.lax.dot_general(
        xq, w.q, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )  # [..., out] int32, exact
    return acc.astype(jnp.float32) * xs[..., None] * w.scales.astype(jnp.float32)
