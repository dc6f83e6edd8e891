"""Quantized artifacts: save -> load -> identical outputs; clear errors on version or shape."""

from __future__ import annotations

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.model import forward_dense, init_params
from jaxinfer.qtensor import Int4Weight, Int8Weight, make_int4
from jaxinfer.quant import artifact
from jaxinfer.quant.calibrate import QuantConfig
from jaxinfer.quant.rtn import quantize_int8, rtn_quantize

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
    intermediate_size=32, dtype="bfloat16", rope_scaling=RopeScaling("linear", 2.0),
)  # fmt: skip


@pytest.fixture(scope="module")
def quantized():
    """A mix of every leaf kind: grouped int4, act-order int4 with perm, int8, dense bf16."""
    params = init_params(CFG, jax.random.key(0), std=0.1)
    layers = dict(params["layers"])
    for name in ("wq", "wk", "w_gate", "w_up"):
        layers[name] = rtn_quantize(layers[name], bits=4, group_size=16)
    layers["wv"] = rtn_quantize(layers["wv"], bits=3, group_size=None, sym=True)
    layers["w_down"] = quantize_int8(layers["w_down"], act_quant=True)
    rng = np.random.default_rng(0)
    layers["wo"] = make_int4(  # an act-order weight: rows stored permuted, with perm
        jnp.asarray(rng.integers(0, 16, size=(2, 32, 32))),
        jnp.asarray(rng.uniform(0.01, 0.1, size=(2, 2, 32)), jnp.bfloat16),
        jnp.asarray(rng.integers(0, 16, size=(2, 2, 32))),
        bits=4,
        group_size=16,
        perm=jnp.asarray(np.stack([rng.permutation(32) for _ in range(2)])),
    )
    assert layers["wo"].perm is not None
    qparams = dict(params, layers=layers)
    qcfg = QuantConfig("gptq", bits=4, group_size=16, act_order=True, static_groups=False)
    return qparams, qcfg


def test_save_load_identical_outputs(tmp_path, quantized):
    qparams, qcfg = quantized
    path = os.path.join(tmp_path, "art")
    artifact.save(path, CFG, qparams, qcfg)
    cfg, loaded, qcfg2 = artifact.load(path)
    assert cfg == CFG and qcfg2 == qcfg
    chex.assert_trees_all_equal_dtypes(loaded, qparams)
    chex.assert_trees_all_equal(loaded, qparams)  # the same tree, bit-identical leaves
    assert (
        isinstance(loaded["layers"]["w_down"], Int8Weight) and loaded["layers"]["w_down"].act_quant
    )
    assert isinstance(loaded["layers"]["wv"], Int4Weight) and loaded["layers"]["wv"].bits == 3
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, size=(2, 8)), jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(forward_dense(loaded, cfg, tokens)),
        np.asarray(forward_dense(qparams, CFG, tokens)),
    )


def test_existing_directory_needs_overwrite(tmp_path, quantized):
    qparams, qcfg = quantized
    path = os.path.join(tmp_path, "art")
    artifact.save(path, CFG, qparams, qcfg)
    with pytest.raises(Exception, match="exists"):
        artifact.save(path, CFG, qparams, qcfg)
    artifact.save(path, CFG, qparams, qcfg, overwrite=True)
    assert artifact.load(path)[0] == CFG


def _edit_meta(path, edit):
    meta_file = os.path.join(path, "meta", "metadata")
    with open(meta_file) as f:
        meta = json.load(f)
    edit(meta)
    with open(meta_file, "w") as f:
        json.dump(meta, f)


def test_version_mismatch_is_a_clear_error(tmp_path, quantized):
    qparams, qcfg = quantized
    path = os.path.join(tmp_path, "art")
    artifact.save(path, CFG, qparams, qcfg)
    _edit_meta(path, lambda m: m.update(format_version=artifact.FORMAT_VERSION + 1))
    with pytest.raises(ValueError, match="format version 2; this jaxinfer reads version 1"):
        artifact.load(path)


