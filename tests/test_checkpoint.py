"""Checkpoint loading and saving: sharded files, dtype conversion, and errors naming the tensor."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxinfer as ji
from tests.helpers import random_params

CFG = ji.preset("tiny-qwen2")  # biases and tied embeddings: the most tensors to get right


@pytest.fixture()
def saved(tmp_path):
    params = random_params(CFG, seed=1)
    path = str(tmp_path / "ckpt")
    ji.save_checkpoint(path, CFG, params)
    return path, params


def _rewrite(path, tensors):
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def test_sharded_checkpoint_loads_identically(saved, tmp_path):
    path, params = saved
    tensors = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(shard_dir / fname))
        weight_map.update({n: fname for n in part})
    with open(shard_dir / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    os.link(os.path.join(path, "config.json"), shard_dir / "config.json")
    cfg, loaded = ji.load_checkpoint(str(shard_dir))
    tokens = np.arange(20)[None] % CFG.vocab_size
    np.testing.assert_array_equal(
        np.asarray(ji.score(cfg, loaded, tokens)), np.asarray(ji.score(CFG, params, tokens))
    )


def test_dtype_conversion(saved):
    path, params = saved
    cfg, loaded = ji.load_checkpoint(path, dtype=jnp.bfloat16)
    assert cfg.dtype == "bfloat16"
    assert loaded["layers"]["wq"].dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(loaded["layers"]["wq"], np.float32), np.asarray(params["layers"]["wq"]),
        rtol=1e-2,
    )  # fmt: skip


def test_missing_tensor_is_named(saved):
    path, _ = saved
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    _rewrite(path, tensors)
    with pytest.raises(
        ValueError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_proj\.bias"
    ):
        ji.load_checkpoint(path)


def test_unexpected_tensor_is_named(saved):
    path, _ = saved
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
    _rewrite(path, tensors)
    with pytest.raises(
        ValueError, match=r"unexpected tensor.*model\.layers\.0\.mlp\.extra\.weight"
    ):
        ji.load_checkpoint(path)


def test_misshaped_tensor_is_named(saved):
    path, _ = saved
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((64, 64), np.float32)
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape"):
        ji.load_checkpoint(path)


def test_pickle_bin_is_refused_with_reason(tmp_path):
    path = tmp_path / "pickled"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(ji.to_hf_config(CFG)))
    (path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pytorch_model.bin.*arbitrary code.*safetensors"):
        ji.load_checkpoint(str(path))


def test_tied_checkpoint_with_redundant_lm_head_loads(saved):
    path, params = saved
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    _rewrite(path, tensors)
    _, loaded = ji.load_checkpoint(path)
    assert "lm_head" not in loaded


def test_save_refuses_non_float_params(tmp_path):
    params = dict(random_params(CFG, seed=1))
    params["embed"] = params["embed"].astype(jnp.int8)
    with pytest.raises(ValueError, match="jaxinfer.quant.save"):
        ji.save_checkpoint(str(tmp_path / "x"), CFG, params)


@pytest.mark.parametrize(
    "other, match",
    [
        (CFG.replace(hidden_size=2 * CFG.hidden_size), r"shape mismatch at embed"),
        (CFG.replace(num_layers=CFG.num_layers + 1), r"shape mismatch at layers/"),
        (ji.preset("tiny-llama"), r"params has keys"),  # untied, no biases
    ],
)
def test_save_refuses_params_of_another_config_and_writes_nothing(tmp_path, other, match):
    params = random_params(CFG, seed=1)
    path = tmp_path / "x"
    with pytest.raises(ValueError, match=match):
        ji.save_checkpoint(str(path), other, params)
    assert not path.exists()


def test_save_refuses_the_inference_layout(tmp_path):
    params = ji.inference_layout(random_params(CFG, seed=1))
    with pytest.raises(ValueError, match="stored params layout"):
        ji.save_checkpoint(str(tmp_path / "x"), CFG, params)
    assert not (tmp_path / "x").exists()


def test_tokenizer_saved_and_loaded(tmp_path):
    from jaxinfer.data import load_tokenizer as shipped_tokenizer

    tok = shipped_tokenizer()
    path = str(tmp_path / "tok")
    ji.save_checkpoint(path, CFG, random_params(CFG), tokenizer=tok)
    loaded = ji.load_tokenizer(path)
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    assert loaded.encode(text).ids == tok.encode(text).ids
    with pytest.raises(ValueError, match="no tokenizer.json"):
        ji.load_tokenizer(str(tmp_path))
