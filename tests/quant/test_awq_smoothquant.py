"""AWQ scale and clip search, SmoothQuant smoothing, and the exactness of scale folding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import qtensor as formats
from jaxinfer.config import ModelConfig
from jaxinfer.model import forward_dense, init_params
from jaxinfer.ops.linear import linear
from jaxinfer.quant import awq, smoothquant
from jaxinfer.quant.calibrate import fold_scales, scale_plan
from jaxinfer.quant.rtn import quantize_int8, rtn_quantize

D_IN, D_OUT, TOKENS, G = 64, 32, 256, 16


def salient_inputs(seed, n_salient=4, boost=10.0):
    """Activations with a few large ("salient") channels, and two weights reading them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(TOKENS, D_IN)) * np.exp(0.5 * rng.normal(size=D_IN))
    x[:, rng.choice(D_IN, n_salient, replace=False)] *= boost
    ws = tuple(rng.normal(size=(D_IN, D_OUT)).astype(np.float32) for _ in range(2))
    return x.astype(np.float32), ws


def rtn_output_loss(x, ws, s):
    """Independent loss: fold s, RTN with rtn_quantize, undo s on the input side."""
    total = 0.0
    for w in ws:
        qw = rtn_quantize(jnp.asarray(w * s[:, None]), bits=4, group_size=G)
        y_hat = (x / s) @ np.asarray(formats.dequantize(qw), np.float64)
        total += np.mean((x @ w.astype(np.float64) - y_hat) ** 2)
    return total


@pytest.mark.parametrize("boost", [1.0, 10.0])
def test_awq_chosen_loss_le_loss_at_scale_one(boost):
    x, ws = salient_inputs(seed=int(boost), boost=boost)
    x_mean = jnp.mean(jnp.abs(jnp.asarray(x)), axis=0)
    s, alpha, losses = awq.awq_search(
        jnp.asarray(x), x_mean, tuple(map(jnp.asarray, ws)), bits=4, group_size=G, sym=False
    )
    s = np.asarray(s, np.float64)
    at_one = rtn_output_loss(x, ws, np.ones(D_IN))
    chosen = rtn_output_loss(x, ws, s)
    assert float(losses[0]) == pytest.approx(at_one, rel=1e-3)  # α = 0 is plain RTN
    assert float(jnp.min(losses)) == pytest.approx(chosen, rel=1e-3)
    assert chosen <= at_one
    if boost > 1:  # with salient channels the search must find a real improvement
        assert float(alpha) > 0 and chosen < 0.9 * at_one


def test_awq_scales_are_normalised():
    s = awq.awq_scales(jnp.asarray([0.1, 1.0, 10.0, 0.0]), 0.5)
    assert float(jnp.sqrt(jnp.max(s) * jnp.min(s))) == pytest.approx(1.0, rel=1e-6)
    assert bool(jnp.all(s > 0))
    np.testing.assert_allclose(np.asarray(awq.awq_scales(jnp.ones(4) * 3, 0.7)), 1.0, rtol=1e-6)


