"""Ragged paged attention in interpret mode on CPU, against the pure-jnp reference.

Every batch mixes decode (q_len 1), verification-sized (5) and prefill-chunk (17) queries over
contexts of 1, S-1, S, S+1, 17 and a long context, plus a padded sequence (q_len 0, seq_len 0)
in the middle and padding rows at the end of q. Block tables are random permutations of the
physical blocks; their unused entries hold an out-of-range block id, and every page slot outside
a live context (and every padding row of q) is NaN, so the output can only be finite if nothing
outside the live context leaks in. The configuration grid is a pairwise covering array of the
axes below (checked by `test_attention_grid_is_pairwise`): every pair of values of any two axes
appears in some case, instead of the full 2 * 3 * 3 * 3 * 3 * 3 * 2 product.
"""

import dataclasses
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    AttentionBlockSizes,
    default_attention_block_sizes,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.paged_attention import kernel as paged_attention
from pallas_kernels.paged_attention.kernel import _resolve_layer
from pallas_kernels.testing import INTERPRET, ragged_attention_batch, relative_error, stack_layers

AXES = {
    "block_size": (8, 16),
    "heads": ((4, 4), (8, 2), (8, 1)),  # (H, K): MHA, GQA, MQA
    "head_dim": (32, 64, 128),
    "kv_dtype": ("float32", "int8", "float8_e4m3fn"),
    "window": (None, 5, 20),
    "partitions": (None, 1, 3),  # None: chosen by the kernel from its grid size
    "block_kv": (16, 64),
}
GRID = (
    (16, (4, 4), 64, "float8_e4m3fn", 20, 3, 64),
    (16, (8, 1), 128, "float8_e4m3fn", 5, 1, 16),
    (16, (8, 1), 128, "int8", None, 3, 64),
    (16, (8, 1), 64, "int8", None, None, 64),
    (16, (8, 2), 128, "float32", 20, 3, 16),
    (16, (8, 2), 32, "float8_e4m3fn", None, None, 16),
    (16, (8, 2), 64, "float32", 5, 1, 16),
    (8, (4, 4), 128, "int8", 5, None, 16),
    (8, (4, 4), 32, "float8_e4m3fn", 5, 3, 64),
    (8, (4, 4), 64, "float32", None, 1, 16),
    (8, (8, 1), 32, "float32", 20, None, 64),
    (8, (8, 2), 32, "int8", 20, 1, 64),
)
# Max |error| / max(1, max |reference|). float32 differs from the reference only in summation
# order; bfloat16 rounds q, k, v and the probabilities to an 8-bit mantissa before each dot.
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def test_attention_grid_is_pairwise():
    names = list(AXES)
    for a, b in itertools.combinations(range(len(names)), 2):
        seen = {(case[a], case[b]) for case in GRID}
        want = set(itertools.product(AXES[names[a]], AXES[names[b]]))
        assert seen == want, f"pair ({names[a]}, {names[b]}) misses {want - seen}"


@pytest.mark.parametrize("block_size,heads,head_dim,kv_dtype,window,partitions,block_kv", GRID)
def test_matches_reference(block_size, heads, head_dim, kv_dtype, window, partitions, block_kv):
    args, kw = ragged_attention_batch(
        block_size, heads, head_dim, kv_dtype, seed=head_dim + block_size
    )
    sizes = AttentionBlockSizes(block_rows=16, block_kv=block_kv, num_partitions=partitions)
    out = ragged_paged_attention(
        *args, **kw, sliding_window=window, block_sizes=sizes, interpret=INTERPRET
    )
    ref = ragged_paged_attention_reference(*args, **kw, sliding_window=window)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    out = np.asarray(out)
    assert np.isfinite(out).all()
    assert np.isfinite(np.asarray(ref)).all()
    n_live = int(args[3][-1])
    assert (out[n_live:] == 0).all()  # padding rows
    assert relative_error(out, ref) <= TOL["float32"]


def test_window_is_exact():
    """Negative control for the window: off by one position, the reference is far from the op."""
    args, kw = ragged_attention_batch(8, (8, 2), 32, "float32", seed=5)
    sizes = AttentionBlockSizes(block_kv=16, num_partitions=2)
    out = ragged_paged_attention(*args, sliding_window=6, block_sizes=sizes, interpret=INTERPRET)
    assert (
        relative_error(out, ragged_paged_attention_reference(*args, sliding_window=6))
        <= TOL["float32"]
    )
    assert relative_error(out, ragged_paged_attention_reference(*args, sliding_window=7)) > 1e-3
    assert relative_error(out, ragged_paged_attention_reference(*args)) > 1e-3


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_bfloat16_default_block_sizes(kv_dtype):
    args, kw = ragged_attention_batch(16, (8, 2), 64, kv_dtype, q_dtype="bfloat16", seed=9)
    out = ragged_paged_attention(*args, **kw, interpret=INTERPRET)  # block sizes from the table
    ref = ragged_paged_attention_reference(*args, **kw)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    assert relative_error(out, ref) <= TOL["bfloat16"]


