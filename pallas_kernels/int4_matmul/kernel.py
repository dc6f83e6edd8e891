"""The grouped int4 matmul Pallas kernel (Triton backend; `interpret=True` on CPU).

Layers: `_int4_kernel` (on refs), `_int4_pallas_call`, and the jitted, validating `int4_matmul`.
The layout and the split-K scheme are described in the package docstring; the nibble layout and
the oracle are in `reference.py`, the tiling in `pallas_kernels/tiling.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4_matmul.reference import unpack_int4
from pallas_kernels.split_k import compiler_params, split_k_range
from pallas_kernels.tiling import (
    MatmulBlockSizes,
    TilePlan,
    check_activations,
    default_block_sizes,
    plan_tiles,
)

# ----------------------------------------------------------------------------- kernel


def _int4_kernel(x_ref, packed_ref, scales_ref, zeros_ref, *refs, plan: TilePlan, group: int):
    # x_ref      [bm, K]        activations (already permuted), one M tile, all of K
    # packed_ref [K/8, bn]      uint32, 8 rows per word
    # scales_ref [K/G, bn]      activation dtype
    # zeros_ref  [K/G, bn]      int32
    # mins_ref   [K/G, bn]      activation dtype; present only for a float-offset weight (Q4_1)
    # out_ref    [bm, bn]       float32 partial sum of this program's K split
    mins_ref, out_ref = refs if len(refs) == 2 else (None, refs[0])
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    groups_per_tile = max(1, bk // group)  # 1 when the tile lies inside one group
    first, count = split_k_range(plan)

    def body(i, acc):
        k0 = (first + i) * bk
        words = packed_ref[pl.ds(k0 // 8, bk // 8), :]  # [bk/8, bn] uint32
        q = unpack_int4(words)  # [bk, bn] int32, the layout of reference.py
        g0 = k0 // group
        s = scales_ref[pl.ds(g0, groups_per_tile), :].astype(jnp.float32)  # [bk/G or 1, bn]
        z = zeros_ref[pl.ds(g0, groups_per_tile), :]  # [bk/G or 1, bn]
        rows_per_group = bk // groups_per_tile
        s = jnp.broadcast_to(s[:, None, :], (groups_per_tile, rows_per_group, bn)).reshape(bk, bn)
        z = jnp.broadcast_to(z[:, None, :], (groups_per_tile, rows_per_group, bn)).reshape(bk, bn)
        w = (q - z).astype(jnp.float32) * s  # [bk, bn]
        if mins_ref is not None:  # the float offset of each group, added after scaling
            mn = mins_ref[pl.ds(g0, groups_per_tile), :].astype(jnp.float32)  # [bk/G or 1, bn]
            w = w + jnp.broadcast_to(mn[:, None, :], (groups_per_tile, rows_per_group, bn)).reshape(
                bk, bn
            )
        w = w.astype(x_ref.dtype)  # [bk, bn] dequantized tile
        x = x_ref[:, pl.ds(k0, bk)]  # [bm, bk]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)  # [bm, bn]

    out_ref[...] = lax.fori_loop(0, count, body, jnp.zeros((bm, bn), jnp.float32))


# ----------------------------------------------------------------------------- pallas_call


def _int4_pallas_call(
    x: jax.Array,  # [m_pad, K]
    packed: jax.Array,  # [K/8, n_pad] uint32
    scales: jax.Array,  # [K/G, n_pad]
    zeros: jax.Array,  # [K/G, n_pad] int32
    mins: jax.Array | None,  # [K/G, n_pad] or None
    *,
    plan: TilePlan,
    group: int,
    sizes: MatmulBlockSizes,
    interpret: bool,
) -> jax.Array:  # [splits, m_pad, n_pad] float32
    k = x.shape[1]
    bm, bn = plan.block_m, plan.block_n
    group_spec = pl.BlockSpec((k // group, bn), lambda i, j, s: (0, j))
    operands = (x, packed, scales, zeros) + (() if mins is None else (mins,))
    return pl.pallas_call(
        functools.partial(_int4_kernel, plan=plan, group=group),
        out_shape=jax.ShapeDtypeStruct((plan.splits, plan.m_pad, plan.n_pad), jnp.float32),
        grid=plan.grid,
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j, s: (i, 0)),
            pl.BlockSpec((k // 8, bn), lambda i, j, s: (0, j)),
            group_spec,
            group_spec,
        ]
        + ([] if mins is None else [group_spec]),
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        compiler_params=compiler_params(sizes),
        interpret=interpret,
        name="int4_matmul",
    )(*operands)


# ----------------------------------------------------------------------------- public op


def _check_int4_operands(x, packed, scales, zeros, group_size, perm, mins=None) -> None:
    check_activations(x)
    m, k = x.shape
    if packed.dtype != jnp.uint32 or packed.ndim != 2:
        raise ValueError(
            f"packed has dtype {packed.dtype} and shape {packed.shape}; expected uint32 [K/8, N]"
        )
    if k % 8 or packed.shape[0] * 8 != k:
        raise ValueError(f"packed has shape {packed.shape}; expected [K/8, N] with K={k}")
    n = packed.shape[1]
    if group_size <= 0 or group_size % 8 or k % group_size:
        raise ValueError(
            f"group_size={group_size}; expected a positive multiple of 8 that divides K={k}"
        )
    want = (k // group_size, n)
    if scales.shape != want:
        raise ValueError(f"scales has shape {scales.shape}; expected {want} (K/G, N)")
    if scales.dtype != x.dtype:
        raise ValueError(f"scales has dtype {scales.dtype}; expected x's dtype {x.dtype}")
    if zeros.shape != want:
        raise ValueError(f"zeros has shape {zeros.shape}; expected {want} (K/G, N)")
    if zeros.dtype != jnp.int32:
        raise ValueError(f"zeros has dtype {zeros.dtype}; expected int32 zero points 0..15")
    if perm is not None and (perm.shape != (k,) or not jnp.issubdtype(perm.dtype, jnp.integer)):
        raise ValueError(f"perm has shape {perm.shape}, dtype {perm.dtype}; expected int [{k}]")
    if mins is not None and (mins.shape != want or mins.dtype != x.dtype):
        raise ValueError(
            f"mins has shape {mins.shape}, dtype {mins.dtype}; expected {want} (K/G, N) in x's "
            f"dtype {x.dtype}"
        )


@functools.partial(jax.jit, static_argnames=("group_size", "block_sizes", "interpret"))
def int4_matmul(
    x: jax.Array,
    packed: jax.Array,
    scales: jax.Array,
    zeros: jax.Array,
    *,
    group_size: int,
    perm: jax.Array | None = None,
    block_sizes: MatmulBlockSizes | None = None,
    interpret: bool = False,
    mins: jax.Array | None = None,
) -> jax.Array:
    """`x @ w` for a grouped int4 weight, dequantized tile by tile inside the kernel.

    Args:
      x: `[M, K]` activations, float32, bfloat16 or float16.
      packed: `[K/8, N]` uint32, 8 input rows per word, low nibble first.
      scales: `[K/G, N]` in x's dtype.
      zeros: `[K/G, N]` int32 zero points in 0..15.
      group_size: G, a multiple of 8 dividing K (G = K for per-channel).
      perm: optional `[K]` int act-order permutation: stored row k is input feature perm[k],
        so the result is `x[:, perm] @ w`.
      block_sizes: tile sizes; default from `default_block_sizes(M)`.
      interpret: run the kernel in the Pallas interpreter (CPU).
      mins: optional `[K/G, N]` float offsets in x's dtype, `w = (q - z) * s + mins` (GGUF Q4_1).

    Returns:
      `[M, N]` in x's dtype, accumulated in float32.
    """
    _check_int4_operands(x, packed, scales, zeros, group_size, perm, mins)
    m, k = x.shape
    n = packed.shape[1]
    sizes = block_sizes or default_block_sizes(m)
    plan = plan_tiles(m, k, n, sizes, group_size)
    if perm is not None:
        x = jnp.take(x, perm, axis=1)  # [M, K] in the weight's row order
    x = jnp.pad(x, ((0, plan.m_pad - m), (0, 0)))  # [m_pad, K]
    if plan.n_pad != n:
        pad = ((0, 0), (0, plan.n_pad - n))
        packed, scales, zeros = jnp.pad(packed, pad), jnp.pad(scales, pad), jnp.pad(zeros, pad)
        mins = None if mins is None else jnp.pad(mins, pad)
    partial = _int4_pallas_call(
        x, packed, scales, zeros, mins,
        plan=plan, group=group_size, sizes=sizes, interpret=interpret,
    )  # fmt: skip  # [splits, m_pad, n_pad] float32
    return partial.sum(axis=0)[:m, :n].astype(x.dtype)
