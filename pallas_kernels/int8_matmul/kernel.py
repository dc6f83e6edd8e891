"""The int8 matmul Pallas kernels, W8A16 and W8A8 (Triton backend; `interpret=True` on CPU).

Layers: `_int8_kernel` (both variants), `_int8_pallas_call`, and the jitted, validating
`int8_matmul` / `int8_int8_matmul`; the oracles are in `reference.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.split_k import compiler_params, split_k_range
from pallas_kernels.tiling import (
    MatmulBlockSizes,
    TilePlan,
    check_activations,
    default_block_sizes,
    plan_tiles,
)

# ----------------------------------------------------------------------------- kernel


def _int8_kernel(x_ref, w_ref, out_ref, *, plan: TilePlan):
    # x_ref   [bm, K]   float activations (W8A16) or int8 (W8A8), one M tile, all of K
    # w_ref   [K, bn]   int8
    # out_ref [bm, bn]  float32 (W8A16) or int32 (W8A8) partial sum of this program's K split
    bk = plan.block_k
    acc_dtype = out_ref.dtype
    first, count = split_k_range(plan)

    def body(i, acc):
        k0 = (first + i) * bk
        x = x_ref[:, pl.ds(k0, bk)]  # [bm, bk]
        w = w_ref[pl.ds(k0, bk), :].astype(x.dtype)  # [bk, bn]; int8 is exact in bf16/f16/f32
        return acc + jnp.dot(x, w, preferred_element_type=acc_dtype)  # [bm, bn]

    zero = jnp.zeros((plan.block_m, plan.block_n), acc_dtype)
    out_ref[...] = lax.fori_loop(0, count, body, zero)


# ----------------------------------------------------------------------------- pallas_call


def _int8_pallas_call(
    x: jax.Array,  # [m_pad, K] float or int8
    w: jax.Array,  # [K, n_pad] int8
    *,
    plan: TilePlan,
    sizes: MatmulBlockSizes,
    interpret: bool,
) -> jax.Array:  # [splits, m_pad, n_pad] float32 or int32
    k = x.shape[1]
    acc_dtype = jnp.int32 if x.dtype == jnp.int8 else jnp.float32
    bm, bn = plan.block_m, plan.block_n
    return pl.pallas_call(
        functools.partial(_int8_kernel, plan=plan),
        out_shape=jax.ShapeDtypeStruct((plan.splits, plan.m_pad, plan.n_pad), acc_dtype),
        grid=plan.grid,
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j, s: (i, 0)),
            pl.BlockSpec((k, bn), lambda i, j, s: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        compiler_params=compiler_params(sizes),
        interpret=interpret,
        name="int8_int8_matmul" if x.dtype == jnp.int8 else "int8_matmul",
    )(x, w)


def _split_k_matmul(x, w, sizes, interpret) -> jax.Array:
    """Pads to the plan, runs the kernel, sums the K splits: `[M, N]` float32 or int32."""
    m, k = x.shape
    n = w.shape[1]
    sizes = sizes or default_block_sizes(m)
    plan = plan_tiles(m, k, n, sizes)
    x = jnp.pad(x, ((0, plan.m_pad - m), (0, 0)))  # [m_pad, K]
    w = jnp.pad(w, ((0, 0), (0, plan.n_pad - n)))  # [K, n_pad]
    partial = _int8_pallas_call(x, w, plan=plan, sizes=sizes, interpret=interpret)
    return partial.sum(axis=0)[:m, :n]  # [M, N]


def _check_weight(w: jax.Array, w_scales: jax.Array, k: int) -> None:
    if w.dtype != jnp.int8 or w.ndim != 2 or w.shape[0] != k:
        raise ValueError(f"w has dtype {w.dtype}, shape {w.shape}; expected int8 [K={k}, N]")
    if w_scales.shape != (w.shape[1],) or not jnp.issubdtype(w_scales.dtype, jnp.floating):
        raise ValueError(
            f"w_scales has shape {w_scales.shape}, dtype {w_scales.dtype}; "
            f"expected float [N={w.shape[1]}]"
        )


# ----------------------------------------------------------------------------- public ops


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def int8_matmul(
    x: jax.Array,
    w: jax.Array,
    w_scales: jax.Array,
    *,
    block_sizes: MatmulBlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """W8A16: `x @ (w * w_scales)` with per-output-channel weight scales.

    Args:
      x: `[M, K]` activations, float32, bfloat16 or float16.
      w: `[K, N]` int8 weight.
      w_scales: `[N]` float per-output-channel scales.
      block_sizes: tile sizes; default from `default_block_sizes(M)`.
      interpret: run the kernel in the Pallas interpreter (CPU).

    Returns:
      `[M, N]` in x's dtype, accumulated in float32.
    """
    check_activations(x)
    _check_weight(w, w_scales, x.shape[1])
    acc = _split_k_matmul(x, w, block_sizes, interpret)  # [M, N] float32
    return (acc * w_scales.astype(jnp.float32)[None, :]).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def int8_int8_matmul(
    x: jax.Array,
    x_scales: jax.Array,
    w: jax.Array,
    w_scales: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.float32,
    block_sizes: MatmulBlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """W8A8: int8 x int8 -> int32 on the tensor cores, then both scales.

    Args:
      x: `[M, K]` int8 activations (quantized per token).
      x_scales: `[M]` float per-token scales.
      w: `[K, N]` int8 weight.
      w_scales: `[N]` float per-output-channel scales.
      out_dtype: dtype of the result.
      block_sizes: tile sizes; default from `default_block_sizes(M)`.
      interpret: run the kernel in the Pallas interpreter (CPU).

    Returns:
      `[M, N]` `(x @ w as int32) * x_scales[:, None] * w_scales[None, :]` in `out_dtype`.
    """
    if x.dtype != jnp.int8 or x.ndim != 2:
        raise ValueError(f"x has dtype {x.dtype}, shape {x.shape}; expected int8 [M, K]")
    if x_scales.shape != (x.shape[0],) or not jnp.issubdtype(x_scales.dtype, jnp.floating):
        raise ValueError(
            f"x_scales has shape {x_scales.shape}, dtype {x_scales.dtype}; "
            f"expected float [M={x.shape[0]}]"
        )
    _check_weight(w, w_scales, x.shape[1])
    acc = _split_k_matmul(x, w, block_sizes, interpret)  # [M, N] int32, exact
    y = acc.astype(jnp.float32) * x_scales.astype(jnp.float32)[:, None]
    return (y * w_scales.astype(jnp.float32)[None, :]).astype(out_dtype)