def test_group_not_power_of_two():
    """H / K = 3 query heads per kv head: the kernel pads the group to 4 and drops the pad."""
    args, _ = ragged_attention_batch(8, (6, 2), 32, "float32", seed=6)
    sizes = AttentionBlockSizes(block_kv=16)
    out = ragged_paged_attention(*args, block_sizes=sizes, interpret=INTERPRET)
    assert relative_error(out, ragged_paged_attention_reference(*args)) <= TOL["float32"]


def test_decode_batch_matches_reference():
    """A pure decode batch (T == B) takes the decode row of the table and many partitions."""
    args, kw = ragged_attention_batch(8, (8, 2), 32, "float32", seed=2)
    q, k, v, query_start, seq_lens, tables = args
    live = np.asarray(seq_lens) > 0
    seq_lens = jnp.asarray(np.asarray(seq_lens)[live])
    tables = jnp.asarray(np.asarray(tables)[live])
    rows = np.asarray(query_start)[1:][live] - 1  # each sequence's last query
    q = q[rows]
    query_start = jnp.arange(len(rows) + 1, dtype=jnp.int32)
    assert default_attention_block_sizes(len(rows), len(rows)).block_rows == 16
    out = ragged_paged_attention(q, k, v, query_start, seq_lens, tables, interpret=INTERPRET)
    ref = ragged_paged_attention_reference(q, k, v, query_start, seq_lens, tables)
    assert relative_error(out, ref) <= TOL["float32"]


def test_wide_heads_take_narrower_key_tiles(monkeypatch):
    """D > 128 halves the key tile per doubling of D (no spills on sm_90); D <= 128 is the table."""
    for t, b in ((4, 4), (20, 4), (300, 2)):
        base = default_attention_block_sizes(t, b)
        assert default_attention_block_sizes(t, b, 64) == base
        assert default_attention_block_sizes(t, b, 128) == base
        wide = default_attention_block_sizes(t, b, 256)
        assert wide.block_kv == base.block_kv // 2
        assert dataclasses.replace(wide, block_kv=base.block_kv) == base
        assert default_attention_block_sizes(t, b, 1024).block_kv == 16  # never below a dot
    # The op picks the narrow tile by default and still matches the oracle.
    planned = []
    real_plan = paged_attention.plan_attention
    monkeypatch.setattr(
        paged_attention, "plan_attention", lambda *a: planned.append(a[-1]) or real_plan(*a)
    )
    args, kw = ragged_attention_batch(16, (4, 2), 256, "float32", seed=9)
    out = ragged_paged_attention(*args, **kw, interpret=INTERPRET)
    assert [s.block_kv for s in planned] == [32]
    assert relative_error(out, ragged_paged_attention_reference(*args, **kw)) <= TOL["float32"]


# ----------------------------------------------------------------------------- stacked layers


@pytest.mark.parametrize(
    "kv_dtype,window",
    [
        ("float32", None),
        ("float32", 5),
        ("int8", None),
        ("int8", 20),
        ("float8_e4m3fn", None),
        ("float8_e4m3fn", 5),
    ],
)
def test_layer_reads_stacked_pages(kv_dtype, window):
    """With `layer`, the op on stacked pages equals the reference on that layer's pages alone."""
    args, kw = ragged_attention_batch(8, (8, 2), 32, kv_dtype, seed=11)
    stacked_args, stacked_kw = stack_layers(args, kw, layer=1)
    sizes = AttentionBlockSizes(block_kv=16, num_partitions=2)
    out = ragged_paged_attention(
        *stacked_args, **stacked_kw, layer=jnp.int32(1), sliding_window=window,
        block_sizes=sizes, interpret=INTERPRET,
    )  # fmt: skip
    ref = ragged_paged_attention_reference(*args, **kw, sliding_window=window)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert np.isfinite(np.asarray(out)).all()
    assert relative_error(out, ref) <= TOL["float32"]
    # The reference takes `layer` too, and agrees with itself on the slice.
    ref_layer = ragged_paged_attention_reference(
        *stacked_args, **stacked_kw, layer=1, sliding_window=window
    )
    np.testing.assert_array_equal(np.asarray(ref_layer), np.asarray(ref))


