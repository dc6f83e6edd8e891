"""The paged forward agrees with the dense forward however the sequence is chunked.

Prefill in one chunk, in chunks of 1, 7 and 16, then decode: every logits row equals
`forward_dense` within 1e-5. Sequences of a batch are chunked differently in the same step,
block tables are permuted, and unused cache slots are NaN-poisoned.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.cache.metadata import SeqChunk, build_metadata
from jaxinfer.model.params import inference_layout
from tests.helpers import random_params

BLOCK = 8


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, batch, cache, cfg):
    return ji.forward(params, cfg, batch, cache, backend="reference")


def _run_chunked(cfg, params, seqs, chunk_sizes, decode_steps, seed=0):
    """Feeds each sequence through the paged forward in its own chunk size; returns logits."""
    rng = np.random.RandomState(seed)
    b = len(seqs)
    m = -(-max(len(s) for s in seqs) // BLOCK)
    perm = rng.permutation(b * m) + 1  # permuted physical blocks; block 0 is the null block
    tables = perm.reshape(b, m)
    cache = ji.init_cache(cfg, 1 + b * m, BLOCK)
    # Poison every slot: only the live context may influence the result.
    cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)
    prefill_len = [len(s) - decode_steps for s in seqs]
    done = [0] * b
    out = [[] for _ in range(b)]
    while True:
        chunks, owners = [], []
        for i, s in enumerate(seqs):
            limit = prefill_len[i] if done[i] < prefill_len[i] else len(s)
            step = chunk_sizes[i] if done[i] < prefill_len[i] else 1
            n = min(step, limit - done[i])
            if n > 0:
                chunks.append(SeqChunk(s[done[i] : done[i] + n], done[i], tables[i], "all"))
                owners.append(i)
                done[i] += n
        if not chunks:
            break
        meta, owner = build_metadata(chunks, BLOCK)
        logits, cache = _forward(params, jax.tree.map(jnp.asarray, meta), cache, cfg)
        logits = np.asarray(logits)
        for row, o in enumerate(owner):
            if o >= 0:
                out[owners[o]].append(logits[row])
    return [np.stack(o) for o in out]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-mqa"])
@pytest.mark.parametrize("form", ["stacked", "unrolled"])
def test_paged_chunked_prefill_then_decode_matches_dense(name, form):
    cfg = ji.preset(name)
    params = random_params(cfg, seed=3)
    paged_params = inference_layout(params) if form == "unrolled" else params
    rng = np.random.RandomState(0)
    lens = [41, 40, 37, 9]
    seqs = [rng.randint(0, cfg.vocab_size, n).tolist() for n in lens]
    # One sequence per chunking scheme: whole prompt in one chunk, chunks of 1, 7 and 16.
    chunk_sizes = [64, 1, 7, 16]
    got = _run_chunked(cfg, paged_params, seqs, chunk_sizes, decode_steps=5)
    for s, g in zip(seqs, got):
        ref = np.asarray(ji.forward_dense(params, cfg, jnp.asarray([s])))[0]
        assert g.shape == ref.shape
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, ref, atol=1e-5, rtol=0)


def test_build_metadata_layout():
    chunks = [SeqChunk([5, 6, 7], 9, [4, 2]), SeqChunk([8], 0, [3], "all")]
    meta, owner = build_metadata(chunks, 8)
    assert meta.tokens.shape == (8,)  # T bucketed to >= 8
    np.testing.assert_array_equal(meta.tokens[:4], [5, 6, 7, 8])
    np.testing.assert_array_equal(meta.positions[:4], [9, 10, 11, 0])
    # position 9 -> logical block 1 -> physical 2, offset 1
    np.testing.assert_array_equal(meta.slot_mapping[:4], [2 * 8 + 1, 2 * 8 + 2, 2 * 8 + 3, 3 * 8])
    np.testing.assert_array_equal(meta.slot_mapping[4:], 0)  # padding rows -> null block
    np.testing.assert_array_equal(meta.query_start, [0, 3, 4])
    np.testing.assert_array_equal(meta.seq_lens, [12, 1])
    np.testing.assert_array_equal(meta.logits_indices, [2, 3])
    np.testing.assert_array_equal(owner, [0, 1])


def test_build_metadata_rejects_short_block_table():
    with pytest.raises(ValueError, match="block table"):
        build_metadata([SeqChunk([1, 2, 3], 7, [1])], 8)


@pytest.mark.parametrize("kv_format, tol", [("int8", 0.05), ("fp8", 0.3)])
def test_quantized_kv_cache_close_to_float(kv_format, tol):
    """int8 / fp8 KV with per-(token, head) scales: stored quantized, logits near the float ones."""
    cfg = ji.preset("tiny-llama")
    params = random_params(cfg, seed=1)
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, 40).tolist()
    meta, _ = build_metadata([SeqChunk(toks, 0, [1, 2, 3], "all")], 16)
    meta = jax.tree.map(jnp.asarray, meta)
    ref, _ = ji.forward(params, cfg, meta, ji.init_cache(cfg, 4, 16), backend="reference")
    cache = ji.init_cache(cfg, 4, 16, kv_format=kv_format)
    got, cache = ji.forward(params, cfg, meta, cache, backend="reference")
    assert cache.k.dtype == (jnp.int8 if kv_format == "int8" else jnp.float8_e4m3fn)
    assert cache.k_scale is not None and cache.k_scale.shape == cache.k.shape[:-1]
    err = float(jnp.max(jnp.abs(got[:40] - ref[:40])))
    assert 0 < err < tol  # quantization changes the logits, but only a little
    # The stored values dequantize to the float keys within the format's resolution.
    k_float = ji.forward(params, cfg, meta, ji.init_cache(cfg, 4, 16), backend="reference")[1].k
    deq = cache.k.astype(jnp.float32) * cache.k_scale[..., None]
    rel = float(jnp.max(jnp.abs(deq[:, 1:4] - k_float[:, 1:4])) / jnp.max(jnp.abs(k_float)))
    assert rel < (0.01 if kv_format == "int8" else 0.07)


@pytest.mark.parametrize("form", ["stacked", "unrolled"])
def test_return_hidden_layers_are_those_layers_outputs(form):
    """`return_hidden=(i, j, ...)` returns the outputs of those layers, concatenated: layer i's
    is the last hidden state of the model cut after layer i, in the dense and the paged forward
    alike; `return_hidden=True` is the last layer's, as before."""
    cfg = ji.preset("tiny-llama").replace(num_layers=4)
    params = random_params(cfg, seed=4)
    fparams = inference_layout(params) if form == "unrolled" else params
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 13)))
    layers = (0, 2, 3)

    def cut(n):  # the model's first n layers
        return cfg.replace(num_layers=n), dict(
            params, layers=jax.tree.map(lambda a: a[:n], params["layers"])
        )

    want = []
    for i in layers:
        c, p = cut(i + 1)
        want.append(ji.forward_dense(p, c, tokens, return_hidden=True)[1])
    want = jnp.concatenate(want, axis=-1)  # [B, S, 3E]
    logits, got = ji.forward_dense(fparams, cfg, tokens, return_hidden=layers)
    assert got.shape == (2, 13, 3 * cfg.hidden_size)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    plain, last = ji.forward_dense(fparams, cfg, tokens, return_hidden=True)
    np.testing.assert_array_equal(logits, plain)  # the taps change nothing else
    np.testing.assert_array_equal(got[..., -cfg.hidden_size :], last)
    # The paged forward over one prefill chunk of each sequence: the same rows.
    chunks = [SeqChunk(tokens[b].tolist(), 0, np.asarray([1 + 2 * b, 2 + 2 * b]), "all")
              for b in range(2)]  # fmt: skip
    meta, _ = build_metadata(chunks, BLOCK)
    cache = ji.init_cache(cfg, 5, BLOCK)
    _, _, paged = ji.forward(fparams, cfg, jax.tree.map(jnp.asarray, meta), cache,
                             backend="reference", return_hidden=layers)  # fmt: skip
    np.testing.assert_allclose(paged[: 2 * 13].reshape(2, 13, -1), want, atol=1e-5, rtol=0)
    for bad in [(4,), (-1,), (), (True,)]:
        with pytest.raises(ValueError, match=r"return_hidden=.*layer indices in \[0, 4\)"):
            ji.forward_dense(params, cfg, tokens, return_hidden=bad)
