"""Attention ops: the backend dispatch, the XLA ragged paged attention, dense causal attention.

`paged_attention` is the one op that serves decode, verification and chunked prefill over the
ragged batch of `BatchMetadata`; `dense_causal_attention` serves `forward_dense`. The semantics
(DESIGN.md) are those of the oracle `paged_attention_reference` (the Pallas package's pure-jnp
reference): query i of sequence b sits at position p = seq_lens[b] - q_len_b + i and attends to
keys 0..p (and > p - window with a sliding window), GQA by head grouping, softmax in float32 with
scale 1/sqrt(D). Slots outside the live context may hold garbage or NaN: they are excluded with
`where`, never multiplied by zero.

Backends: "xla" (`paged_attention_xla`, the CPU default), "reference" (the oracle: simple, but it
gathers each query row's whole context), "pallas" (the Triton kernel, the GPU default) and
"pallas-interpret" (the kernel in interpret mode, for tests on a CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.cache.paged import take_pages
from jaxinfer.ops.backend import BACKENDS, is_pallas, resolve_backend, resolve_platform
from pallas_kernels.paged_attention.blocks import tile_schedule
from pallas_kernels.paged_attention.reference import (
    ragged_paged_attention_reference as paged_attention_reference,
)

__all__ = [
    "BACKENDS",
    "dense_causal_attention",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_xla",
    "resolve_backend",
]

_MASKED = -1e30  # finite, so a row with no live key gives zeros instead of NaN
_PAGE_COST = 4  # reading one page costs about this many query rows of arithmetic (CPU)
_KEYS_PER_CHUNK = 128  # keys per online-softmax step of paged_attention_xla
# A block table of at most this many keys is one chunk, without the loop. Measured on SmolLM2
# (one paged step, CPU, interleaved): at context 256 the one chunk of 272 keys took 0.89x the
# three-step loop's time at 8 decode rows and 0.93x at one, though it reads no fewer keys than
# the loop stops at; at context 1000 a 512-key chunk was 1.04x slower than 128-key steps.
_ONE_CHUNK_KEYS = 512


def _read_pages(pages, scale, blocks, layer, platform):
    """Pages `blocks` (of layer `layer` when given) in float32, dequantized by their scales."""
    idx = blocks if layer is None else (layer, blocks)
    x = take_pages(pages, idx, platform).astype(jnp.float32)
    return x if scale is None else x * scale[idx][..., None]


def _query_tile(num_tokens: int, num_seqs: int) -> int:
    """The static query-tile size of `paged_attention_xla` for a `[T]`-token, `[B]`-sequence batch.

    A batch of T rows over B sequences cuts into at most min(T, T // tq + B) tiles of tq rows, one
    sequence each. Each tile reads its sequence's pages once and computes tq rows against them, so
    the cost is about tiles * (c + tq) with c ~ 4 (a page read costs about four query rows of
    arithmetic on a CPU): decode batches (T ~ B) get tq = 1, prefill chunks get tiles of 8-32.
    """
    best_cost, best = num_tokens * (_PAGE_COST + 1), 1
    tq = 2
    while tq <= num_tokens:
        cost = min(num_tokens, num_tokens // tq + num_seqs) * (_PAGE_COST + tq)
        if cost < best_cost:
            best_cost, best = cost, tq
        tq *= 2
    return best


def paged_attention_xla(
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
    platform: str = "cpu",
) -> jax.Array:
    """Ragged paged attention in plain XLA, organised like the Pallas kernel.

    Same semantics and arguments as `paged_attention_reference`, but where the reference gathers
    every query row's whole context (T x C pages, quadratic for a prefill chunk), this cuts the
    rows into per-sequence tiles (`_query_tile`), walks each tile's pages in chunks of ~128 keys
    with an online softmax (flash attention), and stops at the longest live context instead of the
    padded block table. It is the CPU path; the reference stays the oracle.

    Args:
      layer: optional scalar layer index. With it, `k_pages`/`v_pages` (and the scales) hold every
        layer, `[L, num_blocks, K, S, D]`, and each chunk gathers straight from layer `layer`:
        a slice `cache.k[layer]` taken inside the model's layer scan would be copied whole into
        the chunk loop, a cost that grows with the cache, not the batch.
      platform: the pages' platform (`PagedKVCache.platform`); it only picks how float8 pages
        are indexed (`cache.paged.take_pages`: exact either way).

    Returns:
      `[T, H, D]` in q's dtype; rows outside every sequence are zero.
    """
    t, h, d = q.shape
    kh, s = k_pages.shape[-3], k_pages.shape[-2]
    b, m = block_tables.shape
    g = h // kh
    tq = _query_tile(t, b)
    nt = min(t, t // tq + b)
    mb = m if m * s <= _ONE_CHUNK_KEYS else max(1, min(m, _KEYS_PER_CHUNK // s))  # per chunk
    n_chunks_max = -(-m // mb)

    # Tiles: tile n covers rows rows[n] of sequence seq[n] (query offset q0 within it).
    seq, q0 = tile_schedule(query_start, nt, tq)  # [NT], [NT]
    q_len = query_start[1:] - query_start[:-1]  # [B]
    offs = q0[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]  # [NT, tq] query offsets
    live_row = offs < q_len[seq][:, None]  # [NT, tq]
    rows = query_start[seq][:, None] + offs  # [NT, tq]
    pos = seq_lens[seq][:, None] - q_len[seq][:, None] + offs  # [NT, tq] absolute positions
    qt = q[jnp.minimum(rows, t - 1)].astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
    qt = qt.reshape(nt, tq, kh, g, d)
    table = jnp.pad(block_tables[seq], ((0, 0), (0, n_chunks_max * mb - m)))  # [NT, M']

    def chunk(j, carry):  # online softmax over keys j*mb*S .. (j+1)*mb*S - 1
        mx, denom, acc = carry  # [NT, K, G, tq], [NT, K, G, tq], [NT, K, G, tq, D]
        blocks = jax.lax.dynamic_slice_in_dim(table, j * mb, mb, axis=1)  # [NT, mb]
        k = _read_pages(k_pages, k_scale, blocks, layer, platform)  # [NT, mb, K, S, D] float32
        v = _read_pages(v_pages, v_scale, blocks, layer, platform)
        key = j * mb * s + jnp.arange(mb * s, dtype=jnp.int32).reshape(mb, s)  # [mb, S]
        live = (key <= pos[:, :, None, None]) & live_row[:, :, None, None]  # [NT, tq, mb, S]
        if sliding_window is not None:
            live &= key > pos[:, :, None, None] - sliding_window
        v = jnp.where(jnp.any(live, axis=1)[:, :, None, :, None], v, 0.0)  # NaN-safe
        scores = jnp.einsum("nqkgd,nmksd->nkgqms", qt, k).reshape(nt, kh, g, tq, mb * s)
        live = live.reshape(nt, 1, 1, tq, mb * s)
        scores = jnp.where(live, scores, _MASKED)
        new_mx = jnp.maximum(mx, scores.max(axis=-1))
        p = jnp.where(live, jnp.exp(scores - new_mx[..., None]), 0.0)
        corr = jnp.exp(mx - new_mx)
        pv = jnp.einsum("nkgqms,nmksd->nkgqd", p.reshape(nt, kh, g, tq, mb, s), v)
        return new_mx, denom * corr + p.sum(axis=-1), acc * corr[..., None] + pv

    n_chunks = jnp.minimum((jnp.max(seq_lens) + mb * s - 1) // (mb * s), n_chunks_max)
    init = (
        jnp.full((nt, kh, g, tq), _MASKED, jnp.float32),
        jnp.zeros((nt, kh, g, tq), jnp.float32),
        jnp.zeros((nt, kh, g, tq, d), jnp.float32),
    )
    if n_chunks_max == 1:  # one chunk covers every table: no loop
        _, denom, acc = chunk(0, init)
    else:
        _, denom, acc = jax.lax.fori_loop(0, n_chunks, chunk, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # [NT, K, G, tq, D]
    out = jnp.where(live_row[:, None, None, :, None], out, 0.0)
    out = out.transpose(0, 3, 1, 2, 4).reshape(nt * tq, h, d)
    dest = jnp.where(live_row, rows, t).reshape(-1)  # dead rows go out of bounds and drop
    res = jnp.zeros((t, h, d), jnp.float32).at[dest].set(out, mode="drop")
    return res.astype(q.dtype)


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
    layer=None,
    backend: str = "auto",
    platform: str | None = None,
):
    """Ragged paged attention through the chosen backend (see `paged_attention_reference`).

    With `layer`, the pages and scales hold every layer `[L, num_blocks, ...]` and the op reads
    that layer in place (see `paged_attention_xla`); every backend takes the argument.
    `platform` is the pages' platform (`PagedKVCache.platform`, as the model passes it), used by
    the XLA path and to resolve `backend`; None: `resolve_platform()`, read here.
    """
    platform = resolve_platform(platform)
    backend = resolve_backend(backend, platform)
    args = (q, k_pages, v_pages, query_start, seq_lens, block_tables)
    kw = dict(sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, layer=layer)
    if backend == "xla":
        return paged_attention_xla(*args, **kw, platform=platform)
    if backend == "reference":
        return paged_attention_reference(*args, **kw)
    assert is_pallas(backend), backend
    # Not a cycle breaker: the Pallas backend (and Pallas itself) loads only when it is used.
    from jaxinfer.ops import pallas

    return pallas.paged_attention(*args, **kw, interpret=backend == "pallas-interpret")


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
