"""Tensor-parallel cases, run on 8 fake CPU devices by `test_tp.py` in a fresh process.

Not collected by the suite (jax must see the device-count flag before it starts). Run alone:
`XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/distributed/_tp_cases.py`

Every case compares a sharded run with the single-device one on the same params: paged-forward
logits within 1e-5 (float32) over a prefill step and a mixed decode + chunk step, the cache's
layout (split over KV heads, replicated past them), greedy `ji.generate` tokens identical, each
sharded execution repeated 20 times (a collective returning wrong data now and then would show).
"""

import functools
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxinfer as ji  # noqa: E402
from jaxinfer.cache.metadata import SeqChunk, build_metadata  # noqa: E402
from jaxinfer.config import preset  # noqa: E402
from jaxinfer.model.params import LINEAR_NAMES  # noqa: E402
from jaxinfer.quant import quantize_int8, rtn_quantize  # noqa: E402
from tests.helpers import random_params  # noqa: E402

REPEATS = 20
BLOCK = 4
DEGREES = (1, 2, 4, 8)
# 8 query heads so every degree divides them; 2 KV heads so degrees 4 and 8 replicate them.
FAMILIES = {
    "llama": preset("tiny-llama").replace(num_heads=8, num_kv_heads=2, head_dim=16),
    "qwen2": preset("tiny-qwen2").replace(num_heads=8, num_kv_heads=2, head_dim=16),
}
PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 64, 33, 2, 70, 11, 9], [120, 4, 56, 7, 31, 18]]
GREEDY = ji.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _quantize(params: dict, kind: str) -> dict:
    if kind == "dense":
        return params
    layers = dict(params["layers"])
    for name in LINEAR_NAMES:
        if kind == "int4":  # G = 8: wo's 128 input rows give each of 8 shards two groups
            layers[name] = rtn_quantize(layers[name], bits=4, group_size=8)
        else:
            layers[name] = quantize_int8(layers[name], act_quant=kind == "int8-w8a8")
    return {**params, "layers": layers}


@functools.cache
def _model(family: str, kind: str):
    cfg = FAMILIES[family]
    return cfg, _quantize(random_params(cfg, seed=3), kind)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, batch, cache, cfg):
    return ji.forward(params, cfg, batch, cache)


def _steps():
    """Two steps over permuted blocks: both prefills, then a decode and a chunk of 4."""
    m = 6
    tables = np.array([[3, 9, 1, 12, 5, 7], [2, 11, 8, 4, 10, 6]])
    a, b = PROMPTS
    pad = dict(num_tokens=24, num_seqs=2, max_blocks=m, num_logits=24)
    first, _ = build_metadata(
        [SeqChunk(a, 0, tables[0], "all"), SeqChunk(b[:2], 0, tables[1], "all")], BLOCK, **pad
    )
    second, _ = build_metadata(
        [SeqChunk([77], len(a), tables[0], "all"), SeqChunk(b[2:], 2, tables[1], "all")],
        BLOCK,
        **pad,
    )
    return [jax.tree.map(jnp.asarray, s) for s in (first, second)]


def _run(cfg, params, cache, steps):
    out = []
    for s in steps:
        logits, cache = _forward(params, s, cache, cfg)
        out.append(np.asarray(logits))
    return np.concatenate(out), cache


def _nan_cache(cfg):
    cache = ji.init_cache(cfg, 13, BLOCK)
    return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)  # only live slots count


@functools.cache
def _ref_logits(family: str, kind: str) -> np.ndarray:
    cfg, params = _model(family, kind)
    return _run(cfg, params, _nan_cache(cfg), _steps())[0]


@functools.cache
def _ref_tokens(family: str, kind: str) -> list:
    cfg, params = _model(family, kind)
    return [o.token_ids for o in ji.generate(cfg, params, PROMPTS, GREEDY)]


