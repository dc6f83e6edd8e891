"""The ragged paged-attention Pallas kernel (Triton backend; `interpret=True` on CPU).

Layers: `_paged_attention_kernel` (on refs), `_paged_attention_pallas_call`, and the jitted,
validating `ragged_paged_attention`. Block sizes and the tile plan are in `blocks.py`, the oracle
in `reference.py`; the layout is described in the package docstring.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.blocks import (
    MIN_DOT,
    AttentionBlockSizes,
    AttentionPlan,
    default_attention_block_sizes,
    plan_attention,
    tile_schedule,
)
from pallas_kernels.paged_attention.reference import MASK

_QUERY_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


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
    lse_ref,  # [T, Gp] float32    partition log-sum-exp (MASK when it saw no key)
    *,
    plan: AttentionPlan,
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
        s = jnp.where(mask, s, MASK)
        m_new = jnp.maximum(m, s.max(axis=1))  # [R]
        alpha = jnp.exp(m - m_new)  # [R]
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # [R, bkv]
        l = alpha * l + p.sum(axis=1)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, D]
        return m_new, l, alpha[:, None] * acc + pv

    init = (
        jnp.full((rows,), MASK, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, num_steps, body, init)
    seen = l > 0.0  # [R]; false for a partition outside this tile's key range
    out = acc / jnp.where(seen, l, 1.0)[:, None]  # [R, D]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), MASK)  # [R]

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
    plan: AttentionPlan,
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
    if d < MIN_DOT or d & (d - 1):
        raise ValueError(f"head_dim={d}; the kernel expects a power of two >= {MIN_DOT}")
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
    plan = plan_attention(t, b, kv_heads, group, block_size, max_blocks, sizes)

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
