"""The engine on a tensor-parallel mesh: `EngineConfig(mesh=...)`.

    engine = ji.Engine(cfg, params, ji.EngineConfig(mesh=jax.make_mesh((4,), ("tp",))))

At construction the engine's params go through `shard_params` (Megatron layout, `sharding.py`)
and its paged KV cache `[L, num_blocks, K, S, D]` is split over K (replicated past K, as the
params). Nothing else changes: the scheduler, the allocator and the block ids are the same host
objects as on one device, the step is the same jitted function (XLA partitions it from its
inputs' shardings and inserts the all-reduces of the row-parallel products), and its `[B]` token
output is replicated, so the one device -> host transfer reads a local copy. Each `step()` runs
inside `jax.set_mesh(mesh)`, which makes the Pallas attention op run per device on its heads
(`kernels.py`) instead of gathering every head around the `pallas_call`.

A mesh may span several processes (`jax.distributed`, see `serve_worker.py`): every process
builds the same engine and runs the same steps; the arrays are global, each process holding its
devices' shards.

Params already placed by `ji.shard_params` keep their mesh with `mesh=None`, as in `ji.generate`.
"""

from __future__ import annotations

import functools

import jax

from jaxinfer.cache.paged import PagedKVCache, init_cache
from jaxinfer.distributed.sharding import prepare, shard_cache, tp_mesh


def place_engine(engine) -> jax.sharding.Mesh | None:
    """Creates `engine.cache` and puts it, `engine.params` and `engine.step` on the TP mesh.

    Args:
      engine: an `Engine` under construction: `cfg`, `params`, `config` and `platform` set.

    Returns:
      The TP mesh (the `(kv, rep)` layout of `config.mesh`'s devices), or None on one device.

    Raises:
      ValueError: a degree the model does not fit (`tp_grid`, `shard_params` name the field), or
        a speculative draft model or drafter head with a mesh (its params and cache would stay
        on one device, and a step cannot mix the two placements).
    """
    cfg, config = engine.cfg, engine.config
    engine.params, mesh = prepare(cfg, engine.params, config.mesh)
    # A one-device mesh (a disaggregated side on its own device) still places the cache there.
    layout = mesh if mesh is not None or config.mesh is None else tp_mesh(cfg, config.mesh)
    engine.kv_layout = layout  # kept for `new_cache`
    engine.cache = new_cache(engine)
    if mesh is None:
        return None
    spec = config.speculative
    if spec is not None and (spec.draft_model is not None or spec.draft_head is not None):
        kind = "draft model" if spec.draft_model is not None else "drafter head"
        raise ValueError(
            f"EngineConfig.mesh={config.mesh!r} with a speculative {kind} is not supported: "
            "expected mesh=None, or a drafter without a model (drafter='ngram')"
        )
    engine.step = functools.partial(_step_under_mesh, engine.step, mesh)
    return mesh


def new_cache(engine) -> PagedKVCache:
    """An empty paged KV cache for `engine`, laid out on `engine.kv_layout` (its mesh, or one
    device when None): at construction, and when a failed step consumed the cache
    (`recovery.undo`), so the rebuilt cache keeps the shards the step is compiled for.

    On one device the cache is committed to it (`jax.device_put`), as a mesh's shards are: a
    connector's load writes blocks put on the cache's sharding, which would otherwise turn an
    uncommitted cache committed and the step's compilation key with it (every step shape
    compiled again mid-serving, seconds each, on a disaggregated decode side).
    """
    cfg, config = engine.cfg, engine.config
    cache = init_cache(
        cfg, config.num_blocks, config.block_size, dtype=config.kv_dtype,
        kv_format=config.kv_format, platform=engine.platform,
    )  # fmt: skip
    if engine.kv_layout is None:
        (device,) = cache.k.devices()
        return jax.device_put(cache, device)
    return shard_cache(cfg, cache, engine.kv_layout)


def _step_under_mesh(step, mesh):
    with jax.set_mesh(mesh):
        return step()


def cache_layout(cache: PagedKVCache) -> dict[str, int]:
    """Devices and KV heads per device of a cache (for tests and reports)."""
    shards = cache.k.addressable_shards
    return dict(
        devices=len(cache.k.sharding.device_set),
        kv_heads_per_device=int(shards[0].data.shape[2]),
    )
