"""int8 weight matmuls: W8A16 (`int8_matmul`) and W8A8 (`int8_int8_matmul`, SmoothQuant).

  W8A16  x [M, K] float, w [K, N] int8, w_scales [N] float (per output channel)
         y = (x @ w) * w_scales[None, :]                                  float32 accumulation
  W8A8   x [M, K] int8 with x_scales [M] (per token, dynamic), w [K, N] int8 with w_scales [N]
         y = (x @ w as int32) * x_scales[:, None] * w_scales[None, :]      exact int32 accumulation

A per-output-channel (and per-token) scale is constant along K, so it is applied once, after the
K reduction, instead of on every tile: mathematically the same as dequantizing the weight. Tiling,
split-K and the block-size table are shared with `int4_matmul` (`pallas_kernels/tiling.py`);
each kernel writes a partial sum per K split (float32 or int32) and the op sums the splits (exact
for int32) and scales.

Layers: `_int8_kernel` (both variants; the dot's accumulator type is the only difference),
`_int8_pallas_call`, the jitted public ops, and the pure-jnp references.
"""

from pallas_kernels.int8_matmul.reference import int8_int8_matmul_reference, int8_matmul_reference

_KERNEL_NAMES = ("int8_matmul", "int8_int8_matmul")


def __getattr__(name):
    # The kernel module imports Pallas: it loads on first use of a kernel name (see int4_matmul).
    if name in _KERNEL_NAMES:
        from pallas_kernels.int8_matmul import kernel

        return getattr(kernel, name)
    raise AttributeError(f"module 'pallas_kernels.int8_matmul' has no attribute {name!r}")


__all__ = ["int8_int8_matmul", "int8_int8_matmul_reference", "int8_matmul", "int8_matmul_reference"]
