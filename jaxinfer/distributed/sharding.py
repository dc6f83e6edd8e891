"""Tensor parallelism (Megatron-style) stated as logical axes mapped to mesh axes.

    mesh = jax.make_mesh((4,), ("tp",))          # any mesh: its devices, in order, are the TP group
    sharded = ji.shard_params(cfg, params, mesh)  # then forward / generate as before
    cache = ji.distributed.shard_cache(cfg, cache, mesh)

Every parameter axis has a logical name (`vocab`, `embed`, `heads`, `kv_heads`, `mlp`, `layers`);
`RULES` maps them to the axes of a two-axis mesh `(kv, rep)` with kv * rep = the TP degree. q/k/v
and gate/up are column-parallel (their output axis is `heads` / `kv_heads` / `mlp`, sharded), o and
down row-parallel (their input axis is sharded; XLA adds the all-reduce after them), embedding
and LM head split by vocabulary. The paged cache `[L, num_blocks, K, S, D]` is split over K.

Why two mesh axes: when the degree n exceeds the KV heads K, vLLM gives each device one KV head,
replicated on n / K devices. Here the n devices form a `(kv=K, rep=n/K)` grid; query heads are
split over both axes (n ways), KV heads over `kv` only, so device (i, j) holds query-head block
i * rep + j and KV head i, exactly the KV head those query heads read (GQA groups are contiguous).
When K >= n the grid is `(n, 1)` and everything is split n ways. The parameters keep their shapes
(no copy of wk / wv is materialised): replication is in the sharding, not in the arrays.

Quantized weights are split with their scales and zero points along the same logical axes. A
row-parallel int4 weight must give each shard whole groups (`in / n` a multiple of G): a degree
that would cut a group is refused by name, as is one that does not divide the heads.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.config import ModelConfig
from jaxinfer.qtensor import Int4Weight, Int8Weight

MESH_AXES = ("kv", "rep")  # the TP grid: kv * rep = degree; kv = min(K, degree)
TP = ("kv", "rep")  # "split over the whole TP group"

# The one table: logical axis -> mesh axes (None: replicated).
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("vocab", TP),  # embedding rows, LM-head columns, logits
    ("embed", None),  # the residual stream is replicated
    ("heads", TP),  # query heads (H * D columns of wq, rows of wo)
    ("kv_heads", "kv"),  # KV heads (K * D columns of wk / wv; the cache's K axis)
    ("mlp", TP),  # F: gate / up columns, down rows
    ("layers", None),
    ("blocks", None),
    ("block", None),
    ("head_dim", None),
)

# Logical axes of each parameter of one layer (the stacked form adds "layers" in front).
LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "wq": ("embed", "heads"),  # column-parallel
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),  # row-parallel
    "bq": ("heads",),
    "bk": ("kv_heads",),
    "bv": ("kv_heads",),
    "w_gate": ("embed", "mlp"),  # column-parallel
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),  # row-parallel
}
TOP_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
}
CACHE_AXES = ("layers", "blocks", "kv_heads", "block", "head_dim")  # k, v
CACHE_SCALE_AXES = ("layers", "blocks", "kv_heads", "block")  # k_scale, v_scale


# --------------------------------------------------------------------------------------------
# The mesh
# --------------------------------------------------------------------------------------------


def tp_grid(cfg: ModelConfig, degree: int) -> tuple[int, int]:
    """`(kv, rep)` for a TP degree, or ValueError naming the config field it does not fit.

    Args:
      cfg: the model config.
      degree: n, the number of devices in the tensor-parallel group.

    Returns:
      `(kv, rep)`, kv * rep = n: kv = n when n divides K, else kv = K (n / K replicas each).
    """
    if not isinstance(degree, int) or degree < 1:
        raise ValueError(f"tensor-parallel degree {degree!r} is invalid: expected an int >= 1")
    if cfg.num_heads % degree:
        raise ValueError(
            f"tensor-parallel degree {degree} does not divide num_heads={cfg.num_heads}"
        )
    k = cfg.num_kv_heads
    if k % degree == 0:
        return degree, 1
    if degree % k:
        raise ValueError(
            f"tensor-parallel degree {degree} neither divides nor is a multiple of "
            f"num_kv_heads={k}: KV heads can be neither split nor replicated evenly"
        )
    return k, degree // k


def tp_mesh(cfg: ModelConfig, mesh: Mesh | int) -> Mesh:
    """The `(kv, rep)` mesh over `mesh`'s devices (in order), or over the first n devices.

    Idempotent: a mesh already of this shape is returned unchanged. Axes are `Auto` so XLA's
    partitioner places the collectives (jax.make_mesh defaults to `Explicit`).
    """
    if isinstance(mesh, Mesh):
        if mesh.axis_names == MESH_AXES and mesh.devices.shape == tp_grid(cfg, mesh.size):
            return mesh
        devices = np.asarray(mesh.devices).reshape(-1)
    else:
        if mesh > len(jax.devices()):
            raise ValueError(
                f"tensor-parallel degree {mesh} exceeds the {len(jax.devices())} devices present"
            )
        devices = np.asarray(jax.devices()[:mesh])
    grid = tp_grid(cfg, int(devices.size))
    return Mesh(devices.reshape(grid), MESH_AXES, axis_types=(AxisType.Auto,) * 2)


def spec(axes: tuple[str | None, ...]) -> PartitionSpec:
    """The PartitionSpec of logical `axes` under `RULES` (flax's logical partitioning)."""
    # flax imports jax.extend, which loads Pallas: loaded on first use, so that
    # `import jaxinfer` stays free of Pallas (tests/test_structure.py).
    from flax import linen as nn

    return nn.logical_to_mesh_axes(axes, RULES)


def _shards(mesh: Mesh, mesh_axes) -> int:
    if mesh_axes is None:
        return 1
    names = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
    return math.prod(mesh.shape[a] for a in names)


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


def _leaf_sharding(name: str, axes: tuple, leaf, mesh: Mesh):
    """A NamedSharding for a dense leaf, or the quantized weight with NamedSharding fields."""

    def named(logical, shape, what):
        ps = spec(logical)
        for dim, (size, mesh_axes) in enumerate(zip(shape, ps)):
            n = _shards(mesh, mesh_axes)
            if size % n:
                raise ValueError(
                    f"{name}{what}: axis {dim} ({logical[dim]}) of size {size} does not split "
                    f"over tensor-parallel degree {n}"
                )
        return NamedSharding(mesh, ps)

    if isinstance(leaf, Int4Weight):
        lead = axes[:-2]
        d_in = leaf.shape[0]
        n_in = _shards(mesh, spec(axes)[-2])
        if n_in > 1 and (d_in // n_in) % leaf.group_size:
            raise ValueError(
                f"{name}: tensor-parallel degree {n_in} would split a quantization group: each "
                f"shard holds {d_in // n_in} of its {d_in} input rows, not a multiple of "
                f"group_size={leaf.group_size}"
            )
        return dataclasses.replace(
            leaf,
            packed=named(axes, leaf.packed.shape, ".packed"),
            scales=named(axes, leaf.scales.shape, ".scales"),
            zeros=named(axes, leaf.zeros.shape, ".zeros"),
            # act order permutes the whole input: kept replicated (a row-parallel weight with a
            # perm makes XLA gather the activations before the product)
            perm=None if leaf.perm is None else named((*lead, None), leaf.perm.shape, ".perm"),
        )
    if isinstance(leaf, Int8Weight):
        return dataclasses.replace(
            leaf,
            q=named(axes, leaf.q.shape, ".q"),
            scales=named((*axes[:-2], axes[-1]), leaf.scales.shape, ".scales"),
        )
    return named(axes, leaf.shape, "")


def param_shardings(cfg: ModelConfig, params: dict, mesh: Mesh | int):
    """The params pytree with a `NamedSharding` in place of every array (stacked or unrolled).

    Raises:
      ValueError: naming the degree and the config field or weight it does not fit.
    """
    mesh = tp_mesh(cfg, mesh)
    out = {}
    for key, leaf in params.items():
        if key == "layers":
            continue
        if key not in TOP_AXES:
            raise ValueError(f"params[{key!r}] has no sharding rule; known: {sorted(TOP_AXES)}")
        out[key] = _leaf_sharding(key, TOP_AXES[key], leaf, mesh)

    def layer(lp: dict, lead: tuple, where: str) -> dict:
        res = {}
        for key, leaf in lp.items():
            if key not in LAYER_AXES:
                raise ValueError(f"{where}[{key!r}] has no sharding rule")
            res[key] = _leaf_sharding(f"{where}/{key}", lead + LAYER_AXES[key], leaf, mesh)
        return res

    layers = params["layers"]
    if isinstance(layers, tuple | list):
        out["layers"] = type(layers)(layer(lp, (), f"layers[{i}]") for i, lp in enumerate(layers))
    else:
        out["layers"] = layer(layers, ("layers",), "layers")
    return out


def shard_params(cfg: ModelConfig, params: dict, mesh: Mesh | int) -> dict:
    """Places `params` on the tensor-parallel mesh (Megatron layout, see the module docstring).

    Args:
      cfg: the model config.
      params: dense or quantized params, stacked or in `inference_layout`.
      mesh: a `jax.sharding.Mesh` (all its devices form the TP group, in order) or a degree n
        (the first n devices).

    Returns:
      The same pytree, every array a global array sharded by `RULES`; `forward`, `ji.generate`
      and `ji.score` run it sharded (XLA inserts the collectives).

    Raises:
      ValueError: a degree that does not divide the heads (or the MLP, vocabulary), that can
        neither split nor replicate the KV heads, or that would split a quantization group.
    """
    return jax.device_put(params, param_shardings(cfg, params, mesh))


# --------------------------------------------------------------------------------------------
# The paged KV cache
# --------------------------------------------------------------------------------------------


def cache_shardings(cfg: ModelConfig, cache: PagedKVCache, mesh: Mesh | int) -> PagedKVCache:
    """The cache with a NamedSharding per array: split over KV heads (replicated past K)."""
    mesh = tp_mesh(cfg, mesh)
    kv = NamedSharding(mesh, spec(CACHE_AXES))
    sc = NamedSharding(mesh, spec(CACHE_SCALE_AXES))
    return dataclasses.replace(
        cache,
        k=kv,
        v=kv,
        k_scale=None if cache.k_scale is None else sc,
        v_scale=None if cache.v_scale is None else sc,
    )


def shard_cache(cfg: ModelConfig, cache: PagedKVCache, mesh: Mesh | int) -> PagedKVCache:
    """Places a paged KV cache on the tensor-parallel mesh, split over its KV heads."""
    return jax.device_put(cache, cache_shardings(cfg, cache, mesh))


def constrain_cache(cfg: ModelConfig, cache: PagedKVCache, mesh: Mesh) -> PagedKVCache:
    """Inside a jitted function: a cache created there, constrained to the TP layout."""
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cfg, cache, mesh))


def params_mesh(params: dict) -> Mesh | None:
    """The TP mesh `params` were placed on by `shard_params`, or None (not sharded that way)."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.axis_names == MESH_AXES:
            return sharding.mesh if sharding.mesh.size > 1 else None
        return None
    return None


def prepare(cfg: ModelConfig, params: dict, mesh: Mesh | int | None) -> tuple[dict, Mesh | None]:
    """For an entry point taking `mesh=`: (params sharded on it, the TP mesh), or as found.

    With `mesh=None`, params already placed by `shard_params` keep their mesh (returned so the
    caller can lay its cache out to match); otherwise (params, None).
    """
    if mesh is None:
        return params, params_mesh(params)
    mesh = tp_mesh(cfg, mesh)
    return shard_params(cfg, params, mesh), (mesh if mesh.size > 1 else None)
