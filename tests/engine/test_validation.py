"""Engine boundary checks (issue 15 causes 2-5): numbers of numpy / jax kinds, int32 bounds,
stop ids against the vocabulary, request ids, and the KV dtype."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.engine import Engine, EngineConfig
from tests.helpers import random_params

CFG = ji.preset("tiny-llama").replace(eos_token_id=None)
ECFG = EngineConfig(
    block_size=4,
    num_blocks=25,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    backend="reference",
    min_token_bucket=16,
    min_block_bucket=16,
    min_seq_bucket=8,
)
GREEDY = ji.SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=7)


def test_stop_id_beyond_the_vocabulary_is_refused_at_add_request(params):
    """Cause 2: the engine knows the vocabulary; a stop id outside it is refused by name."""
    engine = Engine(CFG, params, ECFG)
    sp = ji.SamplingParams(max_tokens=3, stop_token_ids=(CFG.vocab_size + 5,))
    with pytest.raises(ValueError, match=r"stop_token_ids.*outside the vocabulary"):
        engine.add_request([1, 2, 3], sp)
    with pytest.raises(ValueError, match=r"stop_token_ids.*outside the vocabulary"):
        engine.generate([[1, 2, 3]], sp)
    assert not engine.has_unfinished() and engine.metrics().num_requests == 0


def test_jax_and_numpy_prompts_and_scalars(params):
    """Cause 3: a jax.Array prompt and numpy / jax scalar settings work like Python ones."""
    engine = Engine(CFG, params, ECFG)
    want = engine.generate([[5, 6, 7]], GREEDY)[0].token_ids
    sp = ji.SamplingParams(
        temperature=np.float32(0.0), max_tokens=jnp.int32(3), top_p=np.float32(1)
    )
    for prompt in (jnp.array([5, 6, 7], jnp.int32), np.array([5, 6, 7], np.int64)):
        rid = engine.add_request(prompt, sp)
        got = []
        while engine.has_unfinished():
            got += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        assert got == want
        assert engine.generate([prompt], sp)[0].token_ids == want
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request(jnp.array([5.0, 6.0]), sp)
    assert engine.allocator.num_used_blocks == 0


def test_engine_config_accepts_numpy_and_jax_ints_and_refuses_bools():
    """Cause 3: one int policy for EngineConfig (numpy / jax ints yes, bools and floats no)."""
    cfg = dataclasses.replace(
        ECFG, block_size=np.int64(4), num_blocks=jnp.int32(25), long_prefill_threshold=np.int32(8)
    )
    assert (cfg.block_size, cfg.num_blocks, cfg.long_prefill_threshold) == (4, 25, 8)
    assert all(type(v) is int for v in (cfg.block_size, cfg.num_blocks, cfg.long_prefill_threshold))
    assert cfg.scheduler_config().long_prefill_threshold == 8
    for bad in ({"block_size": True}, {"max_num_seqs": np.bool_(True)}, {"num_blocks": 25.0},
                {"long_prefill_threshold": True}, {"max_num_batched_tokens": 2**40}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            dataclasses.replace(ECFG, **bad)


def test_automatic_ids_never_collide_with_chosen_ones(params):
    """Cause 4: ids the user chose ("req-0", ("generate", 0)) are skipped by automatic ids."""
    engine = Engine(CFG, params, ECFG)
    chosen = ["req-0", "req-1", ("generate", 0), ("generate", 2)]
    for rid in chosen:
        assert engine.add_request([1, 2], GREEDY, request_id=rid) == rid
    auto = [engine.add_request([3, 4], GREEDY) for _ in range(3)]
    assert not set(auto) & set(chosen) and len(set(auto)) == 3
    outs = engine.generate([[5, 6], [7, 8], [9]], GREEDY)
    assert len(outs) == 3 and not {o.request_id for o in outs} & set(chosen + auto)
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics().num_completed == len(chosen) + len(auto) + 3
    # A chosen id that an automatic one took already is still refused, by name.
    with pytest.raises(ValueError, match="used already"):
        engine.add_request([1], GREEDY, request_id=auto[0])


@pytest.mark.parametrize("dtype", ["int32", "int8", "uint8", "bool", jnp.int16])
def test_non_floating_kv_dtype_is_refused(dtype):
    """Cause 5: an integer KV dtype would truncate K/V; only floating dtypes (or kv_format)."""
    with pytest.raises(ValueError, match="kv_dtype.*floating"):
        dataclasses.replace(ECFG, kv_dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", jnp.float16, None])
def test_floating_kv_dtype_is_accepted(dtype):
    assert dataclasses.replace(ECFG, kv_dtype=dtype).kv_dtype == dtype


@pytest.mark.parametrize(
    "prompt,match",
    [
        (np.array(3), "not a list of token ids"),  # was TypeError: len() of unsized object
        ([1, [2]], r"flat list of ints, got \[1, \[2\]\]"),  # was numpy's inhomogeneous shape
    ],
)
def test_malformed_prompts_are_refused_by_name(params, prompt, match):
    engine = Engine(CFG, params, ECFG)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match=match):
        engine.generate([prompt], GREEDY)
    with pytest.raises(ValueError, match=match):
        ji.generate(CFG, params, [prompt], GREEDY, backend="reference")
    assert not engine.has_unfinished() and engine.metrics().num_requests == 0


def test_bad_request_ids_arrival_times_and_sampling_lists_are_refused(params):
    """Were TypeError (unhashable id, sampling=3, arrival_time=[1]) or accepted (a NaN
    arrival_time, which made the request's TTFT NaN); nothing is queued, the engine serves on."""
    engine = Engine(CFG, params, ECFG)
    for rid in ([1], {"a": 1}):
        with pytest.raises(ValueError, match="request_id.*hashable"):
            engine.add_request([1, 2], GREEDY, request_id=rid)
        assert engine.abort(rid) is False  # never live; was a TypeError
    for t in (float("nan"), float("inf"), "0", [1.0], True):
        with pytest.raises(ValueError, match="arrival_time"):
            engine.add_request([1, 2], GREEDY, arrival_time=t)
    with pytest.raises(ValueError, match="sampling must be"):
        engine.generate([[1, 2]], 3)
    with pytest.raises(ValueError, match="sampling must be"):
        ji.generate(CFG, params, [[1, 2]], 3, backend="reference")
    assert not engine.has_unfinished() and engine.metrics().num_requests == 0
    engine.add_request([1, 2], GREEDY, arrival_time=np.float64(engine.clock()))
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics().num_completed == 1 and engine.allocator.num_used_blocks == 0
    assert (
        engine.generate([[1, 2]], GREEDY)[0].token_ids
        == ji.generate(CFG, params, [[1, 2]], GREEDY, backend="reference")[0].token_ids
    )
