"""Ops the model calls; each chooses its implementation (reference jnp, XLA or a Pallas kernel).

`ops/pallas.py` holds the Pallas backend and is imported only when that backend is used.
"""

from jaxinfer.ops.attention import (
    dense_causal_attention,
    paged_attention,
    paged_attention_reference,
)
from jaxinfer.ops.backend import BACKENDS, lowering_for_gpu, resolve_backend
from jaxinfer.ops.linear import linear

__all__ = [
    "BACKENDS",
    "dense_causal_attention",
    "linear",
    "lowering_for_gpu",
    "paged_attention",
    "paged_attention_reference",
    "resolve_backend",
]
