"""The attention block: projections, RoPE, cache write, attention op, output projection.

Takes the cache in and returns the new cache (gemma's `_modules.py` pattern); the dense variant
used by `forward_dense` shares the projections and RoPE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.cache.metadata import BatchMetadata
from jaxinfer.cache.paged import PagedKVCache, write_kv
from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import apply_rope
from jaxinfer.ops.attention import dense_causal_attention, paged_attention
from jaxinfer.ops.linear import linear


def project_qkv(
    h: jax.Array, lp: dict, cfg: ModelConfig, positions: jax.Array, backend: str = "auto"
):
    """`h [..., T, E]`, `positions [..., T]` -> q `[..., T, H, D]`, k, v `[..., T, K, D]`, roped."""
    lead = h.shape[:-1]
    if "wqkv" in lp:  # the CPU layout's fused projection (`model.params.cpu_layout`)
        hd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = linear(h, lp["wqkv"], lp.get("bqkv"), backend=backend)  # [..., T, (H + 2K) * D]
        q, k, v = jnp.split(qkv, [hd, hd + kd], axis=-1)
    else:
        q = linear(h, lp["wq"], lp.get("bq"), backend=backend)
        k = linear(h, lp["wk"], lp.get("bk"), backend=backend)
        v = linear(h, lp["wv"], lp.get("bv"), backend=backend)
    q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(q, positions, cfg), apply_rope(k, positions, cfg), v


def paged_attention_block(
    h: jax.Array,
    lp: dict,
    cfg: ModelConfig,
    batch: BatchMetadata,
    cache: PagedKVCache,
    layer: jax.Array,
    backend: str,
) -> tuple[jax.Array, PagedKVCache]:
    """One layer's attention over the ragged batch: `h [T, E]` -> (`[T, E]`, cache)."""
    q, k, v = project_qkv(h, lp, cfg, batch.positions, backend)  # [T,H,D], [T,K,D], [T,K,D]
    cache = write_kv(cache, layer, k, v, batch.slot_mapping)
    out = paged_attention(
        q,
        cache.k,  # [L, num_blocks, K, S, D]: the op reads layer `layer` without slicing it out
        cache.v,
        batch.query_start,
        batch.seq_lens,
        batch.block_tables,
        sliding_window=cfg.sliding_window,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        layer=layer,
        backend=backend,
        platform=cache.platform,
    )  # [T, H, D]
    t = h.shape[0]
    return linear(out.reshape(t, cfg.num_heads * cfg.head_dim), lp["wo"], backend=backend), cache


def dense_attention_heads(
    h: jax.Array, lp: dict, cfg: ModelConfig, backend: str = "auto"
) -> jax.Array:
    """Causal self-attention before the output projection: `h [B, S, E]` -> `[B, S, H*D]`."""
    bsz, n, _ = h.shape
    positions = jax.numpy.broadcast_to(jax.numpy.arange(n), (bsz, n))
    q, k, v = project_qkv(h, lp, cfg, positions, backend)
    out = dense_causal_attention(q, k, v, sliding_window=cfg.sliding_window)  # [B, S, H, D]
    return out.reshape(bsz, n, cfg.num_heads * cfg.head_dim)
