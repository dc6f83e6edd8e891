"""check_params: (cfg, params) pairs that disagree are refused at every entry point, by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.model.params import check_params
from tests.helpers import random_params

CFG = ji.preset("tiny-llama").replace(eos_token_id=None)
WIDE = CFG.replace(intermediate_size=2 * CFG.intermediate_size)  # same layers, other MLP


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=3)


def test_accepts_every_form_of_matching_params(params):
    check_params(CFG, params)
    check_params(CFG, ji.inference_layout(params))  # tuple of layers
    tied = ji.preset("tiny-qwen2")
    check_params(tied, ji.inference_layout(random_params(tied, seed=1)))  # tied + own lm_head
    calib = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 16))
    for qcfg in (
        ji.quant.QuantConfig(method="rtn", bits=4, group_size=32),
        ji.quant.QuantConfig(method="rtn", bits=8, group_size=None),
    ):
        check_params(CFG, ji.quant.quantize(CFG, params, qcfg, calib))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda p: {**p, "embed": p["embed"][:, :-1]}, r"shape mismatch at embed: \(128, 63\)"),
        (lambda p: {k: v for k, v in p.items() if k != "final_norm"}, "params has keys"),
        (
            lambda p: {**p, "layers": {**p["layers"], "bq": p["layers"]["wq"][:, 0]}},
            r"params\['layers'\] has keys",
        ),
        (
            lambda p: {**p, "layers": {**p["layers"], "wo": p["layers"]["wo"][:1]}},
            r"shape mismatch at layers/wo",
        ),
        (lambda p: {**p, "layers": ji.inference_layout(p)["layers"][:1]}, "params hold 1 layers"),
        (lambda p: [p], "must be a dict"),
        (lambda p: {**p, "final_norm": 1.0}, "shape mismatch at final_norm: float"),
    ],
)
def test_names_the_first_disagreement(params, mutate, match):
    with pytest.raises(ValueError, match=match):
        check_params(CFG, mutate(params))


def test_quantized_leaf_of_another_shape(params):
    calib = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 16))
    q = ji.quant.quantize(CFG, params, ji.quant.QuantConfig(group_size=32), calib)
    with pytest.raises(
        ValueError, match=r"shape mismatch at layers/w_(gate|up|down): quantized weight"
    ):
        check_params(WIDE, q)


ENTRY_POINTS = {
    "generate": lambda p: ji.generate(WIDE, p, [[1, 2]], ji.SamplingParams(max_tokens=2)),
    "score": lambda p: ji.score(WIDE, p, [[1, 2]]),
    "engine": lambda p: ji.Engine(WIDE, p, ji.EngineConfig(num_blocks=16)),
    "speculative target": lambda p: ji.speculative.generate(
        (WIDE, p), "ngram", [[1, 2]], ji.SamplingParams(max_tokens=2)
    ),
    "speculative draft": lambda p: ji.speculative.generate(
        (CFG, p), (WIDE, p), [[1, 2]], ji.SamplingParams(max_tokens=2)
    ),
    "quantize": lambda p: ji.quant.quantize(
        WIDE, p, ji.quant.QuantConfig(), np.ones((1, 8), np.int32)
    ),
    "lm_stats": lambda p: ji.eval.lm_stats(WIDE, p, np.ones((2, 9), np.int32)),
    "lm_stats_paged": lambda p: ji.eval.lm_stats_paged(WIDE, p, np.ones((2, 9), np.int32)),
    "compare_to_reference": lambda p: ji.eval.compare_to_reference(
        (CFG, p), {"wide": (WIDE, p)}, np.ones((2, 9), np.int32)
    ),
    "save_checkpoint": lambda p: ji.save_checkpoint("/nonexistent/never-written", WIDE, p),
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_entry_points_refuse_a_mismatched_pair(params, name):
    """Each would otherwise fail inside a trace (or, saving, write a contradictory directory)."""
    with pytest.raises(ValueError, match=r"shape mismatch at layers/w_(gate|up|down)"):
        ENTRY_POINTS[name](params)


def test_quantize_refuses_the_inference_layout(params):
    calib = np.ones((1, 8), np.int32)
    with pytest.raises(ValueError, match="stored params layout"):
        ji.quant.quantize(CFG, ji.inference_layout(params), ji.quant.QuantConfig(), calib)


def test_positions_beyond_the_model_are_refused_for_calibration(params):
    tokens = np.ones((1, CFG.max_position_embeddings + 1), np.int32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ji.quant.quantize(CFG, params, ji.quant.QuantConfig(), tokens)
    assert jnp.asarray(params["embed"]).shape[0] == CFG.vocab_size


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda p: {
                **p,
                "layers": {**p["layers"], "wq": p["layers"]["wq"].astype(jnp.bfloat16)},
            },
            r"dtype mismatch at layers/wq: bfloat16; the model config says dtype='float32'",
        ),
        (
            lambda p: {**p, "embed": p["embed"].astype(jnp.int32)},
            r"dtype mismatch at embed: int32",
        ),
        (
            lambda p: ji.inference_layout({**p, "final_norm": p["final_norm"].astype(jnp.float16)}),
            r"dtype mismatch at final_norm: float16",
        ),
    ],
)
def test_dtype_disagreeing_with_cfg_is_refused_by_leaf(params, mutate, match):
    """Issue 15, cause 7: bf16 params against a float32 config ran silently.

    Refused rather than converted: the config decides the activation and cache dtypes, and a
    conversion at every entry point would copy the whole model at every call.
    """
    with pytest.raises(ValueError, match=match):
        check_params(CFG, mutate(params))
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    check_params(CFG.replace(dtype="bfloat16"), bf16)  # converted deliberately: accepted
    with pytest.raises(ValueError, match="dtype mismatch"):
        ji.score(CFG, bf16, [[1, 2]])
