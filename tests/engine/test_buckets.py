"""Token padding buckets chosen by a cost table (`jaxinfer/engine/buckets.py`) and the step's
params layout (`EngineConfig.layout`), against `ji.generate`."""

from __future__ import annotations

import jax
import pytest

import jaxinfer as ji
from jaxinfer.engine import Engine, EngineConfig, buckets
from jaxinfer.engine.buckets import choose_buckets, cost_table, measure_token_buckets, pad_tokens
from jaxinfer.ops.linear import linear
from jaxinfer.quant import quantize_int8, rtn_quantize
from jaxinfer.transposed import transpose_dense
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


def _heads(params):
    """The head forms a step runs on: dense, tied, transposed (the CPU layout), int8, int4."""
    tied = {k: v for k, v in params.items() if k != "lm_head"}
    return {
        "dense": params,
        "tied": tied,
        "transposed": {**params, "lm_head": transpose_dense(params["lm_head"])},
        "int8": {**params, "lm_head": quantize_int8(params["lm_head"])},
        "int4": {**params, "lm_head": rtn_quantize(params["lm_head"], group_size=32)},
    }


def test_cost_table_times_the_params_own_head(params, monkeypatch):
    """Every head form is timed as the step holds it, and a table is measured once per head form
    (and range): engines built alike share their buckets."""
    timed, traced = [], []

    def counting(cfg, p, sizes):
        timed.append(buckets._head_form(p))
        return cost_table(cfg, p, sizes)

    def recording(x, w):
        traced.append(("array" if isinstance(w, jax.core.Tracer) else type(w).__name__, w.shape))
        return linear(x, w)

    monkeypatch.setattr(buckets, "_MEASURED", {})
    monkeypatch.setattr(buckets, "cost_table", counting)
    monkeypatch.setattr(buckets, "linear", recording)
    buckets._probe.clear_cache()  # traced again, through `recording`
    heads = _heads(params)
    e, v = CFG.hidden_size, CFG.vocab_size
    for name, p in heads.items():
        traced.clear()
        table = cost_table(CFG, p, [1, 2, 4])
        assert sorted(table) == [1, 2, 4] and all(0 < s < 1 for s in table.values()), name
        kind = {"transposed": "TransposedDense", "int8": "Int8Weight", "int4": "Int4Weight"}
        assert traced and all(t == (kind.get(name, "array"), (e, v)) for t in traced), name
        got = measure_token_buckets(CFG, p, 1)
        assert got[-1] == 16 and set(got) <= {1, 2, 4, 8, 16} and list(got) == sorted(got)
    assert len(timed) == len(heads) == len(set(timed))  # five forms, five tables
    for p in heads.values():  # the same forms again, other values: no new table
        again = jax.tree_util.tree_map(lambda x: x + 1 if x.dtype.kind == "f" else x, p)
        measure_token_buckets(CFG, again, 1)
    assert len(timed) == len(heads)
    measure_token_buckets(CFG, heads["dense"], 2)  # another range: a table of its own
    assert len(timed) == len(heads) + 1
    buckets._probe.clear_cache()  # not through `recording` after this test


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
