"""Grouped int4 weight-only matmul (W4A16): `y = x @ dequantize(w)` with the weight read once.

The weight uses the `Int4Weight` layout of DESIGN.md:

  packed  [K/8, N] uint32   8 consecutive input rows per word, low nibble first:
                            q[8*r + j, n] = (packed[r, n] >> 4*j) & 0xF
  scales  [K/G, N]          in the activation dtype
  zeros   [K/G, N] int32    integer zero points, 0..15
  w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]        (per-channel: G = K)

Act-order (`perm`): the rows of the stored weight are in permuted order. Stored row k holds the
weights of input feature perm[k], so `y = x[:, perm] @ w` with `w` the dequantized *stored*
weight. (A GPTQ act-order quantizer that processed input features in the order `perm` stores
`W_orig[perm]`; then `x @ W_orig == x[:, perm] @ W_orig[perm]`.) The op gathers the columns of
x (M x K, cheap) rather than the rows of the weight.

Four layers, as everywhere in `pallas_kernels`:
  `_int4_kernel`          kernel body on refs: unpacks, subtracts zeros and scales one tile at a
                          time, then feeds the dequantized tile to a float32-accumulating dot.
  `_int4_pallas_call`     the `pl.pallas_call` wrapper: grid (M tiles, N tiles, K splits).
  `int4_matmul`           the jitted public op; validates shapes and dtypes.
  `int4_matmul_reference` pure jnp: dequantize in float32, then `jnp.dot`.

Split-K: at M = 1 an (M, N) grid alone has N / block_n programs, too few to fill a GPU (an H200
has 132 SMs). Each program therefore reduces only a range of K tiles into its own float32 slab
`[split, M, N]`, and the slabs are summed afterwards (a deterministic two-pass split-K). Block
sizes are data: `MatmulBlockSizes`, with a small table of defaults keyed on the class of M. The
tiling helpers here are shared with `int8_matmul.py`.

The kernel is written for the Pallas Triton backend (NVIDIA GPUs): every loaded tile has a
power-of-two size, every dot is at least 16 x 16 x 16, no scalar prefetch. On CPU it runs with
`interpret=True`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

ACTIVATION_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MIN_DOT = 16  # Triton's dot needs every dimension >= 16


# ----------------------------------------------------------------------------- block sizes


@dataclasses.dataclass(frozen=True)
class MatmulBlockSizes:
    """Tile sizes of the quantized matmul kernels (all powers of two).

    The op may shrink `block_n` / `block_k` to fit the shape (see `plan_tiles`); `block_m` pads M.
    """

    block_m: int = 16  # rows of x per program; >= 16 because Triton's dot needs 16-row tiles
    block_n: int = 64  # output columns per program
    block_k: int = 128  # input rows per loop step (unpacked); 128 rows = 16 packed int4 words
    split_k: int = 8  # most K ranges reduced by separate programs (extra work at small M)
    num_warps: int = 4  # Triton launch parameters, ignored in interpret mode
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < _MIN_DOT or value & (value - 1):
                raise ValueError(f"{name}={value}; expected a power of two >= {_MIN_DOT}")
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k}; expected >= 1")


# Defaults keyed on the M class (upper bound of M, inclusive). Small M is memory bound: a small
# M tile (mostly padding at M = 1), narrow N tiles and split-K for parallelism. Large M is
# compute bound: large square-ish tiles, no split. Not tuned on hardware yet; see
# experiments/kernel_bench.py for the measurement that should refine them.
BLOCK_SIZE_TABLE: tuple[tuple[int, MatmulBlockSizes], ...] = (
    (16, MatmulBlockSizes(block_m=16, block_n=64, block_k=128, split_k=8)),
    (64, MatmulBlockSizes(block_m=32, block_n=64, block_k=128, split_k=4)),
    (256, MatmulBlockSizes(block_m=64, block_n=128, block_k=64, split_k=2, num_warps=8)),
    (2**62, MatmulBlockSizes(block_m=128, block_n=128, block_k=64, split_k=1, num_warps=8)),
)


def default_block_sizes(m: int) -> MatmulBlockSizes:
    """The table entry for `m` rows of activations.

    Args:
      m: number of rows of x.

    Returns:
      The `MatmulBlockSizes` of the smallest M class that holds `m`.
    """
    for max_m, sizes in BLOCK_SIZE_TABLE:
        if m <= max_m:
            return sizes
    return BLOCK_SIZE_TABLE[-1][1]


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Block sizes resolved against one (M, K, N); all static."""

    block_m: int
    block_n: int
    block_k: int
    m_pad: int  # M rounded up to block_m
    n_pad: int  # N rounded up to block_n (== N unless N has no power-of-two factor >= 16)
    num_k_tiles: int  # K / block_k
    tiles_per_split: int  # K tiles reduced by one program
    splits: int  # programs along K; splits * tiles_per_split >= num_k_tiles

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.m_pad // self.block_m, self.n_pad // self.block_n, self.splits)


