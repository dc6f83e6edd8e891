"""Scale-out on JAX's own distributed runtime.

mesh = jax.make_mesh((8,), ("tp",))
sharded = ji.shard_params(cfg, params, mesh)
outs = ji.generate(cfg, sharded, prompts, sampling)          # or ji.generate(..., mesh=mesh)
engine = ji.Engine(cfg, params, ji.EngineConfig(mesh=mesh))  # params and KV pool on the mesh

- `sharding.py`: the logical-axis rules (Megatron TP), `shard_params`, `shard_cache`;
- `kernels.py`: Pallas attention under `shard_map` over heads;
- `engine_mesh.py`: `EngineConfig(mesh=...)`, the engine's params, cache and step on the mesh;
- `multiprocess.py`, `worker.py`, `launch.py`: N processes under `jax.distributed`, one
  controller each, deterministic replicated scheduling (`python -m jaxinfer.distributed.launch`);
- `connector.py`, `socket_connector.py`, `disagg.py`, `disagg_worker.py`: prefill/decode
  disaggregation behind a vLLM-shaped KV connector, between sub-meshes or processes.

Only `sharding` is imported here; the others are imported by name (`import jaxinfer` stays free
of `jax.distributed` and socket code).
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