def test_layer_indexes_like_jnp():
    """A negative layer counts from the end and an out-of-range one clamps, as `pages[layer]`."""
    args, _ = ragged_attention_batch(8, (4, 4), 32, "float32", seed=12)
    stacked_args, _ = stack_layers(args, {}, layer=2)
    sizes = AttentionBlockSizes(block_kv=16, num_partitions=1)
    ref = ragged_paged_attention_reference(*args)

    @jax.jit
    def run(layer):  # traced: no check can see the value
        return ragged_paged_attention(
            *stacked_args, layer=layer, block_sizes=sizes, interpret=INTERPRET
        )

    for layer in (2, -1, 7):
        assert relative_error(run(jnp.int32(layer)), ref) <= TOL["float32"], layer
    for layer in (0, -3, -5):  # negative control: these resolve to layer 0, which is NaN
        assert not np.isfinite(np.asarray(run(jnp.int32(layer)))).all(), layer


def test_resolve_layer_matches_jnp_indexing():
    """The wrapper's layer rule (the only guard on a GPU, where interpret's gather is absent)."""
    num_layers = 3
    layers = jnp.arange(-6, 7, dtype=jnp.int32)
    got = jax.jit(jax.vmap(lambda i: _resolve_layer(i, num_layers)))(layers)
    want = jax.jit(jax.vmap(lambda i: jnp.arange(num_layers)[i]))(layers)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------------------- the oracle


