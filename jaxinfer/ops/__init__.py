"""Ops the model calls; each chooses its implementation (reference jnp or a Pallas kernel)."""

from jaxinfer.ops.attention import (
    BACKENDS,
    dense_causal_attention,
    lowering_for_gpu,
    paged_attention,
    paged_attention_reference,
    resolve_backend,
)
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
