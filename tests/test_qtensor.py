"""Int4Weight / Int8Weight: packing, the dequantization formula, ops.linear dispatch, lax.scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import qtensor as formats
from jaxinfer.ops.linear import linear
from jaxinfer.qtensor import Int4Weight, Int8Weight
from jaxinfer.quant.rtn import quantize_int8, rtn_quantize
from pallas_kernels.int4_matmul import int4_matmul_reference
from pallas_kernels.int8_matmul import int8_int8_matmul_reference, int8_matmul_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}  # relative, per dtype


def np_pack_int4(q: np.ndarray) -> np.ndarray:
    """Independent packer from the layout's description: row 8r + j -> bits 4j.. of word r."""
    d_in, d_out = q.shape
    out = np.zeros((d_in // 8, d_out), np.uint64)
    for r in range(d_in // 8):
        for j in range(8):
            out[r] |= q[8 * r + j].astype(np.uint64) << np.uint64(4 * j)
    return out.astype(np.uint32)


def random_int4(rng, d_in=64, d_out=24, group=16, bits=4, dtype=jnp.float32, perm=False):
    q = rng.integers(0, 2**bits, size=(d_in, d_out))
    s = rng.uniform(0.01, 0.1, size=(d_in // group, d_out)).astype(np.float32)
    z = rng.integers(0, 2**bits, size=(d_in // group, d_out))
    p = rng.permutation(d_in) if perm else None
    w = formats.make_int4(
        jnp.asarray(q), jnp.asarray(s, dtype), jnp.asarray(z), bits=bits, group_size=group,
        perm=None if p is None else jnp.asarray(p),
    )  # fmt: skip
    return w, q, s, z, p


# ------------------------------------------------------------------------------ packing


@pytest.mark.parametrize("shape", [(8, 1), (64, 24), (3, 16, 5)])
def test_pack_unpack_bit_exact_and_layout(shape):
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, size=shape).astype(np.int32)
    packed = formats.pack_int4(jnp.asarray(q))
    assert packed.dtype == jnp.uint32
    assert packed.shape == (*shape[:-2], shape[-2] // 8, shape[-1])
    np.testing.assert_array_equal(np.asarray(formats.unpack_int4(packed)), q)
    flat_q = q.reshape(-1, *shape[-2:])
    flat_p = np.asarray(packed).reshape(-1, shape[-2] // 8, shape[-1])
    for qi, pi in zip(flat_q, flat_p):
        np.testing.assert_array_equal(pi, np_pack_int4(qi))


def test_pack_extremes_use_all_32_bits():
    q = np.full((8, 2), 15, np.int32)
    q[:, 1] = [0, 15, 0, 15, 0, 15, 0, 15]
    packed = np.asarray(formats.pack_int4(jnp.asarray(q)))
    assert packed[0, 0] == 0xFFFFFFFF
    assert packed[0, 1] == 0xF0F0F0F0


def test_pack_rejects_rows_not_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        formats.pack_int4(jnp.zeros((12, 4), jnp.int32))


# ------------------------------------------------------------------------------ dequantize


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_dequantize_matches_formula(bits):
    rng = np.random.default_rng(bits)
    w, q, s, z, _ = random_int4(rng, bits=bits)
    expected = (q - np.repeat(z, 16, axis=0)) * np.repeat(s, 16, axis=0)
    np.testing.assert_allclose(np.asarray(formats.dequantize(w)), expected, rtol=1e-6, atol=0)


def test_dequantize_with_perm_restores_original_rows():
    rng = np.random.default_rng(1)
    w, q, s, z, p = random_int4(rng, perm=True)
    stored = (q - np.repeat(z, 16, axis=0)) * np.repeat(s, 16, axis=0)  # rows in stored order
    original = np.empty_like(stored)
    original[p] = stored  # stored row k is input feature p[k]
    np.testing.assert_allclose(np.asarray(formats.dequantize(w)), original, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(formats.dequantize_rows(w)), stored, rtol=1e-6)


def test_int8_dequantize_matches_formula():
    rng = np.random.default_rng(2)
    wd = rng.normal(size=(32, 12)).astype(np.float32)
    w8 = quantize_int8(jnp.asarray(wd))
    q, s = np.asarray(w8.q), np.asarray(w8.scales)
    np.testing.assert_allclose(np.asarray(formats.dequantize(w8)), q * s[None, :], rtol=1e-6)
    assert np.abs(np.asarray(formats.dequantize(w8)) - wd).max() <= s.max() / 2 + 1e-6


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "group, bits, match",
    [(24, 4, "group_size=24"), (12, 4, "group_size=12"), (16, 5, "bits=5"), (16, 8, "bits=8")],
)
def test_bad_group_size_or_bits_raise(group, bits, match):
    with pytest.raises(ValueError, match=match):
        rtn_quantize(jnp.ones((64, 8)), bits=bits, group_size=group)


def test_make_int4_rejects_wrong_scale_shape():
    with pytest.raises(ValueError, match="scales has shape"):
        formats.make_int4(
            jnp.zeros((32, 4), jnp.int32), jnp.ones((4, 4)), jnp.zeros((2, 4)), bits=4,
            group_size=16,
        )  # fmt: skip


# ------------------------------------------------------------------------------ ops.linear


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("perm", [False, True])
def test_linear_int4_matches_kernel_reference(dtype, perm):
    rng = np.random.default_rng(3)
    w, *_ = random_int4(rng, dtype=dtype, perm=perm)
    x = jnp.asarray(rng.normal(size=(5, 64)), dtype)
    b = jnp.asarray(rng.normal(size=(24,)), dtype)
    y = linear(x, w, b)
    assert y.dtype == dtype and y.shape == (5, 24)
    ref = int4_matmul_reference(
        x, w.packed, w.scales, w.zeros, group_size=w.group_size, perm=w.perm
    ).astype(jnp.float32) + b.astype(jnp.float32)
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), rtol=tol, atol=tol)
    # linear(x, w) is the dense path on dequantize(w): the same arithmetic, bit-identical
    # without perm (with perm the products are summed in the stored row order).
    y_dense = np.asarray(linear(x, formats.dequantize(w), b), np.float32)
    if perm:
        np.testing.assert_allclose(np.asarray(y, np.float32), y_dense, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(np.asarray(y, np.float32), y_dense)


def test_linear_int8_w8a16_and_w8a8_match_kernel_references():
    rng = np.random.default_rng(4)
    wd = jnp.asarray(rng.normal(size=(64, 24)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 3, 64)), jnp.float32)  # leading axes are kept
    w16 = quantize_int8(wd, act_quant=False)
    y16 = linear(x, w16)
    ref16 = int8_matmul_reference(x.reshape(6, 64), w16.q, w16.scales).reshape(2, 3, 24)
    np.testing.assert_allclose(np.asarray(y16), np.asarray(ref16), rtol=1e-5, atol=1e-5)

    w8 = quantize_int8(wd, act_quant=True)
    y8 = linear(x, w8)
    xq, xs = formats.quantize_per_token(x.reshape(6, 64))
    ref8 = int8_int8_matmul_reference(xq, xs, w8.q, w8.scales).reshape(2, 3, 24)
    np.testing.assert_allclose(np.asarray(y8), np.asarray(ref8), rtol=1e-6, atol=1e-6)
    # W8A8 is a real quantization of x: close to, but not equal to, W8A16.
    exact = np.asarray(x @ wd)
    err16, err8 = np.abs(np.asarray(y16) - exact).max(), np.abs(np.asarray(y8) - exact).max()
    assert 0 < err16 < err8 < 0.05 * np.abs(exact).max()


def test_w8a8_accumulates_in_int32():
    w8 = quantize_int8(jnp.ones((64, 4)), act_quant=True)
    jaxpr = str(jax.make_jaxpr(lambda x: linear(x, w8))(jnp.ones((2, 64))))
    assert "preferred_element_type=int32" in jaxpr


def test_unsupported_weight_type_raises():
    with pytest.raises(TypeError, match="unsupported weight type"):
        linear(jnp.ones((2, 4)), [[1.0]])


# ------------------------------------------------------------------------------ pytrees


def test_stacked_weights_slice_under_scan():
    """A leading layer axis L is sliced by lax.scan; static metadata stays per layer."""
    rng = np.random.default_rng(5)
    dense = jnp.asarray(rng.normal(size=(3, 64, 16)), jnp.float32)  # [L, in, out]
    x = jnp.asarray(rng.normal(size=(2, 64)), jnp.float32)
    for w in (rtn_quantize(dense, bits=4, group_size=16), quantize_int8(dense)):
        assert w.shape == (64, 16)

        def body(carry, wl):
            return carry, linear(x, wl)

        _, ys = jax.lax.scan(body, 0.0, w)  # [L, 2, 16]
        for layer in range(3):
            wl = jax.tree.map(lambda a, i=layer: a[i], w)
            np.testing.assert_allclose(np.asarray(ys[layer]), np.asarray(linear(x, wl)), rtol=1e-6)
        assert isinstance(jax.tree.map(lambda a: a[0], w), Int4Weight | Int8Weight)


def test_static_fields_are_not_leaves():
    w, *_ = random_int4(np.random.default_rng(6), perm=True)
    leaves, treedef = jax.tree.flatten(w)
    assert len(leaves) == 4  # packed, scales, zeros, perm
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert (rebuilt.group_size, rebuilt.bits, rebuilt.shape) == (16, 4, (64, 24))
    assert len(jax.tree.leaves(dataclass_without_perm(w))) == 3


def dataclass_without_perm(w: Int4Weight) -> Int4Weight:
    import dataclasses

    return dataclasses.replace(w, perm=None)


# --------------------------------------------------------------------------------------------
# Float offsets (Int4Weight.mins, GGUF Q4_1) and grouped Int8Weight (GGUF Q8_0)
# --------------------------------------------------------------------------------------------


def test_int4_mins_dequantize_and_linear():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (2, 64, 24))  # [L, in, out]
    s = rng.uniform(0.01, 0.1, (2, 2, 24)).astype(np.float32)
    m = rng.uniform(-1, 1, (2, 2, 24)).astype(np.float32)
    w = formats.make_int4(
        jnp.asarray(q), jnp.asarray(s), jnp.zeros((2, 2, 24), jnp.int32),
        bits=4, group_size=32, mins=jnp.asarray(m),
    )  # fmt: skip
    want = q.astype(np.float32) * np.repeat(s, 32, 1) + np.repeat(m, 32, 1)  # numpy, float32
    np.testing.assert_array_equal(np.asarray(formats.dequantize(w)), want)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    layer = jax.tree.map(lambda a: a[1], w)  # mins is a data leaf: sliced with the others
    assert layer.mins.shape == (2, 24)
    np.testing.assert_array_equal(
        np.asarray(linear(x, layer)), np.asarray(linear(x, formats.dequantize(layer)))
    )
    with pytest.raises(ValueError, match="mins has shape"):
        formats.make_int4(
            jnp.asarray(q), jnp.asarray(s), jnp.zeros((2, 2, 24), jnp.int32),
            bits=4, group_size=32, mins=jnp.zeros((2, 24)),
        )  # fmt: skip


def test_grouped_int8_dequantize_and_linear():
    rng = np.random.default_rng(1)
    q = rng.integers(-127, 128, (64, 24)).astype(np.int8)
    s = rng.uniform(0.01, 0.1, (2, 24)).astype(np.float32)  # [in/G, out]
    w = Int8Weight(q=jnp.asarray(q), scales=jnp.asarray(s), act_quant=False, shape=(64, 24),
                   group_size=32)  # fmt: skip
    want = q.astype(np.float32) * np.repeat(s, 32, 0)
    np.testing.assert_array_equal(np.asarray(formats.dequantize(w)), want)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(linear(x, w)), np.asarray(linear(x, jnp.asarray(want)))
    )
    # The Pallas backends have no grouped int8 kernel: they take the same XLA path.
    np.testing.assert_array_equal(
        np.asarray(linear(x, w, backend="pallas-interpret")), np.asarray(linear(x, w))
    )
    with pytest.raises(ValueError, match="group_size=24 must be a positive divisor"):
        Int8Weight(q=w.q, scales=w.scales, act_quant=False, shape=(64, 24), group_size=24)
    with pytest.raises(ValueError, match="weight-only"):
        Int8Weight(q=w.q, scales=w.scales, act_quant=True, shape=(64, 24), group_size=32)
