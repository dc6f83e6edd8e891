"""Ragged paged attention: one op for decode, verification and chunked prefill, in any mix.

Inputs (one layer):
  q             [T, H, D]               flat ragged batch of queries
  k/v_pages     [num_blocks, K, S, D]   paged KV cache (K kv heads, S tokens per block)
  query_start   [B+1] int32             sequence b owns query rows query_start[b]:query_start[b+1]
  seq_lens      [B] int32               context length of sequence b, its own queries included
  block_tables  [B, M] int32            logical block j of sequence b is physical block [b, j]
  k/v_scale     [num_blocks, K, S] f32  optional per-(token, head) scales of int8 / fp8 pages
or, with a scalar `layer`, every layer's pages `[L, num_blocks, K, S, D]` (scales
`[L, num_blocks, K, S]`), of which the kernel reads layer `layer` in place. The model's layer scan
holds the cache stacked; slicing `cache.k[layer]` there and handing the slice to the kernel would
copy the whole layer's cache every layer of every step.

Semantics: query i of sequence b (q_len queries) sits at position p = seq_lens[b] - q_len + i and
attends to key positions 0..p (and >= p - sliding_window + 1 with a window); the key at
position t lives at pages[block_tables[b, t // S], kv_head, t % S]; query head h uses kv head
h // (H / K); softmax in float32 with scale 1/sqrt(D). Slots beyond a sequence's context (and
whole unused blocks) may hold NaN, so every masked value is removed with `where`, never by a
multiplication with zero. Rows of q beyond query_start[B] are padding: their output is 0.

How the kernel is laid out (grid = (query tiles, kv heads, KV partitions)):
  * Query tiles. The host-side wrapper cuts each sequence's queries into tiles of `bq` tokens
    (`tile_schedule`, plain jnp) and hands the kernel, per tile, its sequence and first query
    as ordinary int32 inputs: Triton has no scalar prefetch, so all metadata (tile schedule,
    query_start, seq_lens, block_tables, layer) is read inside the kernel from ordinary refs.
  * GQA. A program owns one kv head and all its G = H / K query heads: the tile is
    bq tokens x G heads = `block_rows` rows, so each page is read once per tile, not G times.
  * Flash-decoding. The context is split into partitions of whole `block_kv` steps; each
    program runs an online softmax over its partition and writes its output (normalized by its
    own softmax sum) and log-sum-exp; `_combine_partitions` merges the partitions. At batch 1
    decode this is what gives the GPU enough programs.

Four layers: `_paged_attention_kernel` (on refs), `_paged_attention_pallas_call`, the jitted
`ragged_paged_attention` (validates inputs), and `ragged_paged_attention_reference` (pure jnp,
the kernel's test oracle). Written for the Pallas Triton backend: power-of-two loads, dots of at
least 16 x 16 x 16, masked `plgpu.load` / `plgpu.store`; on CPU it runs with `interpret=True`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: masked rows never produce inf - inf
_MIN_DOT = 16  # Triton's dot needs every dimension >= 16
_QUERY_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


# ----------------------------------------------------------------------------- block sizes


@dataclasses.dataclass(frozen=True)
class AttentionBlockSizes:
    """Tile sizes of the paged-attention kernel (powers of two)."""

    block_rows: int = 16  # query rows per program = tokens x query heads of one kv head; >= 16
    block_kv: int = 64  # keys per inner step; rounded up to a whole number of pages
    num_partitions: int | None = None  # KV partitions per sequence; None: from target_programs
    target_programs: int = 1024  # partitions are added until the grid has about this many
    num_warps: int = 4  # Triton launch parameters, ignored in interpret mode
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_rows", "block_kv"):
            value = getattr(self, name)
            if value < _MIN_DOT or value & (value - 1):
                raise ValueError(f"{name}={value}; expected a power of two >= {_MIN_DOT}")
        if self.num_partitions is not None and self.num_partitions < 1:
            raise ValueError(f"num_partitions={self.num_partitions}; expected >= 1 or None")


# Defaults keyed on the mean query length ceil(T / B): decode (1), verification / short chunks,
# prefill. Decode is bound by reading pages; prefill by the dots, which want taller query tiles.
ATTENTION_BLOCK_TABLE: tuple[tuple[int, AttentionBlockSizes], ...] = (
    (1, AttentionBlockSizes(block_rows=16, block_kv=64)),
    (32, AttentionBlockSizes(block_rows=32, block_kv=64)),
    (2**62, AttentionBlockSizes(block_rows=64, block_kv=64, num_warps=8)),
)


def default_attention_block_sizes(
    num_tokens: int, num_seqs: int, head_dim: int = 128
) -> AttentionBlockSizes:
    """The table entry for a batch of `num_tokens` query rows over `num_seqs` sequences.

    Args:
      num_tokens: T, rows of q (padding included).
      num_seqs: B, sequences (padding included).
      head_dim: D. The table is sized for D <= 128; above that the key tile shrinks so that
        block_kv x D stays at most 64 x 128 (at D = 256 the 64-key tiles spill registers on
        sm_90: experiments/kernel_compile_check.py).

    Returns:
      The `AttentionBlockSizes` of the smallest mean-query-length class that holds T / B.
    """
    mean_q = -(-num_tokens // max(num_seqs, 1))
    last = ATTENTION_BLOCK_TABLE[-1][1]
    sizes = next((s for max_q, s in ATTENTION_BLOCK_TABLE if mean_q <= max_q), last)
    if head_dim > 128:
        block_kv = max(_MIN_DOT, sizes.block_kv * 128 // _next_pow2(head_dim))
        sizes = dataclasses.replace(sizes, block_kv=block_kv)
    return sizes


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static tiling of one call."""

    group_pad: int  # Gp: query heads per kv head, padded to a power of two
    tile_tokens: int  # bq: tokens per query tile; bq * Gp = rows of a tile
    num_tiles: int  # upper bound on the number of query tiles
    block_kv: int  # keys per step (a whole number of pages)
    partition_tokens: int  # keys per partition (a whole number of steps)
    num_partitions: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _plan(t, b, kv_heads, group, block_size, max_blocks, sizes: AttentionBlockSizes) -> _Plan:
    group_pad = _next_pow2(group)
    tile_tokens = max(1, sizes.block_rows // group_pad)
    # sum_b ceil(q_len_b / bq) <= (T + B (bq - 1)) / bq, and a tile holds at least one query.
    num_tiles = max(1, min(t, (t + b * (tile_tokens - 1)) // tile_tokens))
    block_kv = max(sizes.block_kv, block_size)
    context = max_blocks * block_size  # longest context a block table can address
    steps = -(-context // block_kv)
    parts = sizes.num_partitions
    if parts is None:
        parts = -(-sizes.target_programs // (num_tiles * kv_heads))
    parts = max(1, min(parts, steps))
    steps_per_part = -(-steps // parts)
    parts = -(-steps // steps_per_part)  # no partition without work
    return _Plan(group_pad, tile_tokens, num_tiles, block_kv, steps_per_part * block_kv, parts)


# ----------------------------------------------------------------------------- kernel


def _paged_attention_kernel(
    # metadata: ordinary inputs, read inside the kernel (no scalar prefetch on Triton)
    tile_seq_ref,  # [NT] int32     sequence of each query tile
    tile_q0_ref,  # [NT] int32      first query of the tile, counted within its sequence
    query_start_ref,  # [B+1] int32
    seq_lens_ref,  # [B] int32
    block_tables_ref,  # [B, M] int32
    layer_ref,  # [1] int32 layer to read, or None for one layer's pages
    # tensors (kv head axis squeezed by the BlockSpecs; [L] leads the pages with layer_ref)
    q_ref,  # [T, Gp, D]
    k_ref,  # [num_blocks, S, D] or [L, num_blocks, S, D]
    v_ref,  # [num_blocks, S, D] or [L, num_blocks, S, D]
    k_scale_ref,  # [num_blocks, S] or [L, num_blocks, S] float32, or None
    v_scale_ref,  # [num_blocks, S] or [L, num_blocks, S] float32, or None
    # outputs of this (kv head, partition)
    o_ref,  # [T, Gp, D] float32  partition output, normalized by its own softmax sum
    lse_ref,  # [T, Gp] float32    partition log-sum-exp (_MASK when it saw no key)
    *,
    plan: _Plan,
    sliding_window: int | None,
):
    tile, part = pl.program_id(0), pl.program_id(2)
    bq, gp, bkv = plan.tile_tokens, plan.group_pad, plan.block_kv
    rows = bq * gp
    head_dim = q_ref.shape[-1]
    block_size = k_ref.shape[-2]
    max_blocks = block_tables_ref.shape[1]
    pages_per_step = bkv // block_size

    # Which queries this tile holds.
    seq = tile_seq_ref[tile]
    q0 = tile_q0_ref[tile]
    first_row = query_start_ref[seq] + q0  # flat row of the tile's first query
    q_len = query_start_ref[seq + 1] - query_start_ref[seq]
    seq_len = seq_lens_ref[seq]
    n_live = jnp.clip(q_len - q0, 0, bq)  # live queries in the tile (0 for an empty tile)
    pos0 = seq_len - q_len + q0  # absolute position of the tile's first query

    token = lax.broadcasted_iota(jnp.int32, (rows,), 0) // gp  # [R] token of each row
    pos = pos0 + token  # [R] absolute query positions
    live3 = lax.broadcasted_iota(jnp.int32, (bq, gp, head_dim), 0) < n_live  # [bq, Gp, D]
    q = plgpu.load(q_ref.at[pl.ds(first_row, bq)], mask=live3, other=0)  # [bq, Gp, D]
    q = q.reshape(rows, head_dim)  # [R, D]

    # Keys this program visits: its partition, cut to the tile's causal (and window) range.
    hi = jnp.where(n_live > 0, pos0 + n_live, 0)  # one past the last query's position
    lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    start = jnp.maximum(part * plan.partition_tokens, (lo // bkv) * bkv)  # step-aligned
    end = jnp.minimum((part + 1) * plan.partition_tokens, hi)
    num_steps = (jnp.maximum(end - start, 0) + bkv - 1) // bkv

    layer = None if layer_ref is None else layer_ref[0]

    def load_pages(pages_ref, scale_ref, phys, live):  # -> [bkv, D] in q's dtype
        idx = phys if layer is None else (layer, phys)  # straight from the stacked cache
        x = pages_ref[idx].reshape(bkv, head_dim)  # [pages, S, D] gathered -> [bkv, D]
        if scale_ref is not None:  # int8 / fp8: dequantize in float32
            x = x.astype(jnp.float32) * scale_ref[idx].reshape(bkv, 1)
        return jnp.where(live[:, None], x.astype(q.dtype), 0)  # NaN-free outside the context

    def body(step, carry):
        m, l, acc = carry  # [R], [R], [R, D] float32
        t0 = start + step * bkv
        logical = t0 // block_size + lax.broadcasted_iota(jnp.int32, (pages_per_step,), 0)
        phys = plgpu.load(
            block_tables_ref.at[seq, pl.ds(t0 // block_size, pages_per_step)],
            mask=logical < max_blocks,
            other=0,
        )  # [pages]
        phys = jnp.where(logical * block_size < seq_len, phys, 0)  # unused entries may be junk
        key_pos = t0 + lax.broadcasted_iota(jnp.int32, (bkv,), 0)  # [bkv]
        key_live = key_pos < seq_len  # [bkv]
        k = load_pages(k_ref, k_scale_ref, phys, key_live)  # [bkv, D]
        v = load_pages(v_ref, v_scale_ref, phys, key_live)  # [bkv, D]

        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * (1.0 / math.sqrt(head_dim))  # [R, bkv]
        mask = key_live[None, :] & (key_pos[None, :] <= pos[:, None])  # [R, bkv]
        if sliding_window is not None:
            mask &= key_pos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(mask, s, _MASK)
        m_new = jnp.maximum(m, s.max(axis=1))  # [R]
        alpha = jnp.exp(m - m_new)  # [R]
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # [R, bkv]
        l = alpha * l + p.sum(axis=1)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, D]
        return m_new, l, alpha[:, None] * acc + pv

    init = (
        jnp.full((rows,), _MASK, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, num_steps, body, init)
    seen = l > 0.0  # [R]; false for a partition outside this tile's key range
    out = acc / jnp.where(seen, l, 1.0)[:, None]  # [R, D]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), _MASK)  # [R]

    plgpu.store(o_ref.at[pl.ds(first_row, bq)], out.reshape(bq, gp, head_dim), mask=live3)
    live2 = lax.broadcasted_iota(jnp.int32, (bq, gp), 0) < n_live  # [bq, Gp]
    plgpu.store(lse_ref.at[pl.ds(first_row, bq)], lse.reshape(bq, gp), mask=live2)


# ----------------------------------------------------------------------------- pallas_call


def _paged_attention_pallas_call(
    tile_seq,  # [NT] int32
    tile_q0,  # [NT] int32
    query_start,  # [B+1] int32
    seq_lens,  # [B] int32
    block_tables,  # [B, M] int32
    layer,  # [1] int32 or None
    q,  # [T, K, Gp, D]
    k_pages,  # [num_blocks, K, S, D], or [L, num_blocks, K, S, D] with layer
    v_pages,  # same as k_pages
    k_scale,  # k_pages' shape without D, float32; or None
    v_scale,  # same as k_scale
    *,
    plan: _Plan,
    sliding_window: int | None,
    sizes: AttentionBlockSizes,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:  # [P, T, K, Gp, D], [P, T, K, Gp] float32
    t, kv_heads, gp, d = q.shape
    block_size = k_pages.shape[-2]
    lead = k_pages.shape[:-3]  # (num_blocks,) or (L, num_blocks): whole in every program
    zeros = (0,) * len(lead)

    def whole(x):  # the whole (small) array in every program
        return pl.BlockSpec(x.shape, lambda i, h, p: (0,) * x.ndim)

    pages_spec = pl.BlockSpec((*lead, None, block_size, d), lambda i, h, p: (*zeros, h, 0, 0))
    scale_spec = pl.BlockSpec((*lead, None, block_size), lambda i, h, p: (*zeros, h, 0))
    grid = (plan.num_tiles, kv_heads, plan.num_partitions)
    return pl.pallas_call(
        functools.partial(_paged_attention_kernel, plan=plan, sliding_window=sliding_window),
        out_shape=(
            jax.ShapeDtypeStruct((plan.num_partitions, t, kv_heads, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((plan.num_partitions, t, kv_heads, gp), jnp.float32),
        ),
        grid=grid,
        in_specs=[
            whole(tile_seq),
            whole(tile_q0),
            whole(query_start),
            whole(seq_lens),
            whole(block_tables),
            None if layer is None else whole(layer),
            pl.BlockSpec((t, None, gp, d), lambda i, h, p: (0, h, 0, 0)),
            pages_spec,
            pages_spec,
            None if k_scale is None else scale_spec,
            None if v_scale is None else scale_spec,
        ],
        out_specs=(
            pl.BlockSpec((None, t, None, gp, d), lambda i, h, p: (p, 0, h, 0, 0)),
            pl.BlockSpec((None, t, None, gp), lambda i, h, p: (p, 0, h, 0)),
        ),
        compiler_params=plgpu.CompilerParams(
            num_warps=sizes.num_warps, num_stages=sizes.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        tile_seq, tile_q0, query_start, seq_lens, block_tables, layer, q, k_pages, v_pages,
        k_scale, v_scale,
    )  # fmt: skip


def tile_schedule(query_start: jax.Array, num_tiles: int, tile_tokens: int):
    """Cuts each sequence's queries into tiles of `tile_tokens`: (seq, first query) per tile.

    Tiles past the last one are empty: they point at the end of the last sequence.
    """
    b = query_start.shape[0] - 1
    q_lens = query_start[1:] - query_start[:-1]  # [B]
    tiles = (q_lens + tile_tokens - 1) // tile_tokens  # [B]
    ends = jnp.cumsum(tiles)  # [B] one past each sequence's last tile
    t = jnp.arange(num_tiles, dtype=jnp.int32)  # [NT]
    seq = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)  # [NT]
    live = seq < b
    seq = jnp.minimum(seq, b - 1)
    q0 = (t - (ends[seq] - tiles[seq])) * tile_tokens  # [NT]
    q0 = jnp.where(live, q0, q_lens[seq]).astype(jnp.int32)
    return seq, q0


def _combine_partitions(o: jax.Array, lse: jax.Array) -> jax.Array:
    """Merges partition outputs `[P, ...,  D]` weighted by their log-sum-exps `[P, ...]`."""
    if o.shape[0] == 1:
        return o[0]
    w = jnp.exp(lse - lse.max(axis=0, keepdims=True))  # [P, ...]; 1 for the largest
    return (w[..., None] * o).sum(axis=0) / w.sum(axis=0)[..., None]


# ----------------------------------------------------------------------------- public op


def _resolve_layer(layer, num_layers: int) -> jax.Array:
    """jnp's rule for a traced index (negative counts from the end, then clamp): the kernel
    reads the layer `pages[layer]` would, and never outside the cache."""
    layer = jnp.asarray(layer, jnp.int32)
    return jnp.clip(jnp.where(layer < 0, layer + num_layers, layer), 0, num_layers - 1)


def _check_layer(layer):
    if layer is None:
        return
    if jnp.ndim(layer) != 0:
        raise ValueError(f"layer has shape {jnp.shape(layer)}; expected a scalar integer or None")
    dtype = jnp.result_type(layer)
    if not jnp.issubdtype(dtype, jnp.integer):  # bool included: it is no layer index
        raise ValueError(f"layer has dtype {dtype}; expected a scalar integer or None")


def _check_inputs(q, k_pages, v_pages, query_start, seq_lens, block_tables, window, ks, vs, layer):
    if q.ndim != 3 or q.dtype not in _QUERY_DTYPES:
        raise ValueError(f"q has shape {q.shape}, dtype {q.dtype}; expected float [T, H, D]")
    t, h, d = q.shape
    _check_layer(layer)
    stacked = layer is not None  # pages of every layer, [L] in front
    layout = "[L, num_blocks, K, S, D] (layer given)" if stacked else "[num_blocks, K, S, D]"
    if k_pages.ndim != 4 + stacked or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages {k_pages.shape} and v_pages {v_pages.shape}; expected equal shapes {layout}"
        )
    lead = k_pages.shape[:-3]  # (num_blocks,) or (L, num_blocks)
    kv_heads, block_size, d_k = k_pages.shape[-3:]
    if d_k != d:
        raise ValueError(f"pages have head_dim {d_k}; expected q's head_dim {d}")
    if d < _MIN_DOT or d & (d - 1):
        raise ValueError(f"head_dim={d}; the kernel expects a power of two >= {_MIN_DOT}")
    if block_size & (block_size - 1):
        raise ValueError(f"block size S={block_size}; expected a power of two")
    if h % kv_heads:
        raise ValueError(f"H={h} query heads is not a multiple of K={kv_heads} kv heads")
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not (pages.dtype in _QUANT_DTYPES or pages.dtype in _QUERY_DTYPES):
            raise ValueError(
                f"{name} has dtype {pages.dtype}; expected float32/bfloat16/float16, int8 or "
                "float8_e4m3fn"
            )
    if (ks is None) != (vs is None):
        raise ValueError("k_scale and v_scale must be given together")
    if ks is None and k_pages.dtype == jnp.int8:
        raise ValueError("int8 pages need k_scale and v_scale")
    scale_shape = (*lead, kv_heads, block_size)  # [(L,) num_blocks, K, S]
    for name, scale in (("k_scale", ks), ("v_scale", vs)):
        if scale is not None and (scale.shape != scale_shape or scale.dtype != jnp.float32):
            raise ValueError(
                f"{name} has shape {scale.shape}, dtype {scale.dtype}; expected float32 "
                f"{scale_shape}"
            )
    if block_tables.ndim != 2 or 0 in block_tables.shape:
        raise ValueError(f"block_tables has shape {block_tables.shape}; expected [B, M], B, M >= 1")
    b = block_tables.shape[0]
    for name, arr, shape in (
        ("query_start", query_start, (b + 1,)),
        ("seq_lens", seq_lens, (b,)),
        ("block_tables", block_tables, block_tables.shape),
    ):
        if arr.shape != shape or arr.dtype != jnp.int32:
            raise ValueError(
                f"{name} has shape {arr.shape}, dtype {arr.dtype}; expected int32 {shape}"
            )
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window={window!r}; expected a positive int or None")


@functools.partial(jax.jit, static_argnames=("sliding_window", "block_sizes", "interpret"))
def ragged_paged_attention(
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
    block_sizes: AttentionBlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of a flat ragged batch of queries over a paged KV cache.

    Args:
      q: `[T, H, D]` queries (float32, bfloat16 or float16).
      k_pages, v_pages: `[num_blocks, K, S, D]` one layer's pages, or `[L, num_blocks, K, S, D]`
        every layer's with `layer`; float, or int8 / float8_e4m3fn with scales. S and D powers
        of two, D >= 16.
      query_start: `[B+1]` int32 row offsets of each sequence's queries (non-decreasing).
      seq_lens: `[B]` int32 context length of each sequence, its queries included.
      block_tables: `[B, M]` int32 physical block of each logical block.
      sliding_window: attend only to the last `sliding_window` positions (self included).
      k_scale, v_scale: `[num_blocks, K, S]` (`[L, num_blocks, K, S]` with `layer`) float32
        per-(token, head) scales.
      layer: optional scalar integer (traced is fine): the pages and scales hold every layer and
        the kernel reads layer `layer` in place, never copying it out. Like a block id it cannot
        be range-checked when traced; it is resolved as `k_pages[layer]` would be (negative counts
        from the end, out of range clamps), so it never reads outside the cache.
      block_sizes: tile sizes; default from `default_attention_block_sizes(T, B, D)`.
      interpret: run the kernel in the Pallas interpreter (CPU).

    Returns:
      `[T, H, D]` in q's dtype; rows beyond query_start[B] are 0.
    """
    _check_inputs(
        q, k_pages, v_pages, query_start, seq_lens, block_tables, sliding_window, k_scale, v_scale,
        layer,
    )  # fmt: skip
    t, h, d = q.shape
    kv_heads, block_size = k_pages.shape[-3], k_pages.shape[-2]
    b, max_blocks = block_tables.shape
    if layer is not None:
        layer = _resolve_layer(layer, k_pages.shape[0]).reshape(1)  # [1] int32
    group = h // kv_heads
    sizes = block_sizes or default_attention_block_sizes(t, b, d)
    plan = _plan(t, b, kv_heads, group, block_size, max_blocks, sizes)

    qg = q.reshape(t, kv_heads, group, d)  # [T, K, G, D]: a kv head's query heads side by side
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, plan.group_pad - group), (0, 0)))  # [T, K, Gp, D]
    tile_seq, tile_q0 = tile_schedule(query_start, plan.num_tiles, plan.tile_tokens)
    o, lse = _paged_attention_pallas_call(
        tile_seq, tile_q0, query_start, seq_lens, block_tables, layer, qg, k_pages, v_pages,
        k_scale, v_scale, plan=plan, sliding_window=sliding_window, sizes=sizes,
        interpret=interpret,
    )  # fmt: skip
    out = _combine_partitions(o, lse)[:, :, :group]  # [T, K, G, D]
    live = jnp.arange(t) < query_start[b]  # rows no tile wrote hold garbage
    out = jnp.where(live[:, None, None, None], out, 0.0)
    return out.reshape(t, h, d).astype(q.dtype)


# ----------------------------------------------------------------------------- reference


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
    s = jnp.where(mask[:, None, None, :], s, _MASK)  # [T, K, G, C]
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("tkgc,tkcd->tkgd", p, vt, precision=lax.Precision.HIGHEST)  # [T, K, G, D]
    out = jnp.where(live_row[:, None, None, None], out, 0.0)
    return out.reshape(t, h, d).astype(q.dtype)
