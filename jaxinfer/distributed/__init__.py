"""Scale-out: tensor-parallel sharding rules over a device mesh (`sharding.py`).

mesh = jax.make_mesh((8,), ("tp",))
sharded = ji.shard_params(cfg, params, mesh)
outs = ji.generate(cfg, sharded, prompts, sampling)          # or ji.generate(..., mesh=mesh)
"""

from jaxinfer.distributed.sharding import (
    MESH_AXES,
    RULES,
    cache_shardings,
    constrain_cache,
    param_shardings,
    params_mesh,
    prepare,
    shard_cache,
    shard_params,
    spec,
    tp_grid,
    tp_mesh,
)

__all__ = [
    "MESH_AXES",
    "RULES",
    "cache_shardings",
    "constrain_cache",
    "param_shardings",
    "params_mesh",
    "prepare",
    "shard_cache",
    "shard_params",
    "spec",
    "tp_grid",
    "tp_mesh",
]
