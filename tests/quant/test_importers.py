"""Community checkpoint importers on synthetic GPTQ (v1, v2, act order) and AWQ GEMM layouts.

Nothing is downloaded: the packers below write each layout from its public description, and
the imported weights must dequantize to w[k, n] = (q[k, n] − z[g(k), n]) · s[g(k), n].
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxinfer import qtensor as formats
from jaxinfer.config import ModelConfig, to_hf_config
from jaxinfer.model import forward_dense
from jaxinfer.ops.linear import linear
from jaxinfer.quant.importers import (
    MODULES,
    import_awq_linear,
    import_gptq_linear,
    load_community_checkpoint,
)

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i holds column 8c + ORDER[i]


# ------------------------------------------------------------------------------ packers


def _as_int32(words: np.ndarray) -> np.ndarray:
    return words.astype(np.uint32).view(np.int32)


def gptq_pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ qweight: `32/bits` consecutive input rows per int32, lowest bits first."""
    per = 32 // bits
    words = np.zeros((q.shape[0] // per, q.shape[1]), np.uint64)
    for j in range(per):
        words |= (q[j::per].astype(np.uint64) & (2**bits - 1)) << np.uint64(bits * j)
    return _as_int32(words)


def gptq_pack_cols(z: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ qzeros: `32/bits` consecutive output columns per int32, lowest bits first."""
    per = 32 // bits
    words = np.zeros((z.shape[0], z.shape[1] // per), np.uint64)
    for j in range(per):
        words |= (z[:, j::per].astype(np.uint64) & (2**bits - 1)) << np.uint64(bits * j)
    return _as_int32(words)


def awq_pack_cols(q: np.ndarray, order=AWQ_PACK_ORDER) -> np.ndarray:
    """AutoAWQ GEMM: 8 output columns per int32, interleaved by `order`."""
    words = np.zeros((q.shape[0], q.shape[1] // 8), np.uint64)
    for c in range(q.shape[1] // 8):
        for i in range(8):
            words[:, c] |= q[:, 8 * c + order[i]].astype(np.uint64) << np.uint64(4 * i)
    return _as_int32(words)


def synthetic(rng, d_in, d_out, group, bits=4, act_order=False):
    """Codes, zeros, fp16 scales, g_idx and the dense weight they define."""
    q = rng.integers(0, 2**bits, size=(d_in, d_out))
    z = rng.integers(0, 2**bits, size=(d_in // group, d_out))
    z[0, :3] = 0  # zero point 0: the v1 "z - 1" convention stores -1 here
    s = rng.uniform(0.005, 0.05, size=(d_in // group, d_out)).astype(np.float16)
    g_idx = np.arange(d_in) // group
    if act_order:  # AutoGPTQ desc_act: groups follow the sweep order, not the row order
        g_idx = g_idx[np.argsort(rng.permutation(d_in))]
    w = (q - z[g_idx]) * s[g_idx].astype(np.float32)
    return q, z, s, g_idx, w.astype(np.float32)


# ------------------------------------------------------------------------------ single linears


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits, act_order", [(4, False), (4, True), (2, False)])
def test_gptq_import_dequantizes_to_the_checkpoint_weight(fmt, bits, act_order):
    rng = np.random.default_rng(bits + act_order)
    q, z, s, g_idx, w = synthetic(rng, 64, 32, 16, bits, act_order)
    stored_z = z - 1 if fmt == "gptq" else z  # v1 stores z - 1 (masked to `bits` bits)
    qw = import_gptq_linear(
        gptq_pack_rows(q, bits), gptq_pack_cols(stored_z, bits), s, g_idx, bits=bits,
        group_size=16, checkpoint_format=fmt, dtype=jnp.float32,
    )  # fmt: skip
    assert qw.shape == (64, 32) and qw.bits == bits and qw.scales.dtype == jnp.float32
    assert (qw.perm is not None) == act_order
    np.testing.assert_allclose(np.asarray(formats.dequantize(qw)), w, rtol=1e-6, atol=1e-7)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), qw)), x @ w, rtol=1e-4, atol=1e-4)


def test_gptq_v1_read_as_v2_is_off_by_one_zero():
    """Negative control: the zero-point convention matters."""
    rng = np.random.default_rng(7)
    q, z, s, g_idx, w = synthetic(rng, 32, 16, 16)
    qw = import_gptq_linear(
        gptq_pack_rows(q, 4), gptq_pack_cols(z - 1, 4), s, g_idx, group_size=16,
        checkpoint_format="gptq_v2",
    )  # fmt: skip
    assert not np.allclose(np.asarray(formats.dequantize(qw), np.float32), w, atol=1e-3)


def test_awq_import_dequantizes_to_the_checkpoint_weight():
    rng = np.random.default_rng(8)
    q, z, s, _, w = synthetic(rng, 64, 32, 16)
    qw = import_awq_linear(awq_pack_cols(q), awq_pack_cols(z), s, group_size=16)
    assert qw.perm is None and qw.scales.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(formats.dequantize(qw, jnp.float32)), w, rtol=1e-6)
    # Negative control: the same codes packed in natural column order import differently.
    plain = import_awq_linear(
        awq_pack_cols(q, order=list(range(8))), awq_pack_cols(z), s, group_size=16
    )
    assert not np.allclose(np.asarray(formats.dequantize(plain, jnp.float32)), w)


def test_importer_errors():
    rng = np.random.default_rng(9)
    q, z, s, g_idx, _ = synthetic(rng, 64, 32, 16)
    qweight, qzeros = gptq_pack_rows(q, 4), gptq_pack_cols(z, 4)
    with pytest.raises(ValueError, match="bits=3"):
        import_gptq_linear(qweight, qzeros, s, g_idx, bits=3, group_size=16)
    with pytest.raises(ValueError, match="checkpoint_format='gptq_v3'"):
        import_gptq_linear(qweight, qzeros, s, g_idx, group_size=16, checkpoint_format="gptq_v3")
    bad = g_idx.copy()
    bad[0] = 1  # group 0 now has 15 rows, group 1 has 17
    with pytest.raises(ValueError, match="exactly 16 rows"):
        import_gptq_linear(qweight, qzeros, s, bad, group_size=16)
    with pytest.raises(ValueError, match="scales has shape"):
        import_gptq_linear(qweight, qzeros, s[:2], g_idx, group_size=16, name="q_proj")
    with pytest.raises(ValueError, match="group_size=24"):
        import_awq_linear(awq_pack_cols(q), awq_pack_cols(z), s, group_size=24)


# ------------------------------------------------------------------------------ checkpoints


CFG = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
    intermediate_size=48, attention_bias=True, architecture="Qwen2ForCausalLM",
)  # fmt: skip


def write_checkpoint(path, method, rng, act_order=False):
    """A synthetic quantized HF checkpoint of CFG; returns the dense params it encodes."""
    e, n, v = CFG.hidden_size, CFG.num_layers, CFG.vocab_size
    kd = CFG.num_kv_heads * CFG.head_dim

    def normal(*shape):
        return (0.1 * rng.normal(size=shape)).astype(np.float32)

    params = {
        "embed": normal(v, e),
        "final_norm": 1 + normal(e),
        "lm_head": normal(e, v),
        "layers": {
            "attn_norm": 1 + normal(n, e),
            "mlp_norm": 1 + normal(n, e),
            "bq": normal(n, e),
            "bk": normal(n, kd),
            "bv": normal(n, kd),
        },
    }
    tensors = {
        "model.embed_tokens.weight": params["embed"],
        "model.norm.weight": params["final_norm"],
        "lm_head.weight": params["lm_head"].T.copy(),
    }
    for i in range(n):
        pre = f"model.layers.{i}."
        tensors[pre + "input_layernorm.weight"] = params["layers"]["attn_norm"][i]
        tensors[pre + "post_attention_layernorm.weight"] = params["layers"]["mlp_norm"][i]
        for b, mod in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
            tensors[f"{pre}self_attn.{mod}.bias"] = params["layers"][b][i]
    shapes = {
        "wq": (e, e), "wk": (e, kd), "wv": (e, kd), "wo": (e, e),
        "w_gate": (e, CFG.intermediate_size), "w_up": (e, CFG.intermediate_size),
        "w_down": (CFG.intermediate_size, e),
    }  # fmt: skip
    for leaf, module in MODULES.items():
        d_in, d_out = shapes[leaf]
        dense = []
        for i in range(CFG.num_layers):
            q, z, s, g_idx, w = synthetic(rng, d_in, d_out, 16, act_order=act_order and i == 1)
            pre = f"model.layers.{i}.{module}."
            if method == "gptq":
                tensors[pre + "qweight"] = gptq_pack_rows(q, 4)
                tensors[pre + "qzeros"] = gptq_pack_cols(z - 1, 4)  # v1
                tensors[pre + "g_idx"] = g_idx.astype(np.int32)
            else:
                tensors[pre + "qweight"] = awq_pack_cols(q)
                tensors[pre + "qzeros"] = awq_pack_cols(z)
            tensors[pre + "scales"] = s
            dense.append(w)
        params["layers"][leaf] = np.stack(dense)
    hf = to_hf_config(CFG)
    hf["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": act_order}
        if method == "gptq"
        else {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm"}
    )
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return jax.tree.map(jnp.asarray, params)


@pytest.mark.parametrize("method, act_order", [("gptq", True), ("awq", False)])
def test_load_community_checkpoint_round_trip(tmp_path, method, act_order):
    rng = np.random.default_rng(10)
    path = os.path.join(tmp_path, method)
    dense = write_checkpoint(path, method, rng, act_order)
    cfg, params = load_community_checkpoint(path)
    assert cfg.hidden_size == CFG.hidden_size and cfg.attention_bias
    wq = params["layers"]["wq"]
    assert isinstance(wq, formats.Int4Weight) and wq.packed.shape == (2, 4, 32)
    assert (wq.perm is not None) == act_order  # one act-order layer gives every layer a perm
    deq = jax.jit(formats.dequantize)
    for leaf in MODULES:
        np.testing.assert_allclose(
            np.asarray(deq(params["layers"][leaf])),
            np.asarray(dense["layers"][leaf]), rtol=1e-6, atol=1e-7,
        )  # fmt: skip
    tokens = jnp.asarray(rng.integers(0, 64, size=(2, 8)), jnp.int32)
    np.testing.assert_allclose(
        np.asarray(forward_dense(params, cfg, tokens)),
        np.asarray(forward_dense(dense, CFG, tokens)), rtol=1e-4, atol=1e-4,
    )  # fmt: skip


def test_checkpoint_without_quantization_config(tmp_path):
    path = os.path.join(tmp_path, "plain")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(CFG), f)
    with pytest.raises(ValueError, match="no GPTQ or AWQ quantization_config"):
        load_community_checkpoint(path)


def test_pickle_checkpoint_is_refused(tmp_path):
    """The importers read weights through the loader's one safetensors reader: no unpickling."""
    path = os.path.join(tmp_path, "pickled")
    write_checkpoint(path, "gptq", np.random.default_rng(11), False)
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match="refuses to load them because unpickling"):
        load_community_checkpoint(path)