# Dense weights at every degree; quantized ones at 2 (K split) and 8 (K replicated four times).
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(
    "kind,degree",
    [("dense", d) for d in DEGREES] + [(k, d) for k in ("int4", "int8") for d in (2, 8)],
)
def test_forward_logits_match_single_device(family, kind, degree):
    cfg, params = _model(family, kind)
    want = _ref_logits(family, kind)
    sharded = ji.shard_params(cfg, params, degree)
    steps = _steps()
    cache0 = ji.distributed.shard_cache(cfg, _nan_cache(cfg), degree)
    for _ in range(REPEATS):
        got, cache = _run(cfg, sharded, cache0, steps)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # The cache stayed split over KV heads: one KV head per device once the degree passes K.
    mesh = ji.distributed.tp_mesh(cfg, degree)
    assert cache.k.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "kv")), 5)
    kv_per_device = {s.data.shape[2] for s in cache.k.addressable_shards}
    assert kv_per_device == {max(1, cfg.num_kv_heads // degree)}
    assert len(cache.k.sharding.device_set) == degree


# A generate compile costs about three forward compiles: every degree on one family, one degree
# per other (family, weights) pair (the logits test above covers every combination).
@pytest.mark.parametrize(
    "family,kind,degree",
    [("llama", "dense", 2), ("llama", "dense", 4), ("llama", "dense", 8), ("qwen2", "dense", 8)]
    + [("llama", "int4", 8), ("qwen2", "int8", 4)],
)
def test_greedy_generate_identical(family, kind, degree):
    cfg, params = _model(family, kind)
    want = _ref_tokens(family, kind)
    mesh = jax.make_mesh((degree,), ("tp",))  # a plain user mesh: ji.generate re-lays it out
    for i in range(REPEATS):
        got = [o.token_ids for o in ji.generate(cfg, params, PROMPTS, GREEDY, mesh=mesh)]
        assert got == want, f"repeat {i}"


def test_generate_takes_presharded_params():
    cfg, params = _model("llama", "dense")
    want = _ref_tokens("llama", "dense")
    sharded = ji.shard_params(cfg, params, 8)
    assert ji.distributed.params_mesh(sharded).shape == {"kv": 2, "rep": 4}
    got = [o.token_ids for o in ji.generate(cfg, sharded, PROMPTS, GREEDY)]
    assert got == want


def test_w8a8_logits_match():
    cfg, params = _model("llama", "int8-w8a8")
    want = _ref_logits("llama", "int8-w8a8")
    cache = ji.distributed.shard_cache(cfg, _nan_cache(cfg), 8)
    got, _ = _run(cfg, ji.shard_params(cfg, params, 8), cache, _steps())
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_layouts():
    cfg, params = _model("qwen2", "int4")
    sharded = ji.shard_params(cfg, params, 8)
    lay = sharded["layers"]
    tp = ("kv", "rep")
    assert lay["wq"].packed.sharding.spec == P(None, None, tp)  # column-parallel
    assert lay["wq"].scales.sharding.spec == P(None, None, tp)
    assert lay["wk"].zeros.sharding.spec == P(None, None, "kv")
    assert lay["wo"].packed.sharding.spec == P(None, tp, None)  # row-parallel
    assert lay["wo"].scales.sharding.spec == P(None, tp, None)
    assert lay["w_down"].zeros.sharding.spec == P(None, tp, None)
    assert lay["bq"].sharding.spec == P(None, tp)
    assert sharded["embed"].sharding.spec == P(tp, None)  # by vocabulary
    assert {s.data.shape for s in lay["wo"].scales.addressable_shards} == {(2, 2, 64)}
    i8 = ji.shard_params(cfg, _model("qwen2", "int8")[1], 4)["layers"]
    assert i8["w_up"].scales.sharding.spec == P(None, tp)
    assert i8["w_down"].scales.sharding.spec == P(None, None)  # per output column: replicated


def test_unrolled_layout_shards():
    cfg, params = _model("llama", "dense")
    sharded = ji.shard_params(cfg, ji.inference_layout(params), 4)
    assert sharded["layers"][1]["w_down"].sharding.spec == P(("kv", "rep"), None)
    assert sharded["lm_head"].sharding.spec == P(None, ("kv", "rep"))


def test_refusals_name_the_cause():
    cfg, params = _model("llama", "dense")
    with pytest.raises(ValueError, match=r"degree 3 does not divide num_heads=8"):
        ji.shard_params(cfg, params, 3)
    with pytest.raises(ValueError, match=r"degree 3 does not divide num_heads=8"):
        ji.generate(cfg, params, PROMPTS, GREEDY, mesh=jax.make_mesh((3,), ("tp",)))
    odd = cfg.replace(num_heads=24, num_kv_heads=8)
    with pytest.raises(ValueError, match=r"num_kv_heads=8"):
        ji.distributed.tp_grid(odd, 6)
    coarse = {**params, "layers": dict(params["layers"])}
    for name in LINEAR_NAMES:
        coarse["layers"][name] = rtn_quantize(params["layers"][name], bits=4, group_size=32)
    ji.shard_params(cfg, coarse, 4)  # 128 / 4 = 32 rows of wo, w_down per shard: whole groups
    with pytest.raises(ValueError, match=r"layers/w_down: .*split a quantization group.*=32"):
        ji.shard_params(cfg, coarse, 8)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward_pallas(params, batch, cache, cfg):
    return ji.forward(params, cfg, batch, cache, backend="pallas-interpret")


def _collectives(fn, *args, **kw) -> set:
    text = fn.lower(*args, **kw).compile().as_text()
    return set(re.findall(r"= \S+ (all-gather|all-to-all|collective-permute)\(", text))


def test_pallas_kernel_runs_per_device_on_its_heads():
    cfg, params = _model("qwen2", "dense")
    want = _ref_logits("qwen2", "dense")
    mesh = ji.distributed.tp_mesh(cfg, 8)
    sharded = ji.shard_params(cfg, params, mesh)
    cache0 = ji.distributed.shard_cache(cfg, _nan_cache(cfg), mesh)
    steps = _steps()
    # Outside the mesh context XLA cannot split the pallas_call: it gathers heads around it.
    assert "all-gather" in _collectives(_forward_pallas, sharded, steps[1], cache0, cfg=cfg)
    with jax.set_mesh(mesh):  # shard_map over heads: no gather, only the row-parallel sums
        assert not _collectives(_forward_pallas, sharded, steps[1], cache0, cfg=cfg)
        for _ in range(REPEATS):
            cache, out = cache0, []
            for s in steps:
                logits, cache = _forward_pallas(sharded, s, cache, cfg)
                out.append(np.asarray(logits))
            np.testing.assert_allclose(np.concatenate(out), want, atol=1e-5, rtol=0)


def test_score_runs_sharded():
    cfg, params = _model("qwen2", "dense")
    tokens = np.array([PROMPTS[0][:6], PROMPTS[1][:6]], np.int32)
    want = np.asarray(ji.score(cfg, params, tokens))
    got = np.asarray(ji.score(cfg, ji.shard_params(cfg, params, 8), tokens))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_smollm2_shaped_heads_degree_3():
    # SmolLM2-135M's head layout (9 query heads, 3 KV heads) on random tiny weights: degree 3
    # splits both, on the first 3 of the 8 devices; degrees that do not divide 9 are refused.
    cfg = preset("tiny-llama").replace(
        num_heads=9, num_kv_heads=3, head_dim=16, vocab_size=129, intermediate_size=192
    )
    params = random_params(cfg, seed=5)
    want = _run(cfg, params, _nan_cache(cfg), _steps())[0]
    got, cache = _run(
        cfg, ji.shard_params(cfg, params, 3), ji.distributed.shard_cache(cfg, _nan_cache(cfg), 3),
        _steps(),
    )  # fmt: skip
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert {s.data.shape[2] for s in cache.k.addressable_shards} == {1}
    for degree in (2, 4, 6, 8):
        with pytest.raises(ValueError, match=rf"degree {degree} does not divide num_heads=9"):
            ji.shard_params(cfg, params, degree)


# Mistral: the sliding window (8 < the 13-token prompt) under every kind of split.
MISTRAL = preset("tiny-mistral").replace(num_heads=8, num_kv_heads=2, head_dim=16, sliding_window=8)


@pytest.mark.parametrize("degree", [2, 8])
def test_mistral_sliding_window_logits(degree):
    params = random_params(MISTRAL, seed=9)
    want = _run(MISTRAL, params, _nan_cache(MISTRAL), _steps())[0]
    sharded = ji.shard_params(MISTRAL, params, degree)
    cache = ji.distributed.shard_cache(MISTRAL, _nan_cache(MISTRAL), degree)
    for _ in range(REPEATS):
        np.testing.assert_allclose(
            _run(MISTRAL, sharded, cache, _steps())[0], want, atol=1e-5, rtol=0
        )


def test_mistral_greedy_degree_4():
    params = random_params(MISTRAL, seed=9)
    want = [o.token_ids for o in ji.generate(MISTRAL, params, PROMPTS, GREEDY)]
    for i in range(REPEATS):
        assert [
            o.token_ids for o in ji.generate(MISTRAL, params, PROMPTS, GREEDY, mesh=4)
        ] == want, i