def _numpy_loop(q, k_pages, v_pages, query_start, seq_lens, block_tables, window, ks, vs):
    """One query and one head at a time, in float64: the definition, written out."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    t, h, d = q.shape
    kv_heads, s = k_pages.shape[1], k_pages.shape[2]
    out = np.zeros((t, h, d))
    for b in range(len(seq_lens)):
        q_len = query_start[b + 1] - query_start[b]
        for i in range(q_len):
            p = seq_lens[b] - q_len + i
            lo = 0 if window is None else max(0, p - window + 1)
            for head in range(h):
                kvh = head // (h // kv_heads)
                keys, vals = [], []
                for pos in range(lo, p + 1):
                    blk, slot = block_tables[b, pos // s], pos % s
                    keys.append(
                        k_pages[blk, kvh, slot] * (1.0 if ks is None else ks[blk, kvh, slot])
                    )
                    vals.append(
                        v_pages[blk, kvh, slot] * (1.0 if vs is None else vs[blk, kvh, slot])
                    )
                logits = np.array(keys) @ q[query_start[b] + i, head] / math.sqrt(d)
                w = np.exp(logits - logits.max())
                out[query_start[b] + i, head] = (w / w.sum()) @ np.array(vals)
    return out


@pytest.mark.parametrize("kv_dtype,window", [("float32", None), ("int8", 7)])
def test_reference_against_numpy_loop(kv_dtype, window):
    args, kw = ragged_attention_batch(8, (8, 2), 32, kv_dtype, seed=4)
    ref = ragged_paged_attention_reference(*args, **kw, sliding_window=window)
    np_args = [np.asarray(a) for a in args]
    ks = None if not kw else np.asarray(kw["k_scale"], np.float64)
    vs = None if not kw else np.asarray(kw["v_scale"], np.float64)
    want = _numpy_loop(*np_args, window, ks, vs)
    assert relative_error(ref, want) <= 1e-5
    # Negative control: the comparison is sensitive to the window it checks.
    other = _numpy_loop(*np_args, 4 if window is None else window + 1, ks, vs)
    assert relative_error(ref, other) > 1e-3


# ----------------------------------------------------------------------------- validation


def _valid():
    args, _ = ragged_attention_batch(8, (8, 2), 32, "float32")
    return list(args)


def _with(i, value):
    args = _valid()
    args[i] = value
    return args


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (lambda a: _with(0, a[0][:, 0]), {}, "q has shape"),
        (lambda a: _with(0, a[0].astype(jnp.int32)), {}, "q has shape .* dtype int32"),
        (lambda a: _with(1, a[1][:, :1]), {}, "k_pages .* and v_pages"),
        (lambda a: _with(0, a[0][:, :, :16]), {}, "head_dim 32; expected q's head_dim 16"),
        (lambda a: _with(0, jnp.zeros((5, 5, 32))), {}, "H=5 .* K=2"),
        (
            lambda a: (
                [jnp.zeros((5, 4, 48)), jnp.zeros((3, 2, 8, 48)), jnp.zeros((3, 2, 8, 48))] + a[3:]
            ),
            {},
            "head_dim=48",
        ),
        (
            lambda a: (
                [jnp.zeros((5, 4, 32)), jnp.zeros((3, 2, 12, 32)), jnp.zeros((3, 2, 12, 32))]
                + a[3:]
            ),
            {},
            "block size S=12",
        ),
        (lambda a: _with(1, a[1].astype(jnp.int32)), {}, "k_pages has dtype int32"),
        (
            lambda a: a[:1] + [a[1].astype(jnp.int8), a[2].astype(jnp.int8)] + a[3:],
            {},
            "int8 pages need k_scale",
        ),
        (lambda a: a, {"k_scale": jnp.ones((1, 2, 8))}, "given together"),
        (lambda a: a, {"k_scale": jnp.ones((1, 2, 8)), "v_scale": jnp.ones((1, 2, 8))}, "k_scale"),
        (lambda a: _with(3, a[3][:-1]), {}, "query_start has shape"),
        (lambda a: _with(4, a[4].astype(jnp.float32)), {}, "seq_lens has shape .* float32"),
        (lambda a: _with(5, a[5][0]), {}, "block_tables has shape"),
        (lambda a: a, {"sliding_window": 0}, "sliding_window=0"),
        # layer: the pages must then be stacked [L, ...], and layer a scalar integer
        (lambda a: a, {"layer": 0}, r"k_pages \(\d+, 2, 8, 32\) .* \[L, num_blocks"),
        (lambda a: stack_layers(a, {}, 0)[0], {}, r"k_pages \(3, \d+, 2, 8, 32\) .* \[num_blocks"),
        (
            lambda a: stack_layers(a, {}, 0)[0],
            {"layer": jnp.zeros(2, jnp.int32)},
            r"layer has shape \(2,\)",
        ),
        (lambda a: stack_layers(a, {}, 0)[0], {"layer": 1.0}, "layer has dtype float32"),
        (lambda a: stack_layers(a, {}, 0)[0], {"layer": True}, "layer has dtype bool"),
        (
            lambda a: stack_layers(a, {}, 0)[0][:1] + [stack_layers(a, {}, 0)[0][1]] + a[2:],
            {"layer": 0},
            "k_pages .* and v_pages",
        ),
    ],
)
def test_rejects_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*args(_valid()), **kwargs, interpret=INTERPRET)


@pytest.mark.parametrize("scale_layers", [None, 2])
def test_rejects_unstacked_scales_with_layer(scale_layers):
    """With `layer`, scales must be [L, num_blocks, K, S] with the pages' L."""
    args, kw = ragged_attention_batch(8, (8, 2), 32, "int8")
    stacked_args, stacked_kw = stack_layers(args, kw, layer=0)  # L = 3
    scales = kw if scale_layers is None else stack_layers(args, kw, 0, num_layers=scale_layers)[1]
    want = re.escape(str(stacked_kw["k_scale"].shape))
    with pytest.raises(ValueError, match=f"k_scale has shape .*; expected float32 {want}"):
        ragged_paged_attention(*stacked_args, **scales, layer=0, interpret=INTERPRET)


# ----------------------------------------------------------------------------- Triton lowering


@pytest.mark.parametrize(
    "kv_dtype,q_dtype,window", [("float32", "float32", None), ("int8", "bfloat16", 5)]
)
def test_lowers_to_triton(kv_dtype, q_dtype, window):
    """Lowers the compiled op for CUDA on this CPU machine (Pallas -> Triton IR, no GPU)."""
    args, kw = ragged_attention_batch(16, (8, 2), 64, kv_dtype, q_dtype=q_dtype)

    def op(*a):
        return ragged_paged_attention(*a, **kw, sliding_window=window)

    text = jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text


def test_lowers_to_triton_with_layer():
    """The stacked-cache variant, with a traced layer, lowers for CUDA too."""
    args, kw = ragged_attention_batch(16, (8, 2), 64, "int8", q_dtype="bfloat16")
    stacked_args, stacked_kw = stack_layers(args, kw, layer=1)

    def op(layer, *a):
        return ragged_paged_attention(*a, **stacked_kw, layer=layer, sliding_window=5)

    lowered = jax.jit(op).trace(jnp.int32(1), *stacked_args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text
