"""The model runs unchanged on the Pallas attention backend (interpret mode on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.cache.metadata import SeqChunk, build_metadata
from jaxinfer.generate import _generate_core
from jaxinfer.ops import resolve_backend
from tests.helpers import random_params


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_pallas_interpret_generate_matches_reference(name):
    cfg = ji.preset(name).replace(eos_token_id=None)
    params = random_params(cfg, seed=4)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, cfg.vocab_size, n).tolist() for n in (3, 30)]
    sp = ji.SamplingParams(temperature=0, max_tokens=8)
    ref = ji.generate(cfg, params, prompts, sp, backend="reference")
    pal = ji.generate(cfg, params, prompts, sp, backend="pallas-interpret")
    assert [o.token_ids for o in pal] == [o.token_ids for o in ref]


def test_pallas_interpret_forward_logits_match_reference():
    cfg = ji.preset("tiny-mqa")
    params = random_params(cfg, seed=5)
    rng = np.random.RandomState(1)
    chunks = [
        SeqChunk(rng.randint(0, 128, 17).tolist(), 0, [3, 1]),
        SeqChunk(rng.randint(0, 128, 5).tolist(), 0, [2], "all"),
    ]
    meta, _ = build_metadata(chunks, 16)
    meta = ji.BatchMetadata(*(jnp.asarray(x) for x in meta.__dict__.values()))
    cache = ji.init_cache(cfg, 4, 16)
    a, _ = ji.forward(params, cfg, meta, cache, backend="reference")
    b, _ = ji.forward(params, cfg, meta, cache, backend="pallas-interpret")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_backend_names():
    assert resolve_backend("auto") in ("xla", "pallas")
    with pytest.raises(ValueError, match="backend='cuda'"):
        resolve_backend("cuda")


@pytest.mark.parametrize(
    "qcfg",
    [
        dict(method="rtn", bits=4, group_size=32),
        dict(method="rtn", bits=8, group_size=None),
        dict(method="smoothquant", bits=8, group_size=None),
    ],
    ids=["w4g32", "w8a16", "w8a8"],
)
def test_quantized_model_same_logits_on_pallas_linear(qcfg):
    """Quantized linears through the Pallas matmul kernels equal the XLA dequantize-and-dot."""
    cfg = ji.preset("tiny-llama")
    params = random_params(cfg, seed=6)
    calib = np.random.RandomState(2).randint(0, cfg.vocab_size, (4, 32))
    qparams = ji.quant.quantize(cfg, params, ji.quant.QuantConfig(**qcfg), calib)
    tokens = jnp.asarray(np.random.RandomState(3).randint(0, cfg.vocab_size, (2, 24)))
    ref = ji.forward_dense(qparams, cfg, tokens, backend="reference")
    pal = ji.forward_dense(qparams, cfg, tokens, backend="pallas-interpret")
    np.testing.assert_allclose(np.asarray(pal), np.asarray(ref), atol=2e-4, rtol=0)
    assert np.abs(np.asarray(ref)).max() > 0.5


def test_pallas_on_cpu_says_it_needs_a_gpu():
    """Cause 14 of issue 15: JAX's internal "Only interpret mode" error named no way out."""
    if jax.default_backend() != "cpu":
        pytest.skip("the check is for a CPU host")
    with pytest.raises(ValueError, match="need a GPU.*pallas-interpret"):
        resolve_backend("pallas")
    cfg = ji.preset("tiny-llama")
    params = random_params(cfg, seed=1)
    with pytest.raises(ValueError, match="need a GPU.*pallas-interpret"):
        ji.generate(cfg, params, [[1, 2, 3]], ji.SamplingParams(max_tokens=2), backend="pallas")
    assert resolve_backend("pallas-interpret") == "pallas-interpret"
    with ji.ops.lowering_for_gpu():  # tracing for a CUDA lowering (kernel_compile_check)
        assert resolve_backend("pallas") == "pallas"


def test_entry_points_read_the_platform_once_on_the_host(monkeypatch):
    """Item 6 of issue 14: the platform is resolved at the boundary and passed down static, so a
    fresh trace of the decode loops reads it no more (before: loop layout, cache and every
    forward read `jax.default_backend()` while tracing)."""
    cfg = ji.preset("tiny-llama").replace(eos_token_id=None)
    params = random_params(cfg, seed=7)
    calls = []
    real = jax.default_backend
    monkeypatch.setattr(jax, "default_backend", lambda: calls.append(1) or real())
    before = _generate_core._cache_size()
    prompts = [[5] * 21, [6] * 2, [7] * 9]  # a batch shape no other test uses: a fresh trace
    out = ji.generate(cfg, params, prompts, ji.SamplingParams(temperature=0, max_tokens=37))
    assert _generate_core._cache_size() == before + 1 and len(out[0].token_ids) == 37
    assert len(calls) == 1, f"jax.default_backend() read {len(calls)} times"
    calls.clear()
    spec = ji.speculative.generate(
        (cfg, params), "ngram", prompts, ji.SamplingParams(temperature=0, max_tokens=19), gamma=3
    )
    assert [len(o.token_ids) for o in spec] == [19] * 3
    assert len(calls) == 1, f"jax.default_backend() read {len(calls)} times"
    calls.clear()
    engine = ji.Engine(cfg, params, ji.EngineConfig(block_size=8, num_blocks=64))
    got = engine.generate(prompts, ji.SamplingParams(temperature=0, max_tokens=5))
    assert [o.token_ids for o in got] == [o.token_ids[:5] for o in out]
    assert len(calls) == 1, f"jax.default_backend() read {len(calls)} times"


def test_init_cache_under_jit_needs_the_platform():
    cfg = ji.preset("tiny-llama")
    with pytest.raises(ValueError, match="init_cache.*platform"):
        jax.jit(lambda: ji.init_cache(cfg, 2, 4).k)()
    assert jax.jit(lambda: ji.init_cache(cfg, 2, 4, platform="cpu").k)().shape[1] == 2
    assert ji.init_cache(cfg, 2, 4).platform == jax.devices()[0].platform
