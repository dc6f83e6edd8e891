"""Narrow weights in the CPU layout: int8 `TransposedDense` and `ColumnBlocks` apply as the
weights they hold, and up to NARROW_SCAN_MAX_ROWS rows they dequantize one block at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import quant
from jaxinfer.model.params import cpu_layout
from jaxinfer.ops.linear import linear
from jaxinfer.qtensor import ColumnBlocks, Int4Weight, Int8Weight, column_blocks, make_int4
from jaxinfer.quant.rtn import quantize_int8
from jaxinfer.transposed import NARROW_SCAN_MAX_ROWS, TransposedDense, column_block
from tests.helpers import random_params

ROWS = [1, 3, NARROW_SCAN_MAX_ROWS, NARROW_SCAN_MAX_ROWS + 1, 64]


def _has_scan(fn, *args) -> bool:
    return "scan" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("out", [256, 96, 100])  # 128 divides; 32 divides; no block divides
@pytest.mark.parametrize("rows", ROWS)
def test_int8_in_the_cpu_layout_equals_the_int8_weight(rows, out):
    rng = np.random.RandomState(rows + out)
    w = quantize_int8(jnp.asarray(rng.randn(72, out).astype(np.float32)))  # W8A16, per channel
    laid = TransposedDense(w.q.T, scale=w.scales)  # as cpu_layout holds it (checked below)
    x = jnp.asarray(rng.randn(rows, 72).astype(np.float32))
    want = np.asarray(x, np.float64) @ np.asarray(laid.dense(), np.float64)
    got = np.asarray(jax.jit(linear)(x, laid))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got, np.asarray(linear(x, w)), rtol=1e-5, atol=1e-4)
    # The blocks: a scan up to NARROW_SCAN_MAX_ROWS rows where a block size divides `out`.
    assert _has_scan(linear, x, laid) == (rows <= NARROW_SCAN_MAX_ROWS and column_block(out) > 0)


def _int4(rng, d_in, d_out, bits=4, group=16, perm=False, mins=False) -> Int4Weight:
    g = d_in // group
    return make_int4(
        jnp.asarray(rng.randint(0, 2**bits, (d_in, d_out)), jnp.int32),
        jnp.asarray(rng.rand(g, d_out).astype(np.float32) + 0.1),
        jnp.asarray(rng.randint(0, 2**bits, (g, d_out)), jnp.int32),
        bits=bits,
        group_size=group,
        perm=jnp.asarray(rng.permutation(d_in), jnp.int32) if perm else None,
        mins=jnp.asarray(rng.randn(g, d_out).astype(np.float32)) if mins else None,
    )


def _grouped_int8(rng, d_in, d_out, group=32) -> Int8Weight:
    q = jnp.asarray(rng.randint(-127, 128, (d_in, d_out)), jnp.int8)
    s = jnp.asarray(rng.rand(d_in // group, d_out).astype(np.float32) / 50)
    return Int8Weight(q, s, False, (d_in, d_out), group)


WEIGHTS = {
    "int4": lambda rng: _int4(rng, 64, 96),
    "int3 act order": lambda rng: _int4(rng, 64, 96, bits=3, perm=True),
    "int4 float offsets (Q4_1)": lambda rng: _int4(rng, 64, 96, group=32, mins=True),
    "int8 grouped (Q8_0)": lambda rng: _grouped_int8(rng, 64, 96),
}


@pytest.mark.parametrize("kind", list(WEIGHTS))
@pytest.mark.parametrize("rows", ROWS)
def test_column_blocks_equal_the_weight(kind, rows):
    rng = np.random.RandomState(rows)
    w = WEIGHTS[kind](rng)
    cb = column_blocks(w, 32)
    assert isinstance(cb, ColumnBlocks) and cb.shape == w.shape
    assert jax.tree.leaves(cb.blocks)[0].shape[0] == 3  # 96 columns in blocks of 32
    x = jnp.asarray(rng.randn(rows, 64).astype(np.float32))
    np.testing.assert_allclose(
        np.asarray(jax.jit(linear)(x, cb)), np.asarray(linear(x, w)), rtol=1e-5, atol=1e-4
    )
    assert _has_scan(linear, x, cb) == (rows <= NARROW_SCAN_MAX_ROWS)
    # Back to one [in, out] weight, bit for bit (the Pallas kernels' operand).
    back = cb.whole()
    assert type(back) is type(w) and back.shape == w.shape
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="do not divide out = 96"):
        column_blocks(w, 64)


def test_cpu_layout_of_quantized_layers():
    """W8A16 per channel: int8 `[out, in]`, q/k/v and gate/up fused with their scales; int4 and
    grouped int8: column blocks, apart; W8A8: as stored. The model's logits are unchanged, and
    the Pallas path (interpret mode here) still runs the kernels on the stored operands."""
    cfg = ji.preset("tiny-llama").replace(eos_token_id=None)
    params = random_params(cfg, seed=11)
    calib = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    w8 = quant.quantize(cfg, params, quant.QuantConfig("rtn", 8, None), calib)
    laid = cpu_layout(w8)["layers"][0]
    assert set(laid) >= {"wqkv", "w_gate_up", "wo", "w_down"} and "wq" not in laid
    wo = jax.tree.map(lambda a: a[0], w8["layers"]["wo"])
    assert laid["wo"].wt.dtype == jnp.int8 and laid["wo"].shape == wo.shape
    np.testing.assert_array_equal(np.asarray(laid["wo"].wt), np.asarray(wo.q).T)
    qkv = laid["wqkv"]
    parts = [jax.tree.map(lambda a: a[0], w8["layers"][n]) for n in ("wq", "wk", "wv")]
    np.testing.assert_array_equal(np.asarray(qkv.wt), np.concatenate([p.q for p in parts], 1).T)
    np.testing.assert_array_equal(np.asarray(qkv.scale), np.concatenate([p.scales for p in parts]))
    ji.model.params.check_params(cfg, cpu_layout(w8))  # shapes read as [in, out]
    w4 = quant.quantize(cfg, params, quant.QuantConfig("rtn", 4, 32), calib)
    ji.model.params.check_params(cfg, cpu_layout(w4))
    assert all(isinstance(w, ColumnBlocks) for k, w in cpu_layout(w4)["layers"][0].items()
               if k.startswith("w"))  # fmt: skip
    w8a8 = quant.quantize(cfg, params, quant.QuantConfig("smoothquant", 8, None), calib)
    assert isinstance(cpu_layout(w8a8)["layers"][0]["wo"], Int8Weight)
    prompts = [calib[0, :13].tolist(), calib[1, :5].tolist()]
    sp = ji.SamplingParams(temperature=0, max_tokens=10)
    tokens = jnp.asarray(calib)
    for q in (w8, w4, w8a8):
        stored = np.asarray(ji.forward_dense(q, cfg, tokens))  # the stored layout, no blocks
        got = np.asarray(ji.forward_dense(cpu_layout(q), cfg, tokens))
        np.testing.assert_allclose(got, stored, rtol=0, atol=1e-4)
        outs = [o.token_ids for o in ji.generate(cfg, q, prompts, sp)]
        kernel = ji.generate(cfg, q, prompts, sp, backend="pallas-interpret")
        assert outs == [o.token_ids for o in kernel]
