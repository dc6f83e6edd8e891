"""Memory report: weight bytes from shapes, KV bytes per token, sequences that fit."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer import memory
from jaxinfer.config import PRESETS, ModelConfig
from jaxinfer.model import init_params
from jaxinfer.quant.calibrate import QuantConfig, quantize

LLAMA2 = PRESETS["llama2-7b"]


def test_llama2_7b_bf16_is_two_bytes_per_parameter():
    r = memory.memory_report(LLAMA2, "bf16", "bf16", model="llama2-7b")
    assert r.num_params == 6_738_415_616 == LLAMA2.num_params()
    assert r.weight_bytes == 2 * r.num_params
    assert r.weight_gb == pytest.approx(13.48, abs=0.005)  # "a 7B model is ~14 GB"
    assert r.weight_gib == pytest.approx(12.55, abs=0.005)  # "... ~13 GiB"
    # The rule of thumb itself: 7e9 parameters in BF16 = 14.0 GB = 13.04 GiB.
    assert 7e9 * 2 / memory.GB == pytest.approx(14.0)
    assert 7e9 * 2 / memory.GIB == pytest.approx(13.04, abs=0.005)


def test_kv_bytes_24_layers_16_heads_64_dim_2048_tokens_is_192_mib():
    cfg = ModelConfig(
        vocab_size=1000, hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=16,
        head_dim=64, intermediate_size=4096,
    )  # fmt: skip
    per_token = memory.kv_bytes_per_token(cfg, "bf16")
    assert per_token == 24 * 16 * 64 * 2 * 2
    assert per_token * 2048 == 192 * memory.MIB
    # int8 / fp8 halve the values and add one float32 scale per (layer, K or V, head).
    assert memory.kv_bytes_per_token(cfg, "int8") == 2 * 24 * 16 * (64 + 4)
    assert memory.kv_bytes_per_token(cfg, "fp8") == memory.kv_bytes_per_token(cfg, "int8")


def test_quantized_formats_count_scales_and_zeros():
    cfg = LLAMA2
    e, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    linear_params = n * (4 * e * e + 3 * e * f)  # MHA: wq, wk, wv, wo are [E, E]
    dense_rest = 2 * (cfg.num_params() - linear_params)  # embeddings, head, norms in bf16
    w4 = memory.weight_bytes(cfg, "w4g128")
    # 4-bit codes + a bf16 scale and an int32 zero per group of 128
    assert w4 == dense_rest + linear_params // 2 + linear_params // 128 * (2 + 4)
    assert memory.weight_bytes(cfg, "w3g128") == w4  # 3-bit codes live in 4-bit containers
    w8 = memory.weight_bytes(cfg, "w8")
    out_channels = n * (4 * e + 2 * f + e)  # one float32 scale per output channel
    assert w8 == dense_rest + linear_params + 4 * out_channels
    assert memory.weight_bytes(cfg, "w8a8") == w8
    assert memory.weight_bytes(cfg, "fp32") == 4 * cfg.num_params()


def test_shapes_agree_with_a_real_quantized_model():
    """The abstract byte count equals the bytes of params that quantize() really builds."""
    cfg = ModelConfig(  # the tiny model of tests/quant/test_calibrate.py: shared compilations
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16,
        intermediate_size=32, attention_bias=True, tie_word_embeddings=True,
        architecture="Qwen2ForCausalLM",
    )  # fmt: skip
    params = init_params(cfg, jax.random.key(0), std=0.1)
    calib = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(8, 16)).astype(np.int32)
    for qcfg, fmt in ((QuantConfig("rtn", bits=4, group_size=16), "w4g16"),
                      (QuantConfig("smoothquant", bits=8, group_size=None), "w8a8")):  # fmt: skip
        qparams = quantize(cfg, params, qcfg, calib)
        assert memory.weight_bytes(cfg, fmt) == memory.tree_bytes(qparams)
    assert memory.weight_bytes(cfg, "fp32") == memory.tree_bytes(params)


def test_max_sequences():
    cfg = LLAMA2
    r = memory.memory_report(cfg, "bf16", "bf16", seq_len=4096, gpu_gib=80, reserve_gib=2)
    per_seq = 2 * 32 * 32 * 128 * 2 * 4096  # 2 GiB per 4096-token sequence
    assert r.kv_bytes_per_sequence == per_seq
    assert r.max_sequences == (80 * memory.GIB - r.weight_bytes - 2 * memory.GIB) // per_seq == 32
    q = memory.memory_report(cfg, "w4g128", "int8", seq_len=4096, gpu_gib=80, reserve_gib=2)
    assert q.max_sequences > r.max_sequences
    # Sequences hold whole KV blocks: 4097 tokens take 257 blocks of 16.
    odd = memory.memory_report(cfg, "bf16", "bf16", seq_len=4097, block_size=16)
    assert odd.kv_bytes_per_sequence == odd.kv_bytes_per_token * 257 * 16
    assert memory.memory_report(cfg, "bf16", "bf16", gpu_gib=8).max_sequences == 0


@pytest.mark.parametrize("name", ["llama2-7b", "llama3-8b", "mistral-7b", "qwen2.5-7b"])
def test_every_preset_reports(name):
    cfg = PRESETS[name]
    rows = [memory.memory_report(cfg, f, "bf16") for f in ("bf16", "w8", "w4g128")]
    assert rows[0].weight_bytes > rows[1].weight_bytes > rows[2].weight_bytes > 0
    assert rows[0].kv_bytes_per_token == 4 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim


@pytest.mark.parametrize("bad", ["w5", "w8g128", "w4a8", "int4", "w4g"])
def test_bad_formats(bad):
    with pytest.raises(ValueError, match="weight format"):
        memory.parse_weight_format(bad)
    with pytest.raises(ValueError, match="KV format 'int4'"):
        memory.kv_bytes_per_token(LLAMA2, "int4")


@pytest.mark.parametrize(
    "fmt, stored, ideal",
    [
        ("bf16", 16.0, 16.0),
        ("w4g128", 4 + (16 + 32) / 128, 4 + (16 + 4) / 128),  # bf16 scale, int32 zero / G
        ("w3g128", 4 + (16 + 32) / 128, 3 + (16 + 3) / 128),  # 3-bit codes in 4-bit containers
    ],
)
def test_bits_per_weight_of_the_linears(fmt, stored, ideal):
    cfg = PRESETS["llama2-7b"]  # bf16; abstract params: nothing is allocated
    got = memory.bits_per_weight(memory.quantized_param_shapes(cfg, fmt))
    h, i = cfg.hidden_size, cfg.intermediate_size
    assert got["weights"] == cfg.num_layers * (4 * h * h + 3 * h * i)  # q, k, v, o; gate, up, down
    assert got["bpw_stored"] == pytest.approx(stored, rel=1e-12)
    assert got["bpw_ideal"] == pytest.approx(ideal, rel=1e-12)


def test_memory_table_is_memory_report_per_cell():
    models = {"a": PRESETS["llama3-8b"], "b": PRESETS["mistral-7b"]}
    gpus = {"80 GB": 80.0, "H200": 141.0}
    rows = memory.memory_table(models, ("bf16", "w4g128"), ("bf16", "int8", "fp8"),
                               seq_lens=(2048, 8192), gpus=gpus, reserve_gib=3.0)  # fmt: skip
    assert [(r["model"], r["weight_format"], r["kv_format"]) for r in rows] == [
        (m, w, k) for m in "ab" for w in ("bf16", "w4g128") for k in ("bf16", "int8", "fp8")
    ]
    for r in rows:
        assert list(r["fits"]) == ["80 GB @ 2048", "80 GB @ 8192", "H200 @ 2048", "H200 @ 8192"]
        for gpu, gib in gpus.items():
            for n in (2048, 8192):
                ref = memory.memory_report(
                    models[r["model"]], r["weight_format"], r["kv_format"], seq_len=n,
                    gpu_gib=gib, reserve_gib=3.0,
                )  # fmt: skip
                assert r["fits"][f"{gpu} @ {n}"] == ref.max_sequences
                assert r["weight_bytes"] == ref.weight_bytes
    md = memory.markdown_table(rows).splitlines()
    assert len(md) == 2 + len(rows) and md[0].endswith("| seqs H200 @ 2048 | seqs H200 @ 8192 |")
    assert all(line.count("|") == md[0].count("|") for line in md)
    with pytest.raises(ValueError, match="empty table"):
        memory.memory_table(models, (), ("bf16",))
