"""`score`: logits of whole sequences with no cache (the dense forward, jitted)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.decoder import forward_dense
from jaxinfer.model.params import check_params
from jaxinfer.ops.backend import resolve_backend


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def _score(params, tokens, cfg, backend):
    return forward_dense(params, cfg, tokens, backend=backend)


def score(cfg: ModelConfig, params: dict, tokens) -> jax.Array:
    """Logits of every position.

    Args:
      cfg: model config.
      params: params pytree.
      tokens: `[B, S]` int token ids (every row starts at position 0).

    Returns:
      `[B, S, V]` float32 logits. Raises ValueError for a bad shape or out-of-vocabulary id.
    """
    ragged = isinstance(tokens, list | tuple)  # arrays are rectangular by construction
    lengths = sorted({len(r) for r in tokens if hasattr(r, "__len__")}) if ragged else []
    if len(lengths) > 1:
        raise ValueError(
            f"tokens must be a rectangular [B, S] array; got rows of lengths {lengths} "
            "(score equal-length rows together, or one row per call)"
        )
    check_params(cfg, params)
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.size == 0:
        raise ValueError(f"tokens must be a non-empty [B, S] int array, got {tokens.shape}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(
            f"token id {lo if lo < 0 else hi} outside the vocabulary [0, {cfg.vocab_size})"
        )
    if tokens.shape[1] > cfg.max_position_embeddings:
        raise ValueError(
            f"sequence length {tokens.shape[1]} exceeds max_position_embeddings "
            f"{cfg.max_position_embeddings}"
        )
    # forward_dense's default "auto", resolved here on the host: nothing traced reads the platform
    return _score(params, tokens.astype(jnp.int32), cfg, resolve_backend("auto"))