def test_awq_clip_never_increases_group_error():
    x, (w, _) = salient_inputs(seed=3)
    gram = awq.gram_blocks(jnp.asarray(x), G)
    np.testing.assert_allclose(  # the blocks of the full XᵀX are the same
        np.asarray(awq.gram_from_xtx(jnp.asarray(x).T @ jnp.asarray(x), G)), np.asarray(gram),
        rtol=1e-4, atol=1e-2,
    )  # fmt: skip
    ratios, errs = awq.awq_clip_search(gram, jnp.asarray(w), bits=4, group_size=G, sym=False)
    assert ratios.shape == (D_IN // G, D_OUT) and float(ratios.min()) >= 0.5
    clipped = rtn_quantize(jnp.asarray(w), bits=4, group_size=G, clip=ratios)
    plain = rtn_quantize(jnp.asarray(w), bits=4, group_size=G)
    e_clip = np.sum((x @ w - x @ np.asarray(formats.dequantize(clipped))) ** 2)
    e_plain = np.sum((x @ w - x @ np.asarray(formats.dequantize(plain))) ** 2)
    assert e_clip <= e_plain * (1 + 1e-5)
    assert float(ratios.min()) < 1.0  # some group prefers a clipped range


def test_smoothquant_beats_naive_w8a8_with_outlier_channels():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(TOKENS, D_IN)).astype(np.float32)
    x[:, [3, 17, 40]] *= 60.0  # activation outlier channels
    w = rng.normal(size=(D_IN, D_OUT)).astype(np.float32)
    exact = x.astype(np.float64) @ w

    naive = np.asarray(linear(jnp.asarray(x), quantize_int8(jnp.asarray(w), act_quant=True)))
    s = smoothquant.smooth_scales(jnp.max(jnp.abs(jnp.asarray(x)), axis=0), (jnp.asarray(w),))
    smoothed = np.asarray(
        linear(jnp.asarray(x) / s, smoothquant.smoothquant_weight(jnp.asarray(w), s))
    )
    e_naive = np.linalg.norm(naive - exact) / np.linalg.norm(exact)
    e_smooth = np.linalg.norm(smoothed - exact) / np.linalg.norm(exact)
    assert e_smooth < 0.5 * e_naive, (e_smooth, e_naive)
    # Negative control: smoothing by all-ones scales is naive W8A8.
    ones = np.asarray(
        linear(jnp.asarray(x), smoothquant.smoothquant_weight(jnp.asarray(w), jnp.ones(D_IN)))
    )
    np.testing.assert_allclose(ones, naive, rtol=1e-6, atol=1e-5)


def test_smooth_scales_formula_and_validation():
    a = jnp.asarray([4.0, 1.0, 0.0])
    w = jnp.asarray([[1.0, -2.0], [0.25, 0.0], [3.0, 1.0]])
    s = smoothquant.smooth_scales(a, (w,), alpha=0.5)
    np.testing.assert_allclose(np.asarray(s), [np.sqrt(4 / 2), np.sqrt(1 / 0.25), 1.0], rtol=1e-6)
    with pytest.raises(ValueError, match="alpha=1.5"):
        smoothquant.smooth_scales(a, (w,), alpha=1.5)


# ------------------------------------------------------------------------------ folding


MHA_BIAS = ModelConfig(  # H == K, so AWQ also folds wo's input into wv (and bv)
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16,
    intermediate_size=48, attention_bias=True, architecture="Qwen2ForCausalLM",
    tie_word_embeddings=True,
)  # fmt: skip


@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_folding_scales_leaves_float_outputs_unchanged(method):
    cfg = MHA_BIAS
    params = init_params(cfg, jax.random.key(0), std=0.2)
    key = jax.random.key(1)
    params["layers"] = dict(params["layers"])
    for b in ("bq", "bk", "bv"):
        key, sub = jax.random.split(key)
        params["layers"][b] = 0.1 * jax.random.normal(sub, params["layers"][b].shape)
    plan = scale_plan(cfg, method)
    assert [t for t, _, _ in plan] == (
        ["attn_in", "mlp_in", "down_in", "o_in"] if method == "awq" else
        ["attn_in", "mlp_in", "down_in"]
    )  # fmt: skip
    dims = {"attn_in": 32, "mlp_in": 32, "down_in": 48, "o_in": 32}
    rng = np.random.default_rng(2)
    folded_layers = []
    for layer in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, i=layer: a[i], params["layers"])
        scales = {t: jnp.asarray(np.exp(rng.normal(size=dims[t])), jnp.float32) for t in dims}
        folded_layers.append(fold_scales(lp, scales, plan))
    folded = dict(params, layers=jax.tree.map(lambda *a: jnp.stack(a), *folded_layers))
    assert not np.allclose(np.asarray(folded["layers"]["wq"]), np.asarray(params["layers"]["wq"]))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, 12)), jnp.int32)
    ref = np.asarray(forward_dense(params, cfg, tokens))
    got = np.asarray(forward_dense(folded, cfg, tokens))
    assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


def test_gqa_plan_skips_the_o_fold_and_says_so():
    cfg = MHA_BIAS.replace(num_kv_heads=1)
    notes = []
    plan = scale_plan(cfg, "awq", notes)
    assert "o_in" not in [t for t, _, _ in plan]
    assert notes and "GQA" in notes[0]
