"""GPTQ true-sequential calibration: each later linear is calibrated on the inputs it will see."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.model import init_params
from jaxinfer.model.decoder import decoder_layer_dense, decoder_layer_dense_taps
from jaxinfer.model.params import LINEAR_NAMES
from jaxinfer.qtensor import dequantize, resolve_group_size
from jaxinfer.quant import calibrate, gptq
from jaxinfer.quant.calibrate import INPUT_OF, QuantConfig, quantize, quantize_with_report

# GQA (H = 2, K = 1) with qkv bias, as the shipped target has GQA: wk/wv are [32, 16].
CFG = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
    intermediate_size=32, attention_bias=True, architecture="Qwen2ForCausalLM",
)  # fmt: skip
# Act order without static groups: the stored weights carry a row permutation, so the
# dequantization inside `partial_tap_stats` has to undo it.
SEQ = QuantConfig(
    "gptq", bits=4, group_size=16, act_order=True, static_groups=False, batch_size=4,
    true_sequential=True,
)  # fmt: skip
LATER = ("wo", "w_gate", "w_up", "w_down")  # the linears whose inputs true_sequential recomputes


def layer(params: dict, i: int) -> dict:
    return jax.tree.map(lambda a: a[i], params["layers"])


def direct_hessians(cfg, params, qparams, calib, *, sequential=True) -> list[dict]:
    """Per layer {tap: 2 XᵀX / N·S} in float64, the whole calibration batch at once.

    The layer input comes from the quantized layers before it; inside the layer each tap is
    computed with the earlier `SEQUENTIAL_GROUPS` replaced by their dequantized weights
    (`sequential`) or from the float layer.
    """
    x = params["embed"][jnp.asarray(calib)]  # [N, S, E]
    out = []
    for i in range(cfg.num_layers):
        lp, qlp = layer(params, i), layer(qparams, i)
        mixed, hs = dict(lp), {}
        for tap, names in calibrate.SEQUENTIAL_GROUPS:
            _, taps = decoder_layer_dense_taps(x, mixed, cfg)
            X = np.asarray(taps[tap], np.float64).reshape(-1, taps[tap].shape[-1])
            hs[tap] = 2.0 * X.T @ X / calib.size
            if sequential:
                for name in names:
                    mixed[name] = dequantize(qlp[name], jnp.float32)
        out.append(hs)
        x = decoder_layer_dense(x, qlp, cfg)
    return out


def rel_err(H, w, qw) -> float:
    """‖X(W − Ŵ)‖² / ‖XW‖² in float64 from H ∝ XᵀX."""
    w = np.asarray(w, np.float64)
    d = w - np.asarray(dequantize(qw, jnp.float32), np.float64)
    return float(np.sum(d * (H @ d)) / np.sum(w * (H @ w)))


@pytest.fixture(scope="module")
def model():
    params = init_params(CFG, jax.random.key(0), std=0.1)
    calib = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(8, 16)).astype(np.int32)
    return params, calib


@pytest.fixture(scope="module")
def recorded(model):
    """The sequential run, with the Hessian of every `gptq_core` call recorded in call order."""
    params, calib = model
    calls = []
    core = gptq.gptq_core

    def recording(w, H, **kw):
        calls.append(np.asarray(H, np.float64))
        return core(w, H, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gptq, "gptq_core", recording)
        qparams, report = quantize_with_report(CFG, params, SEQ, calib)
    return qparams, report, calls


def test_gptq_hessians_are_those_of_the_partly_quantized_layer(model, recorded):
    params, calib = model
    qparams, report, calls = recorded
    order = [name for _, names in calibrate.SEQUENTIAL_GROUPS for name in names]
    assert order == list(LINEAR_NAMES) and len(calls) == CFG.num_layers * len(LINEAR_NAMES)
    seq = direct_hessians(CFG, params, qparams, calib)
    flt = direct_hessians(CFG, params, qparams, calib, sequential=False)
    for i in range(CFG.num_layers):
        for j, name in enumerate(LINEAR_NAMES):
            got, want = calls[i * len(LINEAR_NAMES) + j], seq[i][INPUT_OF[name]]
            scale = np.abs(want).max()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
            # the report measures the error on the inputs GPTQ used
            w, qw = layer(params, i)[name], layer(qparams, i)[name]
            assert report.errors[i][name] == pytest.approx(rel_err(want, w, qw), rel=1e-3)
            # The float layer's taps are far outside that tolerance (the test can fail), except
            # attn_in, which both share.
            diff = np.abs(flt[i][INPUT_OF[name]] - want).max() / scale
            assert (diff > 1e-3) == (name in LATER), (name, diff)


def reference_non_sequential(cfg, params, qcfg, calib):
    """The pre-true_sequential driver for GPTQ: every tap from the float layer."""
    dtype = jnp.dtype(cfg.dtype)
    n, s = calib.shape
    bs = calibrate._batch_size(n, qcfg.batch_size)
    x = params["embed"][jnp.asarray(calib)]
    qlayers = []
    for i in range(cfg.num_layers):
        lp = layer(params, i)
        batches = [x[k : k + bs] for k in range(0, n, bs)]
        parts = [calibrate.tap_stats(lp, xb, cfg) for xb in batches]
        xtx = {tap: parts[0][tap]["xtx"] for tap in parts[0]}
        for p in parts[1:]:
            xtx = {tap: xtx[tap] + p[tap]["xtx"] for tap in xtx}
        qlp = dict(lp)
        for name in LINEAR_NAMES:
            qlp[name], _, _ = gptq.gptq_core(
                lp[name], 2.0 * xtx[INPUT_OF[name]] / (n * s), bits=qcfg.bits,
                group_size=resolve_group_size(qcfg.group_size, lp[name].shape[0]),
                sym=qcfg.sym, damp=float(qcfg.damp), act_order=qcfg.act_order,
                static_groups=qcfg.static_groups, blocksize=qcfg.blocksize,
                scale_dtype=dtype.name,
            )  # fmt: skip
        qlayers.append(qlp)
        x = jnp.concatenate([calibrate.layer_forward(qlp, xb, cfg) for xb in batches])
    return dict(params, layers=jax.tree.map(lambda *a: jnp.stack(a), *qlayers))


def test_non_sequential_reproduces_float_layer_calibration_exactly(model, recorded):
    params, calib = model
    off = dataclasses.replace(SEQ, true_sequential=False)
    got = quantize(CFG, params, off, calib)
    want = reference_non_sequential(CFG, params, off, calib)
    chex.assert_trees_all_equal(got, want)  # same tree, bit-identical leaves
    # Same first group (same layer-0 input), different later linears.
    seq = recorded[0]["layers"]
    for name in LINEAR_NAMES:
        a, b = seq[name].packed[0], got["layers"][name].packed[0]
        assert np.array_equal(np.asarray(a), np.asarray(b)) == (name not in LATER), name


@pytest.mark.parametrize(
    "qcfg",
    [
        QuantConfig("rtn", bits=4, group_size=16),
        QuantConfig("awq", bits=4, group_size=16),
        QuantConfig("smoothquant", bits=8, group_size=None),
    ],
    ids=["rtn", "awq", "smoothquant"],
)
def test_other_methods_ignore_the_flag(model, qcfg):
    params, calib = model
    on = quantize(CFG, params, qcfg, calib)
    off = quantize(CFG, params, dataclasses.replace(qcfg, true_sequential=False), calib)
    for a, b in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequential_weights_fit_the_inputs_they_see(seed):
    """On the inputs the sequential layer feeds wo, w_gate, w_up, w_down, its weights beat the
    float-calibrated ones; on the float layer's inputs (layer 0) the float-calibrated ones win.

    Not the end-to-end error: on tiny random models the hidden states after the last layer are
    not reliably closer to the float model's with true_sequential. Measured in-sample (16 x 32
    calibration tokens): closer on 14/16 seeds at w2g16, 9/12 at w3g16, 8/12 at w4 per channel,
    7/12 at w3g16 act-order (mean error ratio 0.97-1.0): a random layer shifts the later inputs
    too little for the better fit to beat GPTQ's rounding noise. The per-linear objectives at
    2 bits, where the shift is large, held for all 8 later linears on 16 of 16 seeds (worst
    ratio 0.976 on the sequential inputs, 0.963 for the control).
    """
    cfg = CFG.replace(num_kv_heads=2)  # a second head layout
    params = init_params(cfg, jax.random.key(seed), std=0.1)
    rng = np.random.default_rng(seed)
    calib = rng.integers(0, cfg.vocab_size, size=(8, 16)).astype(np.int32)
    q = QuantConfig("gptq", bits=2, group_size=16, batch_size=4)
    seq = quantize(cfg, params, q, calib)
    non = quantize(cfg, params, dataclasses.replace(q, true_sequential=False), calib)
    H_seq = direct_hessians(cfg, params, seq, calib)
    H_flt = direct_hessians(cfg, params, seq, calib, sequential=False)
    for i in range(cfg.num_layers):
        ls, ln, lp = layer(seq, i), layer(non, i), layer(params, i)
        for name in LATER:
            H = H_seq[i][INPUT_OF[name]]
            assert rel_err(H, lp[name], ls[name]) <= rel_err(H, lp[name], ln[name]), (i, name)
    # Negative control, layer 0 (the same layer input for both runs): on the float taps, the
    # weights GPTQ fitted to them win.
    ls, ln, lp = layer(seq, 0), layer(non, 0), layer(params, 0)
    for name in LATER:
        H = H_flt[0][INPUT_OF[name]]
        assert rel_err(H, lp[name], ln[name]) <= rel_err(H, lp[name], ls[name]), name


def test_partial_tap_stats_compile_once_per_tap():
    cfg = CFG.replace(num_layers=3, intermediate_size=48)  # fresh jit caches
    params = init_params(cfg, jax.random.key(3), std=0.1)
    calib = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(4, 16)).astype(np.int32)
    before = calibrate.partial_tap_stats._cache_size()
    quantize(
        cfg,
        params,
        QuantConfig("gptq", bits=4, group_size=16, batch_size=2, true_sequential=True),
        calib,
    )
    assert calibrate.partial_tap_stats._cache_size() - before == len(LATER) - 1  # o, mlp, down


def test_true_sequential_must_be_a_bool():
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match=r"true_sequential=.*expected a bool"):
            QuantConfig("gptq", true_sequential=bad)
    # numpy scalars of the right kind are accepted as Python values (issue 15, cause 3).
    assert QuantConfig("gptq", true_sequential=np.bool_(True)).true_sequential is True
    q = QuantConfig("gptq", bits=3, true_sequential=False)
    assert QuantConfig.from_dict(q.to_dict()) == q
    old = {k: v for k, v in q.to_dict().items() if k != "true_sequential"}
    assert not QuantConfig.from_dict(old).true_sequential  # a dict without the key: the default
