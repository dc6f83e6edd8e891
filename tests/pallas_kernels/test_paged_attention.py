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

import itertools
import math

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


def _batch(block_size, heads, head_dim, kv_dtype, q_dtype="float32", seed=0):
    """A NaN-poisoned ragged batch; returns (args, kwargs) of the op."""
    s = block_size
    h, kv_heads = heads
    rng = np.random.default_rng(seed)
    long = 6 * s + 3
    contexts = [1, s - 1, 0, s, s + 1, 17, long]
    q_lens = [1, 5, 0, 1, 5, 17, 17]  # decode, verify, padding, decode, verify, prefill x2
    b = len(contexts)
    max_blocks = -(-long // s) + 1  # one spare column of junk in every row
    blocks_needed = [-(-c // s) for c in contexts]
    num_blocks = sum(blocks_needed) + 5  # a few physical blocks no sequence uses
    physical = rng.permutation(num_blocks)
    block_tables = np.full((b, max_blocks), num_blocks + 1000, np.int32)  # junk: out of range
    live = np.zeros((num_blocks, s), bool)  # [num_blocks, S] slots inside a live context
    used = 0
    for i, (c, nb) in enumerate(zip(contexts, blocks_needed)):
        block_tables[i, :nb] = physical[used : used + nb]
        used += nb
        for t in range(c):
            live[block_tables[i, t // s], t % s] = True
    live4 = np.broadcast_to(live[:, None, :, None], (num_blocks, kv_heads, s, head_dim))

    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(query_start[-1]) + 3  # three padding rows
    q = rng.standard_normal((num_tokens, h, head_dim))
    q[query_start[-1] :] = np.nan

    kw = {}
    shape = (num_blocks, kv_heads, s, head_dim)
    if kv_dtype == "int8":
        k = rng.integers(-127, 128, shape)
        v = rng.integers(-127, 128, shape)
        k_scale = rng.uniform(0.5, 1.5, shape[:3]) / 64
        v_scale = rng.uniform(0.5, 1.5, shape[:3]) / 64
        k, v = np.where(live4, k, 127), np.where(live4, v, -128)  # int8 has no NaN: junk
        kw = _scales(k_scale, v_scale, live)
    elif kv_dtype == "float8_e4m3fn":
        k = np.where(live4, rng.standard_normal(shape) * 8, np.nan)
        v = np.where(live4, rng.standard_normal(shape) * 8, np.nan)
        kw = _scales(rng.uniform(0.1, 0.2, shape[:3]), rng.uniform(0.1, 0.2, shape[:3]), live)
    else:
        k = np.where(live4, rng.standard_normal(shape), np.nan)
        v = np.where(live4, rng.standard_normal(shape), np.nan)
    page_dtype = q_dtype if kv_dtype == "float32" else kv_dtype
    args = (
        jnp.asarray(q, q_dtype),
        jnp.asarray(k, page_dtype),
        jnp.asarray(v, page_dtype),
        jnp.asarray(query_start),
        jnp.asarray(np.array(contexts, np.int32)),
        jnp.asarray(block_tables),
    )
    return args, kw


def _scales(k_scale, v_scale, live):
    live3 = np.broadcast_to(live[:, None, :], k_scale.shape)
    return {
        "k_scale": jnp.asarray(np.where(live3, k_scale, np.nan), jnp.float32),
        "v_scale": jnp.asarray(np.where(live3, v_scale, np.nan), jnp.float32),
    }


def _err(y, ref) -> float:
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    return float(np.abs(y - ref).max() / max(1.0, np.abs(ref).max()))


def test_attention_grid_is_pairwise():
    names = list(AXES)
    for a, b in itertools.combinations(range(len(names)), 2):
        seen = {(case[a], case[b]) for case in GRID}
        want = set(itertools.product(AXES[names[a]], AXES[names[b]]))
        assert seen == want, f"pair ({names[a]}, {names[b]}) misses {want - seen}"


@pytest.mark.parametrize("block_size,heads,head_dim,kv_dtype,window,partitions,block_kv", GRID)
def test_matches_reference(block_size, heads, head_dim, kv_dtype, window, partitions, block_kv):
    args, kw = _batch(block_size, heads, head_dim, kv_dtype, seed=head_dim + block_size)
    sizes = AttentionBlockSizes(block_rows=16, block_kv=block_kv, num_partitions=partitions)
    out = ragged_paged_attention(
        *args, **kw, sliding_window=window, block_sizes=sizes, interpret=True
    )
    ref = ragged_paged_attention_reference(*args, **kw, sliding_window=window)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    out = np.asarray(out)
    assert np.isfinite(out).all()
    assert np.isfinite(np.asarray(ref)).all()
    n_live = int(args[3][-1])
    assert (out[n_live:] == 0).all()  # padding rows
    assert _err(out, ref) <= TOL["float32"]


def test_window_is_exact():
    """Negative control for the window: off by one position, the reference is far from the op."""
    args, kw = _batch(8, (8, 2), 32, "float32", seed=5)
    sizes = AttentionBlockSizes(block_kv=16, num_partitions=2)
    out = ragged_paged_attention(*args, sliding_window=6, block_sizes=sizes, interpret=True)
    assert _err(out, ragged_paged_attention_reference(*args, sliding_window=6)) <= TOL["float32"]
    assert _err(out, ragged_paged_attention_reference(*args, sliding_window=7)) > 1e-3
    assert _err(out, ragged_paged_attention_reference(*args)) > 1e-3


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_bfloat16_default_block_sizes(kv_dtype):
    args, kw = _batch(16, (8, 2), 64, kv_dtype, q_dtype="bfloat16", seed=9)
    out = ragged_paged_attention(*args, **kw, interpret=True)  # block sizes from the table
    ref = ragged_paged_attention_reference(*args, **kw)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    assert _err(out, ref) <= TOL["bfloat16"]


def test_group_not_power_of_two():
    """H / K = 3 query heads per kv head: the kernel pads the group to 4 and drops the pad."""
    args, _ = _batch(8, (6, 2), 32, "float32", seed=6)
    sizes = AttentionBlockSizes(block_kv=16)
    out = ragged_paged_attention(*args, block_sizes=sizes, interpret=True)
    assert _err(out, ragged_paged_attention_reference(*args)) <= TOL["float32"]


def test_decode_batch_matches_reference():
    """A pure decode batch (T == B) takes the decode row of the table and many partitions."""
    args, kw = _batch(8, (8, 2), 32, "float32", seed=2)
    q, k, v, query_start, seq_lens, tables = args
    live = np.asarray(seq_lens) > 0
    seq_lens = jnp.asarray(np.asarray(seq_lens)[live])
    tables = jnp.asarray(np.asarray(tables)[live])
    rows = np.asarray(query_start)[1:][live] - 1  # each sequence's last query
    q = q[rows]
    query_start = jnp.arange(len(rows) + 1, dtype=jnp.int32)
    assert default_attention_block_sizes(len(rows), len(rows)).block_rows == 16
    out = ragged_paged_attention(q, k, v, query_start, seq_lens, tables, interpret=True)
    ref = ragged_paged_attention_reference(q, k, v, query_start, seq_lens, tables)
    assert _err(out, ref) <= TOL["float32"]


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
    args, kw = _batch(8, (8, 2), 32, kv_dtype, seed=4)
    ref = ragged_paged_attention_reference(*args, **kw, sliding_window=window)
    np_args = [np.asarray(a) for a in args]
    ks = None if not kw else np.asarray(kw["k_scale"], np.float64)
    vs = None if not kw else np.asarray(kw["v_scale"], np.float64)
    want = _numpy_loop(*np_args, window, ks, vs)
    assert _err(ref, want) <= 1e-5
    # Negative control: the comparison is sensitive to the window it checks.
    other = _numpy_loop(*np_args, 4 if window is None else window + 1, ks, vs)
    assert _err(ref, other) > 1e-3


# ----------------------------------------------------------------------------- validation


def _valid():
    args, _ = _batch(8, (8, 2), 32, "float32")
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
    ],
)
def test_rejects_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*args(_valid()), **kwargs, interpret=True)


# ----------------------------------------------------------------------------- Triton lowering


@pytest.mark.parametrize(
    "kv_dtype,q_dtype,window", [("float32", "float32", None), ("int8", "bfloat16", 5)]
)
def test_lowers_to_triton(kv_dtype, q_dtype, window):
    """Lowers the compiled op for CUDA on this CPU machine (Pallas -> Triton IR, no GPU)."""
    args, kw = _batch(16, (8, 2), 64, kv_dtype, q_dtype=q_dtype)

    def op(*a):
        return ragged_paged_attention(*a, **kw, sliding_window=window)

    text = jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text
