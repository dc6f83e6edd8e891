"""The XLA ragged paged attention (the CPU default) against the oracle.

The batches are the NaN-poisoned ones of the kernel tests (`ragged_attention_batch`): any key,
value or scale outside a live context that leaked into the output would make it NaN. Extra
padding rows change T / B and with it the query tile `_query_tile` picks, so the same batch is
checked with tiles of 4, 8 and 16 rows, and a pure decode batch with tiles of one row. Each batch
also runs with keys chunked by 32 instead of 128, so both the single-chunk path (no loop) and the
online-softmax loop over several chunks are compared.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.ops import attention as attention_ops
from jaxinfer.ops.attention import (
    _query_tile,
    paged_attention,
    paged_attention_reference,
    paged_attention_xla,
    resolve_backend,
)
from pallas_kernels.testing import ragged_attention_batch, relative_error, stack_layers
from tests.helpers import random_params

CASES = [  # block_size, (H, K), head_dim, kv dtype, window
    (16, (4, 4), 64, "float32", None),
    (8, (8, 2), 32, "float32", 5),
    (16, (8, 1), 128, "int8", None),
    (8, (4, 4), 32, "int8", 20),
    (16, (8, 2), 64, "float8_e4m3fn", 20),
    (8, (8, 1), 64, "float8_e4m3fn", None),
]


def _pad_rows(args, extra: int):
    """Appends `extra` NaN padding rows to q (T grows, B stays)."""
    q = args[0]
    pad = jnp.full((extra,) + q.shape[1:], jnp.nan, q.dtype)
    return (jnp.concatenate([q, pad]),) + tuple(args[1:])


@pytest.mark.parametrize("block_size,heads,head_dim,kv_dtype,window", CASES)
@pytest.mark.parametrize("extra_rows", [0, 40, 200])
@pytest.mark.parametrize("keys_per_chunk,one_chunk_keys", [(128, 512), (128, 0), (32, 0)])
def test_matches_reference(
    block_size, heads, head_dim, kv_dtype, window, extra_rows, keys_per_chunk, one_chunk_keys,
    monkeypatch,
):  # fmt: skip
    monkeypatch.setattr(attention_ops, "_KEYS_PER_CHUNK", keys_per_chunk)
    monkeypatch.setattr(attention_ops, "_ONE_CHUNK_KEYS", one_chunk_keys)
    args, kw = ragged_attention_batch(block_size, heads, head_dim, kv_dtype, seed=head_dim)
    args = _pad_rows(args, extra_rows)
    m = args[5].shape[1]
    one = m * block_size <= one_chunk_keys
    chunks = 1 if one else -(-m // max(1, min(m, keys_per_chunk // block_size)))
    assert (chunks == 1) == (one or keys_per_chunk == 128)  # both paths of the op are taken
    out = paged_attention_xla(*args, **kw, sliding_window=window)
    ref = paged_attention_reference(*args, **kw, sliding_window=window)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    out = np.asarray(out)
    assert np.isfinite(out).all()
    n_live = int(args[3][-1])
    assert (out[n_live:] == 0).all()  # padding rows
    assert relative_error(out, ref) <= 1e-5


def test_tiles_cover_several_sizes():
    """The padded batches above do run with different query tiles (else they test one path)."""
    args, _ = ragged_attention_batch(8, (8, 2), 32, "float32")
    t, b = args[0].shape[0], args[4].shape[0]
    assert sorted({_query_tile(t + e, b) for e in (0, 40, 200)}) == [4, 8, 16]
    assert _query_tile(32, 32) == 1  # decode: one row per tile
    assert _query_tile(256, 1) >= 16  # a prefill chunk: big tiles


def test_tile_bound_holds():
    """Every ragged split of T rows over B sequences fits the min(T, T // tq + B) tiles."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        b = int(rng.integers(1, 40))
        t = int(rng.integers(1, 600))
        cuts = np.sort(rng.integers(0, t + 1, b - 1))
        q_lens = np.diff(
            np.concatenate([[0], cuts, [int(rng.integers(cuts[-1] if b > 1 else 0, t + 1))]])
        )
        tq = _query_tile(t, b)
        assert int(np.sum(-(-q_lens // tq))) <= min(t, t // tq + b)


def _decode_batch(kv_dtype, seed):
    """The last query of each live sequence of the poisoned batch: T == B, tiles of one row."""
    args, kw = ragged_attention_batch(8, (8, 2), 32, kv_dtype, seed=seed)
    q, k, v, query_start, seq_lens, tables = args
    live = np.asarray(seq_lens) > 0
    rows = np.asarray(query_start)[1:][live] - 1
    args = (
        q[rows], k, v, jnp.arange(len(rows) + 1, dtype=jnp.int32),
        jnp.asarray(np.asarray(seq_lens)[live]), jnp.asarray(np.asarray(tables)[live]),
    )  # fmt: skip
    return args, kw


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_decode_batch(kv_dtype):
    args, kw = _decode_batch(kv_dtype, seed=2)
    assert _query_tile(args[0].shape[0], args[4].shape[0]) == 1
    out = paged_attention_xla(*args, **kw)
    assert relative_error(out, paged_attention_reference(*args, **kw)) <= 1e-5


@pytest.mark.parametrize("backend", ["xla", "reference", "pallas-interpret"])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_layer_index_reads_that_layer(backend, kv_dtype):
    """`layer=l` over stacked `[L, ...]` pages equals the op on layer l's pages alone."""
    for extra_rows in (0, 40):  # decode-sized and prefill-sized tiles
        args, kw = ragged_attention_batch(8, (8, 2), 32, kv_dtype, seed=11)
        args = _pad_rows(args, extra_rows)
        # Three layers: the wanted one in the middle, NaN / junk layers around it.
        stacked, stacked_kw = stack_layers(args, kw, layer=1)
        out = paged_attention(*stacked, **stacked_kw, layer=jnp.int32(1), backend=backend)
        ref = paged_attention_reference(*args, **kw)
        assert np.isfinite(np.asarray(out)).all()
        assert relative_error(out, ref) <= 1e-5


def test_window_is_exact():
    """Negative control: one position off in the window, the oracle is far from the op."""
    args, kw = ragged_attention_batch(8, (8, 2), 32, "float32", seed=5)
    out = paged_attention_xla(*args, sliding_window=6)
    assert relative_error(out, paged_attention_reference(*args, sliding_window=6)) <= 1e-5
    assert relative_error(out, paged_attention_reference(*args, sliding_window=7)) > 1e-3


def test_bfloat16_queries():
    args, kw = ragged_attention_batch(16, (8, 2), 64, "float32", q_dtype="bfloat16", seed=9)
    out = paged_attention_xla(*args, **kw)
    assert out.dtype == jnp.bfloat16
    assert relative_error(out, paged_attention_reference(*args, **kw)) <= 2e-2


def test_block_table_not_a_multiple_of_the_key_chunk():
    """Blocks of 24 slots: key chunks of 5 blocks, M = 8, so the last chunk is padded."""
    args, kw = ragged_attention_batch(24, (4, 4), 32, "float32", seed=3)
    assert args[5].shape[1] == 8
    out = paged_attention_xla(*args)
    assert relative_error(out, paged_attention_reference(*args)) <= 1e-5


def test_auto_backend_is_xla_on_cpu_and_dispatches():
    assert resolve_backend("auto") == "xla"
    args, kw = ragged_attention_batch(8, (8, 2), 32, "int8", seed=1)
    for backend in ("xla", "reference"):
        out = paged_attention(*args, **kw, backend=backend)
        assert relative_error(out, paged_attention_reference(*args, **kw)) <= 1e-5


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_generate_same_tokens_as_reference(name):
    cfg = ji.preset(name).replace(eos_token_id=None)
    params = random_params(cfg, seed=7)
    rng = np.random.RandomState(3)
    prompts = [rng.randint(0, cfg.vocab_size, n).tolist() for n in (2, 40, 9)]
    sp = ji.SamplingParams(temperature=0, max_tokens=12)
    ref = ji.generate(cfg, params, prompts, sp, backend="reference")
    xla = ji.generate(cfg, params, prompts, sp, backend="xla")
    assert [o.token_ids for o in xla] == [o.token_ids for o in ref]
