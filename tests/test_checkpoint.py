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


# --------------------------------------------------------------------------- issue 15: hardening


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_is_refused_by_name(saved, bad):
    """Cause 6: a NaN / Inf weight loaded and generated token 0 forever."""
    path, _ = saved
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
    _rewrite(path, tensors)
    with pytest.raises(
        ValueError, match=r"non-finite.*model\.layers\.1\.mlp\.up_proj\.weight \(1 NaN/Inf"
    ):
        ji.load_checkpoint(path)
    _, loaded = ji.load_checkpoint(path, check_finite=False)  # the opt-out, for broken weights
    assert not np.isfinite(np.asarray(loaded["layers"]["w_up"])).all()


def test_overflow_on_conversion_to_float16_is_refused(saved):
    """Cause 6: a float32 weight beyond float16's range becomes Inf when converted."""
    path, _ = saved
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.norm.weight"][0] = 1e6
    _rewrite(path, tensors)
    ji.load_checkpoint(path)  # finite in float32
    with pytest.raises(ValueError, match=r"after conversion to float16.*final_norm"):
        ji.load_checkpoint(path, dtype=jnp.float16)


def test_check_finite_is_reusable_on_host_and_device_arrays():
    from jaxinfer.tensor_checks import check_finite, nonfinite_counts

    good = np.ones(4, np.float32)
    named = {"a": good, "b": jnp.asarray([1.0, np.nan]), "c": np.array([np.inf, np.nan])}
    named["q"] = np.array([7], np.int32)  # integers are always finite
    assert nonfinite_counts(named) == {"b": 1, "c": 2}
    assert nonfinite_counts({"h": np.array([np.nan], jnp.bfloat16)}) == {"h": 1}
    with pytest.raises(ValueError, match=r"in here: b \(1 NaN/Inf values\), c \(2"):
        check_finite(named, "here")
    check_finite([("a", good), ("d", jnp.zeros(3))], "here")


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_])
def test_non_float_tensor_is_refused_not_cast(saved, dtype):
    """Cause 7: an int32 tensor where a float weight belongs was cast without a word."""
    path, _ = saved
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = np.ones(tensors[name].shape, dtype)
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=rf"{name} in .* has dtype .*refused rather than cast"):
        ji.load_checkpoint(path)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda hf: hf.pop("hidden_size"), r"config.json in .* has no 'hidden_size'"),
        (lambda hf: hf.pop("num_hidden_layers"), r"config.json in .* has no 'num_hidden_layers'"),
        (lambda hf: hf.update(vocab_size="many"), r"config.json in .*'vocab_size'='many'"),
        (lambda hf: hf.update(intermediate_size=0), r"config.json in .*intermediate_size=0"),
    ],
)
def test_bad_config_json_names_file_and_field(saved, edit, match):
    """Cause 10: a missing field gave a bare KeyError naming no file."""
    path, _ = saved
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    edit(hf)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match=match):
        ji.load_checkpoint(path)


def test_missing_or_corrupt_config_json_names_the_file(saved):
    """Cause 10: a truncated config.json gave a bare JSONDecodeError."""
    path, _ = saved
    file = os.path.join(path, "config.json")
    with open(file) as f:
        text = f.read()
    with open(file, "w") as f:
        f.write(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"config.json in .* is not valid JSON"):
        ji.load_checkpoint(path)
    os.remove(file)
    with pytest.raises(ValueError, match=r"no config.json in "):
        ji.load_checkpoint(path)


def test_corrupt_tokenizer_json_names_the_file(tmp_path):
    """Cause 10: tokenizers' bare Exception named neither the file nor what was wrong."""
    file = tmp_path / "tokenizer.json"
    file.write_text('{"version": "1.0", "truncation": null')
    with pytest.raises(ValueError, match=r"tokenizer.json is not a valid tokenizer.json"):
        ji.load_tokenizer(str(tmp_path))
    file.write_text('{"version": "1.0"}')  # valid JSON, no "model"
    with pytest.raises(ValueError, match=r"(?i)tokenizer.json is not a valid.*model missing"):
        ji.load_tokenizer(str(tmp_path))


def _tree(path):
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def test_save_is_atomic_when_config_json_fails(saved, monkeypatch):
    """Cause 9: a failure writing config.json left the new weights without their config."""
    import jaxinfer.checkpoint as ckpt

    path, _ = saved
    before = _tree(path)

    def broken(cfg):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(ckpt, "to_hf_config", broken)
    other = random_params(CFG, seed=7)
    with pytest.raises(OSError, match="injected"):
        ji.save_checkpoint(path, CFG, other, overwrite=True)
    assert _tree(path) == before  # untouched: the old checkpoint, whole
    fresh = os.path.join(os.path.dirname(path), "fresh")
    with pytest.raises(OSError, match="injected"):
        ji.save_checkpoint(fresh, CFG, other)
    assert not os.path.exists(fresh)
    assert sorted(os.listdir(os.path.dirname(path))) == ["ckpt"]  # no temporary left behind


def test_save_refuses_a_stale_index_unless_overwrite(saved, tmp_path):
    """Cause 9: a stale model.safetensors.index.json made the new checkpoint unloadable."""
    path, _ = saved
    target = tmp_path / "target"
    target.mkdir()
    (target / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
        )
    )
    (target / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    (target / "notes.txt").write_text("mine")
    params = random_params(CFG, seed=2)
    with pytest.raises(ValueError, match=r"already holds checkpoint files.*overwrite=True"):
        ji.save_checkpoint(str(target), CFG, params)
    assert sorted(os.listdir(target)) == [
        "model-00001-of-00002.safetensors", "model.safetensors.index.json", "notes.txt",
    ]  # fmt: skip
    ji.save_checkpoint(str(target), CFG, params, overwrite=True)
    assert sorted(os.listdir(target)) == [
        "config.json", "generation_config.json", "model.safetensors", "notes.txt",
    ]  # fmt: skip
    assert (target / "notes.txt").read_text() == "mine"  # files of no checkpoint are kept
    _, loaded = ji.load_checkpoint(str(target))
    np.testing.assert_array_equal(np.asarray(loaded["embed"]), np.asarray(params["embed"]))
    with pytest.raises(ValueError, match="already holds checkpoint files"):
        ji.save_checkpoint(path, CFG, params)  # saving over a checkpoint also needs the flag
    empty = tmp_path / "empty"
    empty.mkdir()
    ji.save_checkpoint(str(empty), CFG, params)  # an empty directory is fine
    assert oct(os.stat(empty).st_mode & 0o777) == "0o755"


def test_save_into_a_read_only_directory_is_refused(tmp_path):
    """The rename into place must not replace a directory its owner made read-only."""
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o555)
    try:
        if os.access(target, os.W_OK):
            pytest.skip("running as a user that writes anywhere")
        with pytest.raises(PermissionError, match="not writable"):
            ji.save_checkpoint(str(target), CFG, random_params(CFG, seed=2))
        assert target.exists() and not os.listdir(target)
    finally:
        target.chmod(0o755)
