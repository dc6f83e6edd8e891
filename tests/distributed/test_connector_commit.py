"""What a disaggregated decode side compiles: nothing again after a load (one device), nothing
after `disagg_worker.warm_up`.

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
# "pow2": every T bucket kept, so which step shapes exist does not depend on a timing.
ECFG = ji.EngineConfig(
    block_size=4, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32, token_buckets="pow2"
)


def test_loaded_blocks_compile_no_step_again():
    engine = ji.Engine(CFG, random_params(CFG, seed=1), ECFG)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    sp = ji.SamplingParams(temperature=0.0, max_tokens=4)
    want = [o.token_ids for o in engine.generate(prompts, sp)]
    # Twice: the second run hits the prefix cache, a shorter prefill in a T bucket of its own.
    assert [o.token_ids for o in engine.generate(prompts, sp)] == want
    compiled = engine_mod._step._cache_size()
    # A load as a connector does it: blocks put on the cache's sharding, written into free ids.
    target = jax.tree.map(lambda x: x.sharding, engine.cache)
    ids = [5, 6]
    blocks = jax.device_put(gather_blocks(engine.cache, [1, 2]), target)
    engine.cache = scatter_blocks(engine.cache, blocks, ids)
    got = [o.token_ids for o in engine.generate(prompts, sp)]
    assert got == want
    assert engine_mod._step._cache_size() == compiled, "a load recompiled the engine's step"


def test_worker_warm_up_compiles_the_steps_and_changes_nothing():
    """`disagg_worker.warm_up`: the requests' steps compiled on a throwaway engine (serving them
    again compiles nothing), the cache's contents as they were, the engine's pool untouched."""
    import numpy as np

    from jaxinfer.distributed.disagg_worker import warm_up

    engine = ji.Engine(CFG, random_params(CFG, seed=2), ECFG)
    rng = np.random.default_rng(0)
    cache = jax.tree.map(lambda x: x + rng.standard_normal(x.shape).astype(x.dtype), engine.cache)
    engine.cache = jax.device_put(cache, engine.cache.k.sharding)
    before = jax.tree.map(np.asarray, engine.cache)
    requests = [
        dict(prompt=[3, 1, 4, 1, 5, 9, 2, 6, 5], sampling=dict(temperature=0.0, max_tokens=3)),
        dict(prompt=[2, 7, 1, 8], sampling=dict(temperature=0.0, max_tokens=5)),
    ]
    warm_up(engine, requests)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(engine.cache)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert engine.allocator.num_used_blocks == 0 and not engine.has_unfinished()
    compiled = engine_mod._step._cache_size()
    sps = [ji.SamplingParams(**r["sampling"]) for r in requests]
    engine.generate([r["prompt"] for r in requests], sps)
    assert engine_mod._step._cache_size() == compiled
