"""Attention ops: the reference implementations and the backend dispatch.

`paged_attention` is the one op that serves decode, verification and chunked prefill over the
ragged batch of `BatchMetadata`; `dense_causal_attention` serves `forward_dense`. The reference
here defines the semantics (DESIGN.md): query i of sequence b sits at position
p = seq_lens[b] - q_len_b + i and attends to keys 0..p (and > p - window with a sliding window),
GQA by head grouping, softmax in float32 with scale 1/sqrt(D). Slots outside the live context may
hold garbage or NaN: they are excluded with `where`, never multiplied by zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "reference", "pallas", "pallas-interpret")
_MASKED = -1e30  # finite, so a row with no live key gives zeros instead of NaN


def resolve_backend(backend: str) -> str:
    """ "auto" -> "pallas" on GPU, "reference" elsewhere; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return backend


def _dequant(pages, scale):
    if scale is None:
        return pages.astype(jnp.float32)
    return pages.astype(jnp.float32) * scale[..., None]


def paged_attention_reference(
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
) -> jax.Array:
    """Ragged paged attention, pure jnp.

    Args:
      q: `[T, H, D]` queries of a flat ragged batch.
      k_pages, v_pages: one layer's pages `[num_blocks, K, S, D]`.
      query_start: `[B+1]` row offsets of each sequence's queries.
      seq_lens: `[B]` context length of each sequence, its queries included.
      block_tables: `[B, M]` physical block of each logical block.
      sliding_window: attend only to the last `sliding_window` positions (inclusive of self).
      k_scale, v_scale: `[num_blocks, K, S]` per-(token, head) scales of quantized pages.

    Returns:
      `[T, H, D]` in q's dtype; rows outside every sequence are zero.
    """
    t, h, d = q.shape
    _, kh, s, _ = k_pages.shape
    b, m = block_tables.shape
    rows = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start[1:], rows, side="right").astype(jnp.int32)  # [T]
    live_row = rows < query_start[b]
    seq = jnp.minimum(seq, b - 1)
    q_len = query_start[seq + 1] - query_start[seq]
    pos = seq_lens[seq] - q_len + (rows - query_start[seq])  # [T] absolute query position

    table = block_tables[seq]  # [T, M]
    k = _dequant(k_pages[table], None if k_scale is None else k_scale[table])  # [T, M, K, S, D]
    v = _dequant(v_pages[table], None if v_scale is None else v_scale[table])
    k = k.transpose(0, 2, 1, 3, 4).reshape(t, kh, m * s, d)  # [T, K, C, D]
    v = v.transpose(0, 2, 1, 3, 4).reshape(t, kh, m * s, d)

    key_pos = jnp.arange(m * s, dtype=jnp.int32)  # [C]
    live = (key_pos[None, :] <= pos[:, None]) & live_row[:, None]  # [T, C]
    if sliding_window is not None:
        live &= key_pos[None, :] > pos[:, None] - sliding_window
    v = jnp.where(live[:, None, :, None], v, 0.0)

    qg = q.astype(jnp.float32).reshape(t, kh, h // kh, d)  # [T, K, H/K, D]
    scores = jnp.einsum("tkgd,tkcd->tkgc", qg, k) / jnp.sqrt(jnp.float32(d))  # [T, K, H/K, C]
    scores = jnp.where(live[:, None, None, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgc,tkcd->tkgd", probs, v)  # [T, K, H/K, D]
    out = jnp.where(live_row[:, None, None, None], out, 0.0)
    return out.reshape(t, h, d).astype(q.dtype)


def paged_attention(
    q,
    k_pages,
    v_pages,
    query_start,
    seq_lens,
    block_tables,
    *,
    sliding_window=None,
    k_scale=None,
    v_scale=None,
    backend: str = "auto",
):
    """Ragged paged attention through the chosen backend (see `paged_attention_reference`)."""
    backend = resolve_backend(backend)
    if backend == "reference":
        return paged_attention_reference(
            q, k_pages, v_pages, query_start, seq_lens, block_tables,
            sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    from pallas_kernels.paged_attention import ragged_paged_attention

    return ragged_paged_attention(
        q, k_pages, v_pages, query_start, seq_lens, block_tables,
        sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
        interpret=backend == "pallas-interpret",
    )  # fmt: skip


def dense_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, sliding_window: int | None = None
) -> jax.Array:
    """Causal attention over whole sequences: q `[B, S, H, D]`, k/v `[B, S, K, D]` -> q's shape."""
    bsz, n, h, d = q.shape
    kh = k.shape[2]
    qg = q.astype(jnp.float32).reshape(bsz, n, kh, h // kh, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k.astype(jnp.float32)) / jnp.sqrt(
        jnp.float32(d)
    )  # [B, K, H/K, S, S]
    i = jnp.arange(n)[:, None]
    j = jnp.arange(n)[None, :]
    mask = j <= i
    if sliding_window is not None:
        mask &= j > i - sliding_window
    scores = jnp.where(mask, scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v.astype(jnp.float32))
    return out.reshape(bsz, n, h, d).astype(q.dtype)
