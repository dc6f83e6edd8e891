"""Pallas kernels under tensor parallelism: `shard_map` over heads.

XLA partitions ordinary ops by itself, but a `pallas_call` is a custom call it cannot split: on
sharded inputs it would gather every head onto every device first. Under a TP mesh context
(`jax.set_mesh(tp_mesh(cfg, n))`, which `ji.generate(mesh=...)` enters) the attention op instead
runs the kernel per device on its own heads: query heads split over the whole group, pages over
`kv` (one KV head per device once the degree passes K), metadata replicated. Attention needs no
communication across heads, so the wrapper adds no collective.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.distributed.sharding import MESH_AXES, TP


def context_tp_mesh():
    """The abstract TP mesh of the current `jax.set_mesh` context, or None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or tuple(mesh.axis_names) != MESH_AXES or mesh.size == 1:
        return None
    return mesh


def attention_over_heads(
    fn: Callable,
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    query_start: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    layer=None,
    **kw,
) -> jax.Array:
    """`fn(q, k_pages, ..., **kw)` (a paged-attention op), per device on its heads under a TP mesh.

    Args:
      fn: the op, with `paged_attention`'s arguments (`q [T, H, D]`, pages `[(L,) nb, K, S, D]`).
      layer: None or a scalar layer index (pages then carry the leading L axis).

    Returns:
      `[T, H, D]`, split over heads like q; `fn(...)` itself outside a TP mesh context.
    """
    mesh = context_tp_mesh()
    if mesh is None:
        return fn(q, k_pages, v_pages, query_start, seq_lens, block_tables,
                  k_scale=k_scale, v_scale=v_scale, layer=layer, **kw)  # fmt: skip
    lead = (None,) * (k_pages.ndim - 4)  # the L axis when the pages hold every layer
    pages = P(*lead, None, "kv", None, None)  # [(L,) nb, K, S, D]
    scales = P(*lead, None, "kv", None)  # [(L,) nb, K, S]
    layer_arr = None if layer is None else jnp.asarray(layer, jnp.int32)

    def local(q, kp, vp, qs, sl, bt, ks, vs, li):
        return fn(q, kp, vp, qs, sl, bt, k_scale=ks, v_scale=vs, layer=li, **kw)

    in_specs = (
        P(None, TP, None), pages, pages, P(), P(), P(),
        None if k_scale is None else scales,
        None if v_scale is None else scales,
        None if layer is None else P(),
    )  # fmt: skip
    return jax.shard_map(
        local, mesh=mesh, in_specs=in_specs, out_specs=P(None, TP, None), check_vma=False
    )(q, k_pages, v_pages, query_start, seq_lens, block_tables, k_scale, v_scale, layer_arr)
