"""Tiling of the quantized matmul kernels (int4 and int8), shared by both; no Pallas.

`MatmulBlockSizes` are the tile sizes a caller may tune, `BLOCK_SIZE_TABLE` the defaults per
class of M, and `plan_tiles` resolves them against one call's (M, K, N) and group size. The
Pallas-side helpers of the split-K kernels are in `split_k.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

ACTIVATION_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_DOT = 16  # Triton's dot needs every dimension >= 16


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
            if value < MIN_DOT or value & (value - 1):
                raise ValueError(f"{name}={value}; expected a power of two >= {MIN_DOT}")
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
    while block_k >= MIN_DOT:
        # A K tile lies inside one group, or holds whole groups (then G is a power of two, as
        # block_k is, so the tile's scale rows load as one power-of-two slice).
        g = group_size or block_k
        inside_group = g % block_k == 0
        whole_groups = block_k % g == 0
        if k % block_k == 0 and (inside_group or whole_groups):
            break
        block_k //= 2
    if block_k < MIN_DOT:
        raise ValueError(
            f"K={k}, group_size={group_size}: the kernel needs a power-of-two K tile >= "
            f"{MIN_DOT} that divides K and either divides group_size or holds a power-of-two "
            "number of whole groups"
        )
    block_n = _largest_pow2_divisor(n, sizes.block_n)
    n_pad = n
    if block_n < MIN_DOT:  # odd N: pad the weight (a copy per call; real models never hit this)
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


def check_activations(x: jax.Array, name: str = "x") -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} has shape {x.shape}; expected [M, K]")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; expected one of float32, bfloat16, float16")
