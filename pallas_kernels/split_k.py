"""Pallas-side helpers of the split-K quantized matmul kernels (int4 and int8)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiling import MatmulBlockSizes, TilePlan


def split_k_range(plan: TilePlan) -> tuple[jax.Array, jax.Array]:
    """Inside a kernel: (first K tile, number of K tiles) of this program's split."""
    first = pl.program_id(2) * plan.tiles_per_split
    count = jnp.clip(plan.num_k_tiles - first, 0, plan.tiles_per_split)
    return first, count


def compiler_params(sizes: MatmulBlockSizes) -> plgpu.CompilerParams:
    # Passing Triton params also selects the Triton backend (the GPU default may be Mosaic GPU).
    return plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages)
