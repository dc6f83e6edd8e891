"""Grouped int4 weight-only matmul (W4A16): `y = x @ dequantize(w)` with the weight read once.

The weight uses the `Int4Weight` layout of DESIGN.md:

  packed  [K/8, N] uint32   8 consecutive input rows per word, low nibble first:
                            q[8*r + j, n] = (packed[r, n] >> 4*j) & 0xF
  scales  [K/G, N]          in the activation dtype
  zeros   [K/G, N] int32    integer zero points, 0..15
  mins    [K/G, N] | None   optional float offsets in the activation dtype (GGUF Q4_1)
  w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n] (+ mins[k // G, n])
                            (per-channel: G = K)

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
tiling (`pallas_kernels/tiling.py`) is shared with `int8_matmul`.

The kernel is written for the Pallas Triton backend (NVIDIA GPUs): every loaded tile has a
power-of-two size, every dot is at least 16 x 16 x 16, no scalar prefetch. On CPU it runs with
`interpret=True`.
"""

from pallas_kernels.int4_matmul.reference import int4_matmul_reference, pack_int4, unpack_int4
from pallas_kernels.tiling import (
    BLOCK_SIZE_TABLE,
    MatmulBlockSizes,
    TilePlan,
    default_block_sizes,
    plan_tiles,
)

_KERNEL_NAMES = ("int4_matmul",)


def __getattr__(name):
    # The kernel module imports Pallas: it loads when one of its names is first asked for, so
    # importing the reference or the tiling stays Pallas-free.
    if name in _KERNEL_NAMES:
        from pallas_kernels.int4_matmul import kernel

        return getattr(kernel, name)
    raise AttributeError(f"module 'pallas_kernels.int4_matmul' has no attribute {name!r}")


__all__ = [
    "BLOCK_SIZE_TABLE",
    "MatmulBlockSizes",
    "TilePlan",
    "default_block_sizes",
    "int4_matmul",
    "int4_matmul_reference",
    "pack_int4",
    "plan_tiles",
    "unpack_int4",
]
