"""Pallas kernels for quantized matmuls and ragged paged attention.

Each kernel module has four layers: the kernel body on refs, the `pl.pallas_call` wrapper, a
jitted public op that validates its inputs, and a pure-jnp `*_reference` (the test oracle). The
kernels target the Pallas Triton backend on NVIDIA GPUs and run on CPU with `interpret=True`.
This package never imports `jaxinfer`.
"""

# ----------------------------------------------------------------------------- quantized matmuls
from pallas_kernels.int4_matmul import (
    BLOCK_SIZE_TABLE,
    MatmulBlockSizes,
    default_block_sizes,
    int4_matmul,
    int4_matmul_reference,
    pack_int4,
    unpack_int4,
)
from pallas_kernels.int8_matmul import (
    int8_int8_matmul,
    int8_int8_matmul_reference,
    int8_matmul,
    int8_matmul_reference,
)

# ----------------------------------------------------------------------------- attention
from pallas_kernels.paged_attention import (
    ATTENTION_BLOCK_TABLE,
    AttentionBlockSizes,
    default_attention_block_sizes,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "ATTENTION_BLOCK_TABLE",
    "AttentionBlockSizes",
    "BLOCK_SIZE_TABLE",
    "MatmulBlockSizes",
    "default_attention_block_sizes",
    "default_block_sizes",
    "int4_matmul",
    "int4_matmul_reference",
    "int8_int8_matmul",
    "int8_int8_matmul_reference",
    "int8_matmul",
    "int8_matmul_reference",
    "pack_int4",
    "unpack_int4",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
