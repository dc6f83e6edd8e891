"""Pure-jnp oracle of the ragged paged attention (no Pallas): the semantics of the package
docstring, computed by gathering each sequence's pages to dense. Every kernel and the XLA path of
`jaxinfer.ops` are tested against it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: masked rows never produce inf - inf


@functools.partial(jax.jit, static_argnames=("sliding_window",))
def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    query_start: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    *,
    sliding_window: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Pure-jnp oracle: gathers each sequence's pages to dense, masks, softmax in float32.

    Args:
      q, k_pages, v_pages, query_start, seq_lens, block_tables, sliding_window, k_scale,
        v_scale, layer: as in `ragged_paged_attention` (with `layer`, it takes the slice).

    Returns:
      `[T, H, D]` in q's dtype; rows beyond query_start[B] are 0.
    """
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
        k_scale = None if k_scale is None else k_scale[layer]
        v_scale = None if v_scale is None else v_scale[layer]
    t, h, d = q.shape
    _, kv_heads, block_size, _ = k_pages.shape
    b, max_blocks = block_tables.shape
    context = max_blocks * block_size

    def dense(pages, scale):  # -> [B, K, C, D] float32, each sequence's context in order
        x = pages[block_tables].astype(jnp.float32)  # [B, M, K, S, D]
        if scale is not None:
            x = x * scale[block_tables][..., None]
        return x.transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, context, d)

    k, v = dense(k_pages, k_scale), dense(v_pages, v_scale)
    row = jnp.arange(t)
    seq = jnp.clip(jnp.searchsorted(query_start, row, side="right") - 1, 0, b - 1)  # [T]
    live_row = row < query_start[b]  # [T]
    q_len = query_start[seq + 1] - query_start[seq]
    pos = seq_lens[seq] - q_len + (row - query_start[seq])  # [T] absolute positions
    key = jnp.arange(context)  # [C]
    mask = (key[None, :] <= pos[:, None]) & (key[None, :] < seq_lens[seq][:, None])  # [T, C]
    if sliding_window is not None:
        mask &= key[None, :] > pos[:, None] - sliding_window
    mask &= live_row[:, None]

    qf = q.astype(jnp.float32).reshape(t, kv_heads, h // kv_heads, d)  # [T, K, G, D]
    kt = jnp.where(mask[:, None, :, None], k[seq], 0.0)  # [T, K, C, D]
    vt = jnp.where(mask[:, None, :, None], v[seq], 0.0)
    s = jnp.einsum("tkgd,tkcd->tkgc", qf, kt, precision=lax.Precision.HIGHEST) / math.sqrt(d)
    s = jnp.where(mask[:, None, None, :], s, MASK)  # [T, K, G, C]
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("tkgc,tkcd->tkgd", p, vt, precision=lax.Precision.HIGHEST)  # [T, K, G, D]
    out = jnp.where(live_row[:, None, None, None], out, 0.0)
    return out.reshape(t, h, d).astype(q.dtype)