def _largest_pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def plan_tiles(
    m: int, k: int, n: int, sizes: MatmulBlockSizes, group_size: int | None = None
) -> TilePlan:
    """Fits `sizes` to a shape: the K tile divides K and never straddles a group unevenly.

    Args:
      m, k, n: the matmul shape `[M, K] @ [K, N]`.
      sizes: the requested tile sizes.
      group_size: quantization group along K (int4), or None.

    Returns:
      The resolved `TilePlan`.

    Raises:
      ValueError: when no power-of-two K tile >= 16 fits K and the group size.
    """
    block_k = sizes.block_k
    while block_k >= _MIN_DOT:
        # A K tile lies inside one group, or holds whole groups (then G is a power of two, as
        # block_k is, so the tile's scale rows load as one power-of-two slice).
        g = group_size or block_k
        inside_group = g % block_k == 0
        whole_groups = block_k % g == 0
        if k % block_k == 0 and (inside_group or whole_groups):
            break
        block_k //= 2
    if block_k < _MIN_DOT:
        raise ValueError(
            f"K={k}, group_size={group_size}: the kernel needs a power-of-two K tile >= "
            f"{_MIN_DOT} that divides K and either divides group_size or holds a power-of-two "
            "number of whole groups"
        )
    block_n = _largest_pow2_divisor(n, sizes.block_n)
    n_pad = n
    if block_n < _MIN_DOT:  # odd N: pad the weight (a copy per call; real models never hit this)
        block_n = min(sizes.block_n, 64)
        n_pad = _round_up(n, block_n)
    num_k_tiles = k // block_k
    splits = min(sizes.split_k, num_k_tiles)
    tiles_per_split = -(-num_k_tiles // splits)
    splits = -(-num_k_tiles // tiles_per_split)  # no split without work
    return TilePlan(
        block_m=sizes.block_m,
        block_n=block_n,
        block_k=block_k,
        m_pad=_round_up(m, sizes.block_m),
        n_pad=n_pad,
        num_k_tiles=num_k_tiles,
        tiles_per_split=tiles_per_split,
        splits=splits,
    )


def split_k_range(plan: TilePlan) -> tuple[jax.Array, jax.Array]:
    """Inside a kernel: (first K tile, number of K tiles) of this program's split."""
    first = pl.program_id(2) * plan.tiles_per_split
    count = jnp.clip(plan.num_k_tiles - first, 0, plan.tiles_per_split)
    return first, count


def compiler_params(sizes: MatmulBlockSizes) -> plgpu.CompilerParams:
    # Passing Triton params also selects the Triton backend (the GPU default may be Mosaic GPU).
    return plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages)


def check_activations(x: jax.Array, name: str = "x") -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} has shape {x.shape}; expected [M, K]")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; expected one of float32, bfloat16, float16")


# ----------------------------------------------------------------------------- kernel


