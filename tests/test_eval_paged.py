"""Scoring with serving numerics: `eval.lm_stats_paged` and `eval.compare_to_reference`.

References: `lm_stats` (dense forward) for a float cache, and a dense forward whose keys and values
go through `quantize_kv` -> `dequantize_kv` for int8 / fp8 caches (the paged forward must equal
it: same K/V rounding, same attention, only the storage differs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import eval as jeval
from jaxinfer.cache.kv_formats import dequantize_kv, quantize_kv
from jaxinfer.config import ModelConfig
from jaxinfer.model.attention import project_qkv
from jaxinfer.model.decoder import logits_from_hidden, mlp_block
from jaxinfer.model.layers import rms_norm
from jaxinfer.ops.attention import dense_causal_attention
from jaxinfer.ops.linear import linear
from tests.helpers import random_params

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,  # GQA
    head_dim=16,
    intermediate_size=64,
    max_position_embeddings=32,
    tie_word_embeddings=True,
)
OTHER = CFG.replace(num_layers=1, intermediate_size=32)
BATCH = 4  # 5 windows below: the second batch is padded, and the padding must not count


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=0, std=0.3)


@pytest.fixture(scope="module")
def windows():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, size=(5, 17)).astype(np.int32)


@pytest.fixture(scope="module")
def dense(params, windows):
    return jeval.lm_stats(CFG, params, windows, batch_size=BATCH)


def _fake_quant_logits(params, cfg, tokens, fmt):
    """Dense forward with every layer's roped K and V rounded through the KV format."""
    x = params["embed"][tokens]  # [B, S, E]
    bsz, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n), (bsz, n))
    for layer in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, i=layer: a[i], params["layers"])
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = project_qkv(h, lp, cfg, positions)
        if fmt != "float":
            k = dequantize_kv(*quantize_kv(k, fmt))
            v = dequantize_kv(*quantize_kv(v, fmt))
        o = dense_causal_attention(q, k, v)  # [B, S, H, D]
        x = x + linear(o.reshape(bsz, n, -1), lp["wo"])
        x = mlp_block(x, lp, cfg)
    return logits_from_hidden(params, cfg, x)  # [B, S, V]


def _nll(logits, targets) -> float:
    logits = np.asarray(logits, np.float64)
    m = logits.max(-1, keepdims=True)
    log_p = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return float(-np.mean(np.take_along_axis(log_p, targets[..., None], -1)))


@pytest.mark.parametrize("block_size", [4, 5])  # 5: the last block of a window is partial
def test_float_cache_equals_dense(params, windows, dense, block_size):
    paged = jeval.lm_stats_paged(
        CFG, params, windows, "float", block_size=block_size, batch_size=BATCH
    )
    assert paged.num_tokens == dense.num_tokens == 5 * 16
    assert paged.nll == pytest.approx(dense.nll, rel=1e-5)
    assert paged.accuracy == dense.accuracy


@pytest.mark.parametrize("fmt, close", [("int8", 2e-2), ("fp8", 5e-2)])
def test_quantized_cache_is_close_but_not_identical(params, windows, dense, fmt, close):
    paged = jeval.lm_stats_paged(CFG, params, windows, fmt, block_size=4, batch_size=BATCH)
    ref = _nll(_fake_quant_logits(params, CFG, jnp.asarray(windows[:, :-1]), fmt), windows[:, 1:])
    assert paged.nll == pytest.approx(ref, rel=1e-5)  # the serving numerics, exactly
    assert paged.nll != dense.nll  # the cache really is quantized
    assert abs(paged.nll - dense.nll) / dense.nll < close


def test_fake_quant_reference_float_is_the_model(params, windows, dense):
    # Guards the reference itself: without rounding it reproduces the dense forward.
    ref = _nll(
        _fake_quant_logits(params, CFG, jnp.asarray(windows[:, :-1]), "float"), windows[:, 1:]
    )
    assert ref == pytest.approx(dense.nll, rel=1e-5)


def test_compare_to_reference(params, windows, dense):
    other = random_params(OTHER, seed=3, std=0.3)
    ref, stats = jeval.compare_to_reference(
        (CFG, params),
        {"same": (CFG, params), "paged": (CFG, params, "float"), "int8": (CFG, params, "int8"),
         "other": (OTHER, other)},
        windows,
        block_size=4,
        batch_size=BATCH,
    )  # fmt: skip
    assert ref.nll == pytest.approx(dense.nll, rel=1e-5) and ref.accuracy == dense.accuracy
    assert ref.kl == pytest.approx(0.0, abs=1e-6) and ref.agreement == 1.0
    assert stats["same"].kl == pytest.approx(0.0, abs=1e-6) and stats["same"].agreement == 1.0
    assert stats["paged"].kl < 1e-6 and stats["paged"].agreement == 1.0
    # int8 KV: a small but non-zero distance, and the same nll as lm_stats_paged.
    int8 = jeval.lm_stats_paged(CFG, params, windows, "int8", block_size=4, batch_size=BATCH)
    assert stats["int8"].nll == pytest.approx(int8.nll, rel=1e-5)
    assert 0.0 < stats["int8"].kl < 1e-2
    # Another model (the negative control): matches pair_stats and lm_stats, and is far away.
    pair = jeval.pair_stats((CFG, params), (OTHER, other), windows, batch_size=BATCH)
    alone = jeval.lm_stats(OTHER, other, windows, batch_size=BATCH)
    assert stats["other"].kl == pytest.approx(pair.kl, rel=1e-5)
    assert stats["other"].agreement == pair.agreement
    assert stats["other"].nll == pytest.approx(alone.nll, rel=1e-5)
    assert stats["other"].kl > 100 * stats["int8"].kl
    assert stats["other"].agreement < 1.0


def test_validation(params, windows):
    with pytest.raises(ValueError, match="int4"):
        jeval.lm_stats_paged(CFG, params, windows, "int4")
    with pytest.raises(ValueError, match="kv_format=None"):
        jeval.lm_stats_paged(CFG, params, windows, None)
    with pytest.raises(ValueError, match="block_size"):
        jeval.lm_stats_paged(CFG, params, windows, "float", block_size=0)
    with pytest.raises(ValueError, match="batch_size"):
        jeval.compare_to_reference((CFG, params), {}, windows, batch_size=0)
    with pytest.raises(ValueError, match="candidate 'bad'"):
        jeval.compare_to_reference((CFG, params), {"bad": (CFG,)}, windows)
    with pytest.raises(ValueError, match="vocab_size"):
        jeval.compare_to_reference(
            (CFG, params), {"v": (CFG.replace(vocab_size=32), params)}, windows
        )