def test_shape_mismatch_is_a_clear_error(tmp_path, quantized):
    qparams, qcfg = quantized
    path = os.path.join(tmp_path, "art")
    artifact.save(path, CFG, qparams, qcfg)
    _edit_meta(path, lambda m: m["model_config"].update(intermediate_size=48))
    with pytest.raises(ValueError, match="shape mismatch at layers/w_(gate|up|down)"):
        artifact.load(path)
    # save checks too: params that do not fit the config are refused before writing
    with pytest.raises(ValueError, match="shape mismatch at embed"):
        artifact.save(os.path.join(tmp_path, "bad"), CFG.replace(vocab_size=65), qparams, qcfg)


def test_missing_artifact(tmp_path):
    with pytest.raises(ValueError, match="no quantized artifact"):
        artifact.load(os.path.join(tmp_path, "nothing"))


def test_artifact_without_true_sequential_loads_as_non_sequential(tmp_path, quantized):
    """An artifact written before the field existed (its GPTQ calibrated on the float layer)."""
    qparams, qcfg = quantized
    qcfg = dataclasses.replace(qcfg, true_sequential=True)
    path = os.path.join(tmp_path, "art")
    artifact.save(path, CFG, qparams, qcfg)
    assert artifact.load(path)[2] == qcfg  # stored with the artifact
    _edit_meta(path, lambda m: m["quant_config"].pop("true_sequential"))
    _, loaded, qcfg_old = artifact.load(path)
    assert qcfg_old == dataclasses.replace(qcfg, true_sequential=False)
    chex.assert_trees_all_equal(loaded, qparams)


# --------------------------------------------------------------------------- issue 15: hardening


def test_directory_that_is_not_an_artifact(tmp_path, quantized):
    """Cause 11: orbax's `KeyError: Item "meta" was not found` named nothing jaxinfer knows."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="is not a jaxinfer quantized artifact"):
        artifact.load(str(empty))
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a jaxinfer quantized artifact.*ji.load_checkpoint"):
        artifact.load(str(hf_dir))
    qparams, qcfg = quantized
    path = os.path.join(tmp_path, "art")
    artifact.save(path, CFG, qparams, qcfg)
    with open(os.path.join(path, "meta", "metadata"), "w") as f:
        f.write('{"format": "jaxinfer-qu')  # a truncated metadata file
    with pytest.raises(ValueError, match="is not a jaxinfer quantized artifact"):
        artifact.load(path)


def test_truncated_array_is_named(tmp_path, quantized):
    """Cause 11: a truncated array surfaced as a 21-frame TensorStore dump naming no array."""
    qparams, qcfg = quantized
    path = os.path.join(tmp_path, "art")
    artifact.save(path, CFG, qparams, qcfg)
    data = [
        os.path.join(root, f)
        for root, _, files in os.walk(os.path.join(path, "arrays"))
        if os.path.basename(root) == "d"
        for f in files
    ]
    # Every data file is cut in half. OCDBT writes in parallel commits, so the file layout varies
    # from run to run and one file may hold only superseded b-tree nodes: cutting just the
    # largest left every array readable in 2 runs of 25.
    assert data, "the artifact has no OCDBT data files"
    for victim in data:
        with open(victim, "rb") as f:
            blob = f.read()
        with open(victim, "wb") as f:
            f.write(blob[: len(blob) // 2])
    with pytest.raises(
        ValueError,
        match=r"array (embed|lm_head|layers__\w+) of artifact .* is truncated or corrupt",
    ):
        artifact.load(path)


def test_non_finite_artifact_is_refused_by_name(tmp_path, quantized):
    """Cause 6, for quantized artifacts: a NaN scale loads and generates garbage."""
    qparams, qcfg = quantized
    layers = dict(qparams["layers"])
    wq = layers["wq"]
    layers["wq"] = dataclasses.replace(wq, scales=wq.scales.at[1, 0, 3].set(jnp.nan))
    path = os.path.join(tmp_path, "art")
    artifact.save(path, CFG, dict(qparams, layers=layers), qcfg)
    with pytest.raises(ValueError, match=r"non-finite.*layers__wq__scales \(1 NaN/Inf"):
        artifact.load(path)
    _, loaded, _ = artifact.load(path, check_finite=False)
    assert np.isnan(np.asarray(loaded["layers"]["wq"].scales, np.float32)).sum() == 1
