"""ModelConfig: HF config.json round trips, presets, and clear errors."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import jaxinfer as ji  # noqa: E402
from jaxinfer.config import (  # noqa: E402
    PRESETS,
    ModelConfig,
    RopeScaling,
    from_hf_config,
    to_hf_config,
)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_roundtrip_through_hf_config(name):
    cfg = PRESETS[name]
    hf = to_hf_config(cfg)
    assert from_hf_config(hf) == cfg
    # transformers parses it into the right class with the same shapes.
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    hf_cfg = transformers.AutoConfig.for_model(hf["model_type"], **fields)
    assert from_hf_config(hf_cfg.to_dict()) == cfg


def test_from_transformers_llama3_config():
    hf = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ).to_dict()  # fmt: skip
    hf["architectures"] = ["LlamaForCausalLM"]
    cfg = from_hf_config(hf)
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.rope_theta == 500000.0 and cfg.num_kv_heads == 2 and cfg.head_dim == 16


def test_qwen2_without_use_sliding_window_has_no_window():
    hf = to_hf_config(PRESETS["tiny-qwen2"].replace(sliding_window=32))
    hf["use_sliding_window"] = False
    assert from_hf_config(hf).sliding_window is None


def test_preset_param_counts():
    assert round(PRESETS["llama2-7b"].num_params() / 1e9, 2) == 6.74
    assert round(PRESETS["llama3-8b"].num_params() / 1e9, 2) == 8.03
    assert round(PRESETS["mistral-7b"].num_params() / 1e9, 2) == 7.24
    assert round(PRESETS["qwen2.5-7b"].num_params() / 1e9, 2) == 7.62
    assert 4e6 < PRESETS["bench-5m"].num_params() < 6e6


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({"num_key_value_heads": 3}, "num_kv_heads=3"),
    ],
)
def test_bad_hf_config_raises(patch, match):
    hf = to_hf_config(PRESETS["tiny-llama"])
    hf.update(patch)
    with pytest.raises(ValueError, match=match):
        from_hf_config(hf)


def test_bad_fields_and_unknown_preset():
    with pytest.raises(ValueError, match="hidden_size=0"):
        PRESETS["tiny-llama"].replace(hidden_size=0)
    with pytest.raises(ValueError, match="dtype='int8'"):
        PRESETS["tiny-llama"].replace(dtype="int8")
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        ji.preset("nope")


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_hidden_act_round_trips(act):
    """Issue 15, cause 8: hidden_act was dropped on load and written back as "silu"."""
    cfg = PRESETS["tiny-llama"].replace(hidden_act=act)
    hf = to_hf_config(cfg)
    assert hf["hidden_act"] == act
    assert from_hf_config(hf) == cfg
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    assert transformers.AutoConfig.for_model("llama", **fields).hidden_act == act
    assert hash(cfg) != hash(PRESETS["tiny-llama"]) or act == "silu"  # static under jit


def test_unsupported_hidden_act_is_refused_by_name():
    hf = to_hf_config(PRESETS["tiny-llama"])
    hf["hidden_act"] = "relu"
    with pytest.raises(ValueError, match=r"hidden_act='relu'.*expected one of"):
        from_hf_config(hf, source="config.json in /some/dir")
    with pytest.raises(ValueError, match="hidden_act='quick_gelu'"):
        PRESETS["tiny-llama"].replace(hidden_act="quick_gelu")


def test_activations_cover_the_names():
    from jaxinfer.config import HIDDEN_ACTS
    from jaxinfer.model.layers import ACTIVATIONS

    assert set(ACTIVATIONS) == set(HIDDEN_ACTS)


def test_model_config_dict_round_trip():
    """One serialiser (artifacts and training runs): every field, rope_scaling included."""
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 1024),
        sliding_window=16, hidden_act="gelu", dtype="bfloat16",
    )  # fmt: skip
    d = json.loads(json.dumps(cfg.to_dict()))
    assert ModelConfig.from_dict(d) == cfg
    old = {k: v for k, v in d.items() if k != "hidden_act"}  # written before the field existed
    assert ModelConfig.from_dict(old).hidden_act == "silu"
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['n_layer'\]"):
        ModelConfig.from_dict({**d, "n_layer": 2})


def test_model_config_ints_follow_the_checks_policy():
    """numpy ints count as ints (stored as Python ints); bools and whole floats do not."""
    cfg = ModelConfig(64, 32, np.int64(2), 4, 2, 8, 48, sliding_window=np.int32(16))
    assert type(cfg.num_layers) is int and type(cfg.sliding_window) is int
    assert cfg == ModelConfig(64, 32, 2, 4, 2, 8, 48, sliding_window=16)
    for bad in (True, 2.0):
        with pytest.raises(ValueError, match="num_layers"):
            ModelConfig(64, 32, bad, 4, 2, 8, 48)
