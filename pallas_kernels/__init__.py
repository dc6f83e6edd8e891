"""Pallas kernels for quantized matmuls and ragged paged attention.

One package per kernel, each with a Pallas-free `reference.py` (the pure-jnp oracle), its
`kernel.py` (kernel body on refs, the `pl.pallas_call` wrapper, the jitted public op that
validates its inputs) and its block sizes as data:

  int4_matmul/      grouped int4 W4A16; `reference.py` also owns the int4 nibble layout
  int8_matmul/      int8 W8A16 and W8A8
  paged_attention/  ragged paged attention; block sizes and the tile plan in `blocks.py`
  tiling.py         block sizes and tile plans shared by the two matmuls (no Pallas)
  split_k.py        the Pallas side of their split-K scheme
  testing.py        fixtures shared by the tests and the benchmarks

Each package exports its reference and block sizes eagerly and its kernel on first use, so
importing a reference never imports Pallas. The kernels target the Pallas Triton backend on
NVIDIA GPUs and run on CPU with `interpret=True`. This package never imports `jaxinfer`.
"""
