"""The inference params layout (`inference_layout`) runs the same model as the stored one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.cache.metadata import SeqChunk, build_metadata
from jaxinfer.model.params import LINEAR_NAMES, cpu_layout, inference_layout, loop_layout
from jaxinfer.qtensor import Int4Weight
from jaxinfer.quant.rtn import quantize_int8, rtn_quantize
from jaxinfer.transposed import TransposedDense
from tests.helpers import random_params

BLOCK = 8


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, batch, cache, cfg):
    return ji.forward(params, cfg, batch, cache, backend="xla")


def _prefill_and_decode(cfg, params, seqs):
    """A ragged prefill of every sequence but its last token, then one decode row each."""
    m = -(-max(len(s) for s in seqs) // BLOCK)
    tables = (np.random.RandomState(0).permutation(len(seqs) * m) + 1).reshape(len(seqs), m)
    cache = ji.init_cache(cfg, 1 + len(seqs) * m, BLOCK)
    cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)
    outs = []
    for step in ("prefill", "decode"):
        chunks = [
            SeqChunk(s[:-1], 0, tables[i], "all") if step == "prefill"
            else SeqChunk(s[-1:], len(s) - 1, tables[i])
            for i, s in enumerate(seqs)
        ]  # fmt: skip
        meta, _ = build_metadata(chunks, BLOCK)
        logits, cache = _forward(params, jax.tree.map(jnp.asarray, meta), cache, cfg)
        outs.append(np.asarray(logits))
    return outs, cache


def _quantized(params):
    layers = dict(params["layers"])
    for i, name in enumerate(LINEAR_NAMES):
        w = layers[name]
        layers[name] = quantize_int8(w) if i % 2 else rtn_quantize(w, bits=4, group_size=32)
    return dict(params, layers=layers)


@pytest.mark.parametrize("layout", [inference_layout, cpu_layout])
@pytest.mark.parametrize("quantized", [False, True])
def test_unrolled_forward_equals_stacked(quantized, layout):
    cfg = ji.preset("tiny-qwen2")  # biases and a tied head: every leaf kind is laid out
    params = random_params(cfg, seed=5)
    if quantized:
        params = _quantized(params)
    rng = np.random.RandomState(1)
    seqs = [rng.randint(0, cfg.vocab_size, n).tolist() for n in (19, 6, 33)]
    (pre_s, dec_s), cache_s = _prefill_and_decode(cfg, params, seqs)
    (pre_u, dec_u), cache_u = _prefill_and_decode(cfg, layout(params), seqs)
    assert np.all(np.isfinite(pre_s)) and np.all(np.isfinite(dec_s))
    np.testing.assert_allclose(pre_u, pre_s, atol=1e-5, rtol=0)
    np.testing.assert_allclose(dec_u, dec_s, atol=1e-5, rtol=0)
    # The cache each form wrote is the same (NaN where nothing was written in both).
    np.testing.assert_allclose(np.asarray(cache_u.k), np.asarray(cache_s.k), atol=1e-5, rtol=0)


def test_inference_layout_slices_every_leaf():
    cfg = ji.preset("tiny-llama")
    params = _quantized(random_params(cfg, seed=2))
    unrolled = inference_layout(params)
    assert isinstance(unrolled["layers"], tuple) and len(unrolled["layers"]) == cfg.num_layers
    for i, lp in enumerate(unrolled["layers"]):
        assert isinstance(lp["wq"], Int4Weight)
        for got, want in zip(jax.tree.leaves(lp), jax.tree.leaves(params["layers"])):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want[i]))
    assert unrolled["embed"] is params["embed"]  # everything outside `layers` is shared
    assert unrolled["lm_head"] is params["lm_head"]  # untied: the head is kept as it is
    assert inference_layout(unrolled) is unrolled  # idempotent


def test_inference_layout_materialises_a_tied_head():
    cfg = ji.preset("tiny-qwen2")
    params = random_params(cfg, seed=4)
    assert "lm_head" not in params
    laid = inference_layout(params)
    np.testing.assert_array_equal(np.asarray(laid["lm_head"]), np.asarray(params["embed"]).T)
    assert laid["lm_head"].shape == (cfg.hidden_size, cfg.vocab_size)
    assert "lm_head" not in params  # the input is not modified
    assert inference_layout(laid) is laid


def test_inference_layout_rejects_ragged_stack():
    params = random_params(ji.preset("tiny-llama"))
    bad = dict(params, layers=dict(params["layers"], wq=params["layers"]["wq"][:1]))
    with pytest.raises(ValueError, match="layer count"):
        inference_layout(bad)


def test_forward_rejects_wrong_layer_count():
    cfg = ji.preset("tiny-llama")
    params = inference_layout(random_params(cfg))
    params = dict(params, layers=params["layers"][:-1])
    meta, _ = build_metadata([SeqChunk([1, 2, 3], 0, [1], "all")], BLOCK)
    with pytest.raises(ValueError, match="num_layers"):
        ji.forward(params, cfg, meta, ji.init_cache(cfg, 2, BLOCK))


def test_loop_layout_only_on_a_cpu():
    params = random_params(ji.preset("tiny-llama"))
    laid = loop_layout(params, "cpu")
    assert isinstance(laid["layers"], tuple) and isinstance(laid["lm_head"], TransposedDense)
    assert loop_layout(params, "gpu") is params
    meshed = loop_layout(params, "cpu", mesh=object())  # a TP mesh: its rules name [in, out]
    assert isinstance(meshed["layers"], tuple) and isinstance(meshed["lm_head"], jax.Array)


def test_cpu_layout_transposes_every_dense_projection():
    cfg = ji.preset("tiny-qwen2")  # tied head and biases
    params = random_params(cfg, seed=6)
    layers = dict(params["layers"], wk=quantize_int8(params["layers"]["wk"]))
    params = dict(params, layers=layers)
    laid = cpu_layout(params)
    for i, lp in enumerate(laid["layers"]):
        wk = lp["wk"]  # W8A16: int8 [out, in] with its scales (tests/ops/test_narrow_layout.py),
        assert isinstance(wk, TransposedDense) and wk.wt.dtype == jnp.int8 and wk.scale.ndim == 1
        np.testing.assert_array_equal(np.asarray(wk.wt), np.asarray(layers["wk"].q[i]).T)
        for name in ("wq", "wv", "wo", "w_down"):  # and its dense siblings stay apart
            w = lp[name]
            assert isinstance(w, TransposedDense) and w.wt.ndim == 2
            np.testing.assert_array_equal(np.asarray(w.wt), np.asarray(layers[name][i]).T)
        assert isinstance(lp["bq"], jax.Array) and "bqkv" not in lp  # biases stay [out]
        assert "w_gate" not in lp and "w_up" not in lp  # both dense: one fused product
        gate_up = np.concatenate([layers["w_gate"][i], layers["w_up"][i]], axis=1)  # [E, 2F]
        np.testing.assert_array_equal(np.asarray(lp["w_gate_up"].wt), gate_up.T)
    assert laid["lm_head"].wt is params["embed"]  # a tied head reads the embedding as stored
    np.testing.assert_array_equal(np.asarray(laid["lm_head"].w), np.asarray(params["embed"]).T)
    assert laid["lm_head"].shape == (cfg.hidden_size, cfg.vocab_size)
    assert laid["embed"] is params["embed"] and "lm_head" not in params
    assert cpu_layout(laid) is laid  # idempotent
    ji.model.params.check_params(cfg, laid)  # shapes and dtypes read as [in, out]
    untied = ji.preset("tiny-llama")
    p = random_params(untied, seed=7)
    head = cpu_layout(inference_layout(p))["lm_head"]  # from the inference layout too
    np.testing.assert_array_equal(np.asarray(head.wt), np.asarray(p["lm_head"]).T)
    assert head.w is p["lm_head"]  # kept for one-row products
    assert all(lp["wo"].w is None for lp in cpu_layout(p)["layers"])  # only the head keeps both


def test_cpu_layout_fuses_dense_siblings():
    cfg = ji.preset("tiny-qwen2")  # biases: fused beside the weights
    params = random_params(cfg, seed=8)
    laid = cpu_layout(params)
    for i, lp in enumerate(laid["layers"]):
        assert not {"wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up"} & set(lp)
        qkv = np.concatenate([params["layers"][n][i] for n in ("wq", "wk", "wv")], axis=1)
        np.testing.assert_array_equal(np.asarray(lp["wqkv"].wt), qkv.T)
        bqkv = np.concatenate([params["layers"][n][i] for n in ("bq", "bk", "bv")])
        np.testing.assert_array_equal(np.asarray(lp["bqkv"]), bqkv)
    ji.model.params.check_params(cfg, laid)
    layers = tuple(dict(lp) for lp in laid["layers"])
    layers[1]["wqkv"] = TransposedDense(layers[1]["wqkv"].wt[:-1])  # one output row short
    with pytest.raises(ValueError, match=r"layers\[1\]/wqkv"):
        ji.model.params.check_params(cfg, dict(laid, layers=layers))


def test_forward_dense_and_score_take_the_inference_layout():
    """An engine on a CPU holds `inference_layout` params; the server scores prompts (`echo`
    with logprobs) through `ji.score` on them: the dense forward must loop over the unrolled
    layers and give the stored params' logits."""
    cfg = ji.ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    params = random_params(cfg, seed=3)
    tokens = np.random.RandomState(1).randint(0, 64, (2, 11)).astype(np.int32)
    want = np.asarray(ji.score(cfg, params, tokens))
    got = np.asarray(ji.score(cfg, inference_layout(params), tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 0.1  # a real signal, not two zero arrays
