"""Quantized matmul kernels (int4 W4A16, int8 W8A16, int8 W8A8) in interpret mode on CPU.

Every kernel result is compared with the pure-jnp reference computed from the *same* quantized
weights, and the reference itself with an independent float64 numpy dequantization. The shape
grid is a pairwise covering array rather than the full product (4 * 3 * 2 * 4 * 2 * 2 = 384
interpret-mode compilations would take too long): every value of every axis appears, and every
pair of values of any two axes appears in at least one case (`test_int4_grid_is_pairwise`).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int4_matmul import (
    MatmulBlockSizes,
    default_block_sizes,
    int4_matmul,
    int4_matmul_reference,
    pack_int4,
    plan_tiles,
    unpack_int4,
)
from pallas_kernels.int8_matmul import (
    int8_int8_matmul,
    int8_int8_matmul_reference,
    int8_matmul,
    int8_matmul_reference,
)
from pallas_kernels.testing import INTERPRET

PER_CHANNEL = -1  # group_size = K
AXES = {
    "m": (1, 3, 16, 33),
    "k": (128, 384, 1024),
    "n": (64, 256),
    "g": (32, 64, 128, PER_CHANNEL),
    "perm": (False, True),
    "dtype": ("float32", "bfloat16"),
}
# (M, K, N, G, perm, dtype): a pairwise covering array of AXES.
INT4_GRID = (
    (1, 128, 256, PER_CHANNEL, False, "bfloat16"),
    (1, 384, 64, 64, True, "bfloat16"),
    (1, 1024, 64, 128, False, "float32"),
    (1, 1024, 256, 32, False, "float32"),
    (3, 128, 64, 32, True, "float32"),
    (3, 384, 64, 128, False, "bfloat16"),
    (3, 1024, 64, PER_CHANNEL, True, "float32"),
    (3, 1024, 256, 64, False, "float32"),
    (16, 128, 256, 64, False, "float32"),
    (16, 128, 256, 128, True, "float32"),
    (16, 384, 256, PER_CHANNEL, False, "float32"),
    (16, 1024, 64, 32, True, "bfloat16"),
    (33, 128, 64, 64, True, "bfloat16"),
    (33, 384, 64, PER_CHANNEL, True, "float32"),
    (33, 384, 256, 32, False, "float32"),
    (33, 1024, 64, 128, True, "bfloat16"),
)
# Max |error| / max |reference|. float32: the kernel and the reference differ only in summation
# order. bfloat16: the kernel rounds each dequantized weight to bfloat16 (8-bit mantissa) before
# the dot, the reference keeps it in float32; the error is a few bf16 ulps of the output scale.
REL_TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _rel_err(y, ref) -> float:
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def _int4_problem(m, k, n, g, dtype, seed):
    """Random activations and an Int4Weight-layout weight, plus numpy ground truth pieces."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (k, n))  # [K, N] nibbles
    zeros = rng.integers(0, 16, (k // g, n)).astype(np.int32)  # [K/G, N]
    scales = rng.uniform(0.5, 1.5, (k // g, n)) / 8  # [K/G, N]
    x = rng.standard_normal((m, k))
    packed = np.zeros((k // 8, n), np.uint32)  # written with the documented bit layout
    for j in range(8):
        packed |= q[j::8].astype(np.uint32) << np.uint32(4 * j)
    return (
        jnp.asarray(x, dtype),
        jnp.asarray(packed),
        jnp.asarray(scales, dtype),
        jnp.asarray(zeros),
        q,
    )


def test_int4_grid_is_pairwise():
    names = list(AXES)
    for a, b in itertools.combinations(range(len(names)), 2):
        seen = {(case[a], case[b]) for case in INT4_GRID}
        want = set(itertools.product(AXES[names[a]], AXES[names[b]]))
        assert seen == want, f"pair ({names[a]}, {names[b]}) misses {want - seen}"


@pytest.mark.parametrize("m,k,n,g,use_perm,dtype", INT4_GRID)
def test_int4_matches_reference(m, k, n, g, use_perm, dtype):
    g = k if g == PER_CHANNEL else g
    x, packed, scales, zeros, _ = _int4_problem(m, k, n, g, dtype, seed=m * k + n + g)
    perm = None
    if use_perm:
        perm = jnp.asarray(np.random.default_rng(k).permutation(k).astype(np.int32))
    y = int4_matmul(x, packed, scales, zeros, group_size=g, perm=perm, interpret=INTERPRET)
    ref = int4_matmul_reference(x, packed, scales, zeros, group_size=g, perm=perm)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert _rel_err(y, ref) <= REL_TOL[dtype]


@pytest.mark.parametrize(
    "sizes",
    [
        MatmulBlockSizes(block_m=16, block_n=32, block_k=64, split_k=2),  # K tile inside a group
        MatmulBlockSizes(block_m=32, block_n=64, block_k=128, split_k=2),  # uneven split: 3 tiles
        MatmulBlockSizes(block_m=16, block_n=16, block_k=16, split_k=1),  # smallest tiles
    ],
)
def test_int4_block_sizes(sizes):
    m, k, n, g = 5, 384, 64, 128
    x, packed, scales, zeros, _ = _int4_problem(m, k, n, g, "float32", seed=7)
    y = int4_matmul(x, packed, scales, zeros, group_size=g, block_sizes=sizes, interpret=INTERPRET)
    ref = int4_matmul_reference(x, packed, scales, zeros, group_size=g)
    assert _rel_err(y, ref) <= REL_TOL["float32"]


def test_int4_odd_n_is_padded():
    m, k, n, g = 2, 128, 40, 32  # N has no power-of-two factor >= 16
    x, packed, scales, zeros, _ = _int4_problem(m, k, n, g, "float32", seed=3)
    y = int4_matmul(x, packed, scales, zeros, group_size=g, interpret=INTERPRET)
    ref = int4_matmul_reference(x, packed, scales, zeros, group_size=g)
    assert y.shape == (m, n)
    assert _rel_err(y, ref) <= REL_TOL["float32"]


def test_int4_reference_against_numpy():
    """The oracle itself: float64 numpy dequantization from the nibbles written above."""
    m, k, n, g = 3, 256, 48, 64
    x, packed, scales, zeros, q = _int4_problem(m, k, n, g, "float32", seed=11)
    perm = np.random.default_rng(0).permutation(k)
    w = (q - np.repeat(np.asarray(zeros), g, 0)) * np.repeat(np.asarray(scales, np.float64), g, 0)
    want = np.asarray(x, np.float64)[:, perm] @ w  # y = x[:, perm] @ w_stored
    got = int4_matmul_reference(x, packed, scales, zeros, group_size=g, perm=jnp.asarray(perm))
    assert _rel_err(got, want) <= 1e-6
    # Negative control: the other permutation convention (x[:, argsort(perm)]) is far off.
    other = np.asarray(x, np.float64)[:, np.argsort(perm)] @ w
    assert _rel_err(got, other) > 0.1


@pytest.mark.parametrize(
    "m,k,n,g,dtype,sizes",
    [
        (1, 576, 192, 32, "float32", None),  # SmolLM2's q/k shapes (Q4_1 blocks of 32)
        (5, 384, 40, 32, "float32", None),  # odd N: mins padded like the scales
        (16, 256, 64, 128, "bfloat16", None),  # K tile inside one group
        (3, 256, 64, 32, "float32", MatmulBlockSizes(block_m=16, block_n=32, block_k=64)),
    ],
)
def test_int4_with_mins_matches_reference(m, k, n, g, dtype, sizes):
    """The float-offset variant (GGUF Q4_1): w = (q - z) * s + mins."""
    x, packed, scales, zeros, q = _int4_problem(m, k, n, g, dtype, seed=m + k + n)
    mins_np = np.random.default_rng(g).uniform(-1.0, 1.0, (k // g, n))
    mins = jnp.asarray(mins_np, dtype)
    kw = dict(group_size=g, mins=mins)
    y = int4_matmul(x, packed, scales, zeros, **kw, block_sizes=sizes, interpret=INTERPRET)
    ref = int4_matmul_reference(x, packed, scales, zeros, **kw)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert _rel_err(y, ref) <= REL_TOL[dtype]
    if dtype == "float32":  # the oracle against float64 numpy; the mins matter (control)
        s64, z = np.asarray(scales, np.float64), np.asarray(zeros)
        w = (q - np.repeat(z, g, 0)) * np.repeat(s64, g, 0) + np.repeat(
            np.asarray(mins, np.float64), g, 0
        )
        assert _rel_err(ref, np.asarray(x, np.float64) @ w) <= REL_TOL["float32"]
        without = int4_matmul_reference(x, packed, scales, zeros, group_size=g)
        assert _rel_err(without, ref) > 0.1


def test_int4_rejects_bad_mins():
    args, g = _valid_int4()
    bad = jnp.zeros((args["scales"].shape[0], 8), jnp.float32)
    with pytest.raises(ValueError, match="mins has shape"):
        int4_matmul(**args, group_size=g, mins=bad, interpret=INTERPRET)
    with pytest.raises(ValueError, match="mins has shape"):
        int4_matmul(**args, group_size=g, mins=args["scales"].astype(jnp.bfloat16))


def test_pack_unpack_roundtrip_and_layout():
    q = np.random.default_rng(1).integers(0, 16, (64, 24))
    packed = np.asarray(pack_int4(jnp.asarray(q)))
    assert packed.dtype == np.uint32 and packed.shape == (8, 24)
    for j in range(8):  # row 8r + j is nibble j (low nibble first)
        np.testing.assert_array_equal((packed >> np.uint32(4 * j)) & 0xF, q[j::8])
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed))), q)


def test_default_block_sizes_table():
    for m in (1, 16, 17, 64, 65, 256, 257, 100_000):
        sizes = default_block_sizes(m)
        plan = plan_tiles(m, 4096, 11008, sizes, 128)
        assert plan.m_pad >= m and plan.m_pad % sizes.block_m == 0
        assert 11008 % plan.block_n == 0 and 4096 % plan.block_k == 0
        assert plan.splits * plan.tiles_per_split >= plan.num_k_tiles
        assert (plan.splits - 1) * plan.tiles_per_split < plan.num_k_tiles  # no empty split
    # M = 1 on a 4096 x 4096 layer: split-K multiplies the programs beyond N / block_n.
    plan = plan_tiles(1, 4096, 4096, default_block_sizes(1), 128)
    assert np.prod(plan.grid) >= 4 * (4096 // plan.block_n)


# ----------------------------------------------------------------------------- int8


@pytest.mark.parametrize(
    "m,k,n,dtype", [(1, 256, 64, "float32"), (33, 384, 256, "float32"), (3, 128, 64, "bfloat16")]
)
def test_int8_matches_reference(m, k, n, dtype):
    rng = np.random.default_rng(m + k)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    w_scales = jnp.asarray(rng.uniform(0.5, 1.5, n) / 127, jnp.float32)
    y = int8_matmul(x, w, w_scales, interpret=INTERPRET)
    ref = int8_matmul_reference(x, w, w_scales)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert _rel_err(y, ref) <= REL_TOL[dtype]
    want = np.asarray(x, np.float64) @ (np.asarray(w, np.float64) * np.asarray(w_scales)[None])
    assert _rel_err(ref, want) <= REL_TOL[dtype]


@pytest.mark.parametrize("m,k,n", [(1, 1024, 64), (33, 384, 256)])
def test_int8_int8_matches_reference(m, k, n):
    rng = np.random.default_rng(m * n)
    x = jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
    x_scales = jnp.asarray(rng.uniform(0.5, 1.5, m) / 127, jnp.float32)
    w = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    w_scales = jnp.asarray(rng.uniform(0.5, 1.5, n) / 127, jnp.float32)
    y = int8_int8_matmul(x, x_scales, w, w_scales, interpret=INTERPRET)
    ref = int8_int8_matmul_reference(x, x_scales, w, w_scales)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    # int32 accumulation is exact in both; only the two float32 scale products may round.
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=0)
    acc = np.asarray(x, np.int64) @ np.asarray(w, np.int64)  # exact
    want = acc * np.asarray(x_scales, np.float64)[:, None] * np.asarray(w_scales)[None]
    assert _rel_err(ref, want) <= 1e-6


# ----------------------------------------------------------------------------- validation


def _valid_int4(m=2, k=128, n=64, g=32):
    x, packed, scales, zeros, _ = _int4_problem(m, k, n, g, "float32", seed=0)
    return dict(x=x, packed=packed, scales=scales, zeros=zeros), g


@pytest.mark.parametrize(
    "change,group_size,match",
    [
        (lambda a: {"x": a["x"][0]}, 32, "x has shape"),
        (lambda a: {"x": a["x"].astype(jnp.int32)}, 32, "x has dtype"),
        (lambda a: {"packed": a["packed"].astype(jnp.int32)}, 32, "packed has dtype"),
        (lambda a: {"packed": a["packed"][:8]}, 32, "packed has shape"),
        (lambda a: {}, 12, "group_size=12"),  # not a multiple of 8
        (lambda a: {}, 48, "group_size=48"),  # does not divide K = 128
        (lambda a: {"scales": a["scales"][:2]}, 32, "scales has shape"),
        (lambda a: {"scales": a["scales"].astype(jnp.bfloat16)}, 32, "scales has dtype"),
        (lambda a: {"zeros": a["zeros"].astype(jnp.float32)}, 32, "zeros has dtype"),
        (lambda a: {"zeros": a["zeros"][:, :8]}, 32, "zeros has shape"),
    ],
)
def test_int4_rejects_bad_inputs(change, group_size, match):
    args, _ = _valid_int4()
    args.update(change(args))
    with pytest.raises(ValueError, match=match):
        int4_matmul(**args, group_size=group_size, interpret=INTERPRET)


def test_int4_rejects_bad_perm_and_untileable_group():
    args, g = _valid_int4()
    with pytest.raises(ValueError, match="perm has shape"):
        int4_matmul(**args, group_size=g, perm=jnp.arange(64), interpret=INTERPRET)
    args, g = _valid_int4(k=48, g=24)  # valid layout, but no power-of-two K tile >= 16
    with pytest.raises(ValueError, match="group_size=24"):
        int4_matmul(**args, group_size=g, interpret=INTERPRET)


def test_int8_rejects_bad_inputs():
    x = jnp.ones((2, 64), jnp.float32)
    w = jnp.ones((64, 32), jnp.int8)
    s = jnp.ones((32,), jnp.float32)
    with pytest.raises(ValueError, match="w has dtype"):
        int8_matmul(x, w.astype(jnp.int32), s, interpret=INTERPRET)
    with pytest.raises(ValueError, match="w has dtype"):
        int8_matmul(x, w[:32], s, interpret=INTERPRET)  # K mismatch
    with pytest.raises(ValueError, match="w_scales has shape"):
        int8_matmul(x, w, s[:8], interpret=INTERPRET)
    xs = jnp.ones((2,), jnp.float32)
    with pytest.raises(ValueError, match="x has dtype"):
        int8_int8_matmul(x, xs, w, s, interpret=INTERPRET)  # float activations
    with pytest.raises(ValueError, match="x_scales has shape"):
        int8_int8_matmul(x.astype(jnp.int8), xs[:1], w, s, interpret=INTERPRET)


# ----------------------------------------------------------------------------- Triton lowering


def _lowers_to_triton(fn, *args) -> bool:
    """Lowers the compiled (non-interpret) op for CUDA on this CPU machine: no GPU needed.

    This runs the Pallas -> Triton IR lowering, which rejects non-power-of-two tiles, too-small
    dots and unsupported primitives, so kernels that only ever ran interpreted stay GPU-ready.
    """
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    return "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text


@pytest.mark.parametrize("m,k,n,g", [(1, 4096, 256, 128), (300, 384, 256, 384)])
def test_int4_lowers_to_triton(m, k, n, g):
    x, packed, scales, zeros, _ = _int4_problem(m, k, n, g, "bfloat16", seed=0)
    perm = jnp.arange(k, dtype=jnp.int32)

    def op(x, packed, scales, zeros, perm):
        return int4_matmul(x, packed, scales, zeros, group_size=g, perm=perm)

    assert _lowers_to_triton(op, x, packed, scales, zeros, perm)


def test_int8_lowers_to_triton():
    x = jnp.ones((4, 256), jnp.bfloat16)
    w = jnp.ones((256, 128), jnp.int8)
    s = jnp.ones((128,), jnp.float32)
    assert _lowers_to_triton(int8_matmul, x, w, s)
    xs = jnp.ones((4,), jnp.float32)
    assert _lowers_to_triton(int8_int8_matmul, x.astype(jnp.int8), xs, w, s)
