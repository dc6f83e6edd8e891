"""`EngineConfig(mesh=...)` cases, run on 4 fake CPU devices by `test_engine_mesh.py`.

Not collected by the suite (jax must see the device-count flag before it starts). Run alone:
`python -m pytest tests/distributed/_engine_cases.py` (it sets 4 devices unless XLA_FLAGS is set).

The reference is the same engine on one device, in the same process: a workload whose pool is
small enough to preempt and whose prompts share prefixes (asserted), greedy and seeded sampling,
must give the same tokens request by request at tensor-parallel degrees 2 (KV heads split) and 4
(KV heads replicated twice).
"""

import dataclasses
import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxinfer as ji  # noqa: E402
from jaxinfer.config import preset  # noqa: E402
from jaxinfer.distributed.engine_mesh import cache_layout  # noqa: E402
from jaxinfer.speculative import heads  # noqa: E402
from tests.helpers import random_params  # noqa: E402

# 8 query heads, 2 KV heads: degree 2 splits the KV heads, degree 4 replicates each twice.
CFG = preset("tiny-llama").replace(num_heads=8, num_kv_heads=2, head_dim=16, eos_token_id=None)
S = 4
ECFG = ji.EngineConfig(
    block_size=S,
    num_blocks=21,  # 20 usable blocks = 80 slots: eight ~20-token requests must preempt
    max_num_seqs=6,
    max_num_batched_tokens=32,  # admissions spread over steps, so later prompts hit the cache
    min_token_bucket=32,
    min_block_bucket=8,
    min_seq_bucket=8,
)
MAX_TOKENS = 8


def _prompts():
    rng = np.random.RandomState(11)
    shared = rng.randint(0, CFG.vocab_size, 2 * S + 1).tolist()
    out = []
    for i in range(8):
        head = shared if i % 2 else []
        out.append(head + rng.randint(0, CFG.vocab_size, int(rng.randint(4, 11))).tolist())
    return out


PROMPTS = _prompts()
GREEDY = [ji.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)] * len(PROMPTS)
SEEDED = [
    ji.SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=MAX_TOKENS)
    for i in range(len(PROMPTS))
]
PENALIZED = [  # the penalties' history arrays reach the sharded step replicated
    dataclasses.replace(sp, repetition_penalty=1.5, frequency_penalty=1.0, logit_bias={5: 3.0})
    for sp in SEEDED
]
KINDS = {"greedy": GREEDY, "seeded": SEEDED, "penalized": PENALIZED}


@functools.cache
def _params():
    return random_params(CFG, seed=4)


def _serve(mesh, sps):
    engine = ji.Engine(CFG, _params(), dataclasses.replace(ECFG, mesh=mesh))
    outs = engine.generate(PROMPTS, sps)
    return engine, [o.token_ids for o in outs]


@functools.cache
def _reference(kind: str):
    engine, tokens = _serve(None, KINDS[kind])
    assert engine.mesh is None and len(engine.cache.k.sharding.device_set) == 1
    return engine.num_preemptions, engine.allocator.prefix_cache_hits, tokens


@pytest.mark.parametrize(
    "degree, kind", [(2, "greedy"), (4, "greedy"), (2, "seeded"), (4, "seeded"), (4, "penalized")]
)
def test_engine_on_mesh_matches_one_device(degree, kind):
    preemptions, hits, want = _reference(kind)
    assert preemptions > 0 and hits > 0  # the workload exercises both
    assert all(len(t) == MAX_TOKENS for t in want)
    mesh = jax.make_mesh((degree,), ("tp",))  # a plain user mesh: the engine re-lays it out
    engine, got = _serve(mesh, KINDS[kind])
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}"
    assert engine.num_preemptions > 0 and engine.allocator.prefix_cache_hits > 0
    assert engine.mesh.shape == {"kv": min(degree, 2), "rep": max(1, degree // 2)}
    # The pool stayed split over KV heads through donation, copies and preemption.
    assert cache_layout(engine.cache) == dict(
        devices=degree, kv_heads_per_device=2 // min(2, degree)
    )
    assert len(engine.params["layers"]["wq"].sharding.device_set) == degree
    assert engine.allocator.num_used_blocks == 0


def test_seeded_differs_from_greedy():
    # A negative control: the seeded workload is not the greedy one in disguise.
    assert _reference("seeded")[2] != _reference("greedy")[2]
    assert _reference("penalized")[2] != _reference("seeded")[2]


def test_presharded_params_keep_their_mesh():
    sharded = ji.shard_params(CFG, _params(), 4)
    engine = ji.Engine(CFG, sharded, ECFG)
    assert engine.mesh is not None and engine.mesh.size == 4
    assert cache_layout(engine.cache)["devices"] == 4
    got = [o.token_ids for o in engine.generate(PROMPTS[:3], GREEDY[:3])]
    assert got == _reference("greedy")[2][:3]


def test_refusals_name_the_cause():
    with pytest.raises(ValueError, match=r"degree 3 does not divide num_heads=8"):
        ji.Engine(CFG, _params(), dataclasses.replace(ECFG, mesh=3))
    with pytest.raises(ValueError, match=r"exceeds the 4 devices"):
        ji.Engine(CFG, _params(), dataclasses.replace(ECFG, mesh=8))
    spec = ji.SpeculativeConfig(drafter=(CFG, _params()), num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"EngineConfig.mesh=2 with a speculative draft model"):
        ji.Engine(CFG, _params(), dataclasses.replace(ECFG, mesh=2, speculative=spec))
    hcfg = heads.head_config_for(CFG, "medusa")
    head = heads.Head(hcfg, heads.init_medusa(hcfg, jax.random.key(0)))
    spec = ji.SpeculativeConfig(drafter=head, num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"EngineConfig.mesh=2 with a speculative drafter head"):
        ji.Engine(CFG, _params(), dataclasses.replace(ECFG, mesh=2, speculative=spec))


def test_failed_step_rebuilds_the_cache_on_the_mesh(monkeypatch):
    """A step that consumed the donated cache and then failed: `recovery.undo` builds a new cache,
    split over KV heads as at construction (not on one device, which the step's sharded params
    could not run with), and the engine goes on serving the reference tokens."""
    from jaxinfer.engine import engine as engine_mod

    engine = ji.Engine(CFG, _params(), dataclasses.replace(ECFG, mesh=2))
    before = cache_layout(engine.cache)
    assert before == dict(devices=2, kv_heads_per_device=1)
    sharding = engine.cache.k.sharding
    real = engine_mod._step

    def consume_then_fail(*a, **k):
        real(*a, **k)  # the donated cache is gone
        raise RuntimeError("injected fault (device-after)")

    engine.add_request(PROMPTS[0], GREEDY[0], request_id="failed")
    monkeypatch.setattr(engine_mod, "_step", consume_then_fail)
    outs = engine.step()
    monkeypatch.setattr(engine_mod, "_step", real)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("failed", "error")]
    assert engine.num_failed_steps == 1
    assert cache_layout(engine.cache) == before
    assert engine.cache.k.sharding == sharding and engine.cache.v.sharding == sharding
    got = [o.token_ids for o in engine.generate(PROMPTS[:3], GREEDY[:3])]
    assert got == _reference("greedy")[2][:3]
    assert engine.allocator.num_used_blocks == 0
