"""Token padding buckets chosen by a cost table (`jaxinfer/engine/buckets.py`) and the step's
params layout (`EngineConfig.layout`), against `ji.generate`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.engine import Engine, EngineConfig, buckets
from jaxinfer.engine.buckets import choose_buckets, cost_table, measure_token_buckets, pad_tokens
from jaxinfer.model.attention import project_qkv
from jaxinfer.model.decoder import mlp_block
from jaxinfer.model.params import lm_head
from jaxinfer.ops.linear import linear
from tests.helpers import random_params

CFG = ji.preset("tiny-llama").replace(eos_token_id=None)
BASE = dict(block_size=4, num_blocks=65, max_num_seqs=4, backend="reference")


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=3)


def test_choose_buckets_keeps_the_buckets_worth_their_compilation():
    # 1 saves under 5% of 2 (1.0 > 0.95 * 1.03): dropped; 2 saves 14% of 4: kept; and so on.
    table = {1: 1.0, 2: 1.03, 4: 1.2, 8: 1.5, 16: 3.0}
    assert choose_buckets(table) == (2, 4, 8, 16)
    assert choose_buckets(table, margin=0.25) == (2, 8, 16)  # 4 saves 20% of 8, 2 saves 31%
    # SmolLM2's head table (ms) of a process that dropped 1 at a 10% margin: 1 saves 8% of 4.
    smollm2 = {1: 2.14, 2: 2.47, 4: 2.33, 8: 2.71, 16: 3.91}
    assert choose_buckets(smollm2) == (1, 4, 8, 16)
    assert choose_buckets(smollm2, margin=0.1) == (4, 8, 16)
    assert choose_buckets({1: 1.0, 2: 1.0, 4: 1.01, 8: 0.99, 16: 1.02}) == (16,)  # flat: GPU-like
    assert choose_buckets({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}) == (1, 2, 4, 8, 16)
    assert choose_buckets(table, margin=0.0) == (1, 2, 4, 8, 16)


def test_pad_tokens():
    buckets = (2, 4, 16)
    got = [pad_tokens(n, buckets) for n in (1, 2, 3, 5, 16, 17, 100)]
    assert got == [2, 2, 4, 16, 16, 32, 128]


def test_measure_token_buckets_range(params):
    assert measure_token_buckets(CFG, params, 16) == (16,)  # nothing to measure
    assert measure_token_buckets(CFG, params, 64) == (64,)
    got = measure_token_buckets(CFG, params, 3)  # from 4 up to 16
    assert got[-1] == 16 and set(got) <= {4, 8, 16} and list(got) == sorted(got)


def _forms(params):
    """The params forms a step runs on: stacked dense, tied (no `lm_head`), the CPU layout
    (unrolled, transposed and fused), int4 and int8 layers (stacked) with a quantized head."""
    calib = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 16))
    int4 = ji.quant.QuantConfig(method="rtn", bits=4, group_size=32, quantize_lm_head=True)
    int8 = ji.quant.QuantConfig(method="rtn", bits=8, group_size=None, quantize_lm_head=True)
    return {
        "stacked": params,
        "tied": {k: v for k, v in params.items() if k != "lm_head"},
        "cpu_layout": ji.model.cpu_layout(params),
        "int4": ji.quant.quantize(CFG, params, int4, calib),
        "int8": ji.quant.quantize(CFG, params, int8, calib),
    }


def _products_ref(params, t):
    """`buckets.probe` written out for the stacked form: every layer's products without
    attention, then the head."""
    x = jnp.ones((t, CFG.hidden_size), jnp.float32) / CFG.hidden_size
    for i in range(CFG.num_layers):
        lp = jax.tree_util.tree_map(lambda a, i=i: a[i], params["layers"])
        q, k, v = project_qkv(x, lp, CFG, jnp.zeros((t,), jnp.int32))
        x = x + linear(q.reshape(t, -1), lp["wo"]) + 1e-6 * (k.sum() + v.sum())
        x = mlp_block(x, lp, CFG)
    return linear(x, lm_head(params))


def test_the_probe_runs_the_steps_products_on_every_params_form(params, monkeypatch):
    """The cost table times the layers' products and the head on the params as the step holds
    them; one table per params form (and range), so engines built alike share their buckets;
    a byte budget bounds the layers probed."""
    forms = _forms(params)
    want = _products_ref(params, 3)
    for name, p in forms.items():
        got = buckets.probe(CFG, p, 3)
        assert got.shape == (3, CFG.vocab_size), name
        if name in ("stacked", "tied", "cpu_layout"):  # the same products, other forms
            ref = want if name != "tied" else _products_ref({**p, "lm_head": p["embed"].T}, 3)
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=name)
    timed = []

    def counting(cfg, p, sizes):
        timed.append(buckets._params_form(p))
        table = cost_table(cfg, p, sizes)
        assert sorted(table) == list(sizes) and all(0 < s < 1 for s in table.values())
        return table

    monkeypatch.setattr(buckets, "_MEASURED", {})
    monkeypatch.setattr(buckets, "cost_table", counting)
    for p in forms.values():
        got = measure_token_buckets(CFG, p, 1)
        assert got[-1] == 16 and set(got) <= {1, 2, 4, 8, 16} and list(got) == sorted(got)
    assert len(timed) == len(forms) == len(set(timed))  # five forms, five tables
    for p in forms.values():  # the same forms again, other values: no new table
        again = jax.tree_util.tree_map(lambda x: x + 1 if x.dtype.kind == "f" else x, p)
        measure_token_buckets(CFG, again, 1)
    assert len(timed) == len(forms)
    measure_token_buckets(CFG, forms["stacked"], 2)  # another range: a table of its own
    assert len(timed) == len(forms) + 1

    layer_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(forms["cpu_layout"]["layers"][0]))
    for budget, n in ((1, 1), (layer_bytes + 1, 2), (1 << 40, CFG.num_layers)):
        monkeypatch.setattr(buckets, "_PROBE_BYTES", budget)
        for name in ("stacked", "cpu_layout"):
            assert len(buckets._probe_calls(CFG, forms[name])) == n, (name, budget)


@pytest.mark.parametrize(
    "extra",
    [
        dict(min_token_bucket=1, token_buckets="pow2", layout="stacked"),
        dict(min_token_bucket=1, token_buckets="measured", layout="auto"),
        dict(min_token_bucket=16, token_buckets="pow2", layout="auto"),
        dict(min_token_bucket=1, token_buckets=(2, 8), layout="auto"),  # another engine's
    ],
)
def test_engine_buckets_and_layout_match_generate(params, extra):
    engine = Engine(CFG, params, EngineConfig(**BASE, **extra))
    if extra["token_buckets"] == "pow2":
        assert engine.token_buckets == (extra["min_token_bucket"],)
    elif extra["token_buckets"] != "measured":  # explicit: kept as given
        assert engine.token_buckets == extra["token_buckets"]
    stacked = isinstance(engine.params["layers"], dict)
    assert stacked == (extra["layout"] == "stacked" or jax.default_backend() != "cpu")
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 9, 1]]
    sp = ji.SamplingParams(temperature=0.0, max_tokens=9)
    got = [o.token_ids for o in engine.generate(prompts, sp)]
    want = [o.token_ids for o in ji.generate(CFG, params, prompts, sp)]
    assert got == want
    ts = {shape[0] for shape in engine.step_shapes}
    # Every step's T is a kept bucket or a power of two past the largest one.
    assert all(t in engine.token_buckets or t > engine.token_buckets[-1] for t in ts), ts
    if extra == dict(min_token_bucket=1, token_buckets="pow2", layout="stacked"):
        assert min(ts) <= 4  # decode steps of 3 requests are not padded to 16 rows
    if extra["token_buckets"] == (2, 8):
        assert 2 not in ts and 8 in ts  # 3 decode rows pad to 8; no step has 2 tokens or fewer


@pytest.mark.parametrize("field,value", [("token_buckets", "fixed"), ("layout", "unrolled")])
def test_bad_bucket_and_layout_settings(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("value", [(), (3,), (4, 2), (2, 2), (True,), (1.0, 2.0), [0, 1], "1,2"])
def test_bad_explicit_token_buckets(value):
    with pytest.raises(ValueError, match="token_buckets="):
        EngineConfig(token_buckets=value)


def test_explicit_token_buckets_are_a_tuple_from_min_token_bucket():
    config = EngineConfig(token_buckets=[1, 4, 16])
    assert config.token_buckets == (1, 4, 16) and hash(config) is not None
    with pytest.raises(ValueError, match="starts below min_token_bucket=2"):
        EngineConfig(token_buckets=(1, 4), min_token_bucket=2)
