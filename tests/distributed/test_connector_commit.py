"""A connector's load does not change the decode engine's step compilation (one device).

A load writes blocks that the connector put on the cache's sharding (`jax.device_put`, so
committed arrays). Were the engine's cache uncommitted, the write would commit it, and every step
shape would compile again in the middle of serving (the compilation key holds each argument's
commitment): seconds a step on a disaggregated decode side (experiments/disagg_bench.py).
"""

import jax

import jaxinfer as ji
from jaxinfer.config import preset
from jaxinfer.distributed.connector import gather_blocks, scatter_blocks
from jaxinfer.engine import engine as engine_mod
from tests.helpers import random_params

CFG = preset("tiny-llama").replace(eos_token_id=None)
ECFG = ji.EngineConfig(block_size=4, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32)


def test_loaded_blocks_compile_no_step_again():
    engine = ji.Engine(CFG, random_params(CFG, seed=1), ECFG)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    sp = ji.SamplingParams(temperature=0.0, max_tokens=4)
    want = [o.token_ids for o in engine.generate(prompts, sp)]
    compiled = engine_mod._step._cache_size()
    # A load as a connector does it: blocks put on the cache's sharding, written into free ids.
    target = jax.tree.map(lambda x: x.sharding, engine.cache)
    ids = [5, 6]
    blocks = jax.device_put(gather_blocks(engine.cache, [1, 2]), target)
    engine.cache = scatter_blocks(engine.cache, blocks, ids)
    got = [o.token_ids for o in engine.generate(prompts, sp)]
    assert got == want
    assert engine_mod._step._cache_size() == compiled, "a load recompiled the engine's step"