def _int4_kernel(x_ref, packed_ref, scales_ref, zeros_ref, out_ref, *, plan: TilePlan, group: int):
    # x_ref      [bm, K]        activations (already permuted), one M tile, all of K
    # packed_ref [K/8, bn]      uint32, 8 rows per word
    # scales_ref [K/G, bn]      activation dtype
    # zeros_ref  [K/G, bn]      int32
    # out_ref    [bm, bn]       float32 partial sum of this program's K split
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    groups_per_tile = max(1, bk // group)  # 1 when the tile lies inside one group
    first, count = split_k_range(plan)
    shifts = 4 * lax.broadcasted_iota(jnp.uint32, (1, 8, 1), 1)  # [1, 8, 1] nibble j at 4*j

    def body(i, acc):
        k0 = (first + i) * bk
        words = packed_ref[pl.ds(k0 // 8, bk // 8), :]  # [bk/8, bn] uint32
        q = (words[:, None, :] >> shifts) & 0xF  # [bk/8, 8, bn]; [r, j] is row 8r + j
        q = q.reshape(bk, bn).astype(jnp.int32)  # [bk, bn]
        g0 = k0 // group
        s = scales_ref[pl.ds(g0, groups_per_tile), :].astype(jnp.float32)  # [bk/G or 1, bn]
        z = zeros_ref[pl.ds(g0, groups_per_tile), :]  # [bk/G or 1, bn]
        rows_per_group = bk // groups_per_tile
        s = jnp.broadcast_to(s[:, None, :], (groups_per_tile, rows_per_group, bn)).reshape(bk, bn)
        z = jnp.broadcast_to(z[:, None, :], (groups_per_tile, rows_per_group, bn)).reshape(bk, bn)
        w = ((q - z).astype(jnp.float32) * s).astype(x_ref.dtype)  # [bk, bn] dequantized tile
        x = x_ref[:, pl.ds(k0, bk)]  # [bm, bk]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)  # [bm, bn]

    out_ref[...] = lax.fori_loop(0, count, body, jnp.zeros((bm, bn), jnp.float32))


# ----------------------------------------------------------------------------- pallas_call


def _int4_pallas_call(
    x: jax.Array,  # [m_pad, K]
    packed: jax.Array,  # [K/8, n_pad] uint32
    scales: jax.Array,  # [K/G, n_pad]
    zeros: jax.Array,  # [K/G, n_pad] int32
    *,
    plan: TilePlan,
    group: int,
    sizes: MatmulBlockSizes,
    interpret: bool,
) -> jax.Array:  # [splits, m_pad, n_pad] float32
    k = x.shape[1]
    bm, bn = plan.block_m, plan.block_n
    return pl.pallas_call(
        functools.partial(_int4_kernel, plan=plan, group=group),
        out_shape=jax.ShapeDtypeStruct((plan.splits, plan.m_pad, plan.n_pad), jnp.float32),
        grid=plan.grid,
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j, s: (i, 0)),
            pl.BlockSpec((k // 8, bn), lambda i, j, s: (0, j)),
            pl.BlockSpec((k // group, bn), lambda i, j, s: (0, j)),
            pl.BlockSpec((k // group, bn), lambda i, j, s: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        compiler_params=compiler_params(sizes),
        interpret=interpret,
        name="int4_matmul",
    )(x, packed, scales, zeros)


# ----------------------------------------------------------------------------- public op


def _check_int4_operands(x, packed, scales, zeros, group_size, perm) -> None:
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

    Returns:
      `[M, N]` in x's dtype, accumulated in float32.
    """
    _check_int4_operands(x, packed, scales, zeros, group_size, perm)
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
    partial = _int4_pallas_call(
        x, packed, scales, zeros, plan=plan, group=group_size, sizes=sizes, interpret=interpret
    )  # [splits, m_pad, n_pad] float32
    return partial.sum(axis=0)[:m, :n].astype(x.dtype)


# ----------------------------------------------------------------------------- reference


def unpack_int4(packed: jax.Array) -> jax.Array:
    """`[K/8, N]` uint32 -> `[K, N]` int32 nibbles (row 8r + j is nibble j of word r)."""
    shifts = 4 * jnp.arange(8, dtype=jnp.uint32)  # [8]
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return q.reshape(-1, packed.shape[1]).astype(jnp.int32)  # [K, N]


def pack_int4(q: jax.Array) -> jax.Array:
    """`[K, N]` integers in 0..15 -> `[K/8, N]` uint32 (inverse of `unpack_int4`)."""
    k, n = q.shape
    q = q.astype(jnp.uint32).reshape(k // 8, 8, n)  # [K/8, 8, N]
    shifts = 4 * jnp.arange(8, dtype=jnp.uint32)  # [8]
    return jnp.bitwise_or.reduce(q << shifts[None, :, None], axis=1)  # [K/8, N]


@functools.partial(jax.jit, static_argnames=("group_size",))
def int4_matmul_reference(
    x: jax.Array,
    packed: jax.Array,
    scales: jax.Array,
    zeros: jax.Array,
    *,
    group_size: int,
    perm: jax.Array | None = None,
) -> jax.Array:
    """Pure-jnp oracle: dequantize to float32 with the formula above, then `jnp.dot`.

    Args:
      x, packed, scales, zeros, group_size, perm: as in `int4_matmul`.

    Returns:
      `[M, N]` in x's dtype.
    """
    q = unpack_int4(packed)  # [K, N]
    z = jnp.repeat(zeros, group_size, axis=0)  # [K, N]
    s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)  # [K, N]
    w = (q - z).astype(jnp.float32) * s  # [K, N]
    xf = x.astype(jnp.float32)
    if perm is not None:
        xf = xf[:, perm]
    y = jnp.dot(xf, w, precision=lax.Precision.HIGHEST)  # [M, N]
    return y.astype(x.dtype)
