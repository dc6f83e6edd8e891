"""Tensor parallelism on the real SmolLM2-135M-Instruct, on 8 fake CPU devices (`test_tp.py`).

Not collected by the suite; run alone: `python -m pytest tests/distributed/_smollm2_cases.py`.

SmolLM2 has 9 query heads and 3 KV heads, so of the degrees 8 devices allow only 1 and 3 divide
them (9 would need 9 devices); 2, 4, 6 and 8 are refused by name. Degree 3 splits both head
counts (one KV head per device). float32 throughout.

Tolerance: an absolute 1e-5 on the logits, which the tiny models meet, is below float32's
resolution here: the row-parallel products are summed in another order (three partial sums and
an all-reduce instead of one dot), and over 30 layers this moves the logits by up to ~1e-4 at a
logit range of ~36 (2e-6 of it; measured 8.0e-5). The check is therefore 1e-5 *relative to the
largest logit*; a wrong shard, a missing all-reduce or a misplaced KV head moves logits by O(1).
Greedy tokens must be identical, every sharded run repeated 20 times.
"""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxinfer as ji  # noqa: E402
from jaxinfer.model.params import LINEAR_NAMES  # noqa: E402
from jaxinfer.quant import quantize_int8, rtn_quantize  # noqa: E402
from tests.distributed._tp_cases import _nan_cache, _run, _steps  # noqa: E402

REPEATS = 20
PROMPTS = [[1, 504, 3458, 314, 253, 1345, 30, 198, 2], [1, 9690, 28, 2683, 314, 2]]
GREEDY = ji.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@functools.cache
def _model(kind: str):
    cfg, params = ji.load_checkpoint(ji.models.path("smollm2-135m"))
    if kind == "dense":
        return cfg, params
    layers = dict(params["layers"])
    for name in LINEAR_NAMES:  # G = 32: each of 3 shards of wo (576 rows) gets 6 whole groups
        w = layers[name]
        layers[name] = (
            rtn_quantize(w, bits=4, group_size=32) if kind == "int4" else quantize_int8(w)
        )
    return cfg, {**params, "layers": layers}


@functools.cache
def _reference(kind: str):
    cfg, params = _model(kind)
    return _run(cfg, params, _nan_cache(cfg), _steps())[0]


@pytest.mark.parametrize("kind", ["dense", "int4", "int8"])
def test_logits_degree_3(kind):
    cfg, params = _model(kind)
    want = _reference(kind)
    sharded = ji.shard_params(cfg, params, 3)
    cache = ji.distributed.shard_cache(cfg, _nan_cache(cfg), 3)
    scale = float(np.abs(want).max())
    for i in range(REPEATS):
        got, out_cache = _run(cfg, sharded, cache, _steps())
        err = float(np.abs(got - want).max())
        assert err <= 1e-5 * scale, f"repeat {i}: {err} > 1e-5 * {scale}"
    assert {s.data.shape[2] for s in out_cache.k.addressable_shards} == {1}  # one KV head each


def test_greedy_degree_3():
    cfg, params = _model("dense")
    want = [o.token_ids for o in ji.generate(cfg, params, PROMPTS, GREEDY)]
    for i in range(REPEATS):
        got = [o.token_ids for o in ji.generate(cfg, params, PROMPTS, GREEDY, mesh=3)]
        assert got == want, f"repeat {i}"


def test_degree_1_is_the_single_device_forward():
    cfg, params = _model("dense")
    got, _ = _run(cfg, ji.shard_params(cfg, params, 1), _nan_cache(cfg), _steps())
    np.testing.assert_array_equal(got, _reference("dense"))


def test_other_degrees_refused_by_name():
    cfg, params = _model("dense")
    for degree in (2, 4, 6, 8):
        with pytest.raises(ValueError, match=rf"degree {degree} does not divide num_heads=9"):
            ji.shard_params(cfg, params, degree)
