"""Test fixtures of the kernels, shared by the tests and `experiments/kernel_bench.py`.

`ragged_attention_batch` builds a NaN-poisoned ragged batch for the paged attention op,
`stack_layers` puts its pages into one layer of a poisoned stacked cache, and `relative_error`
is the error measure every comparison uses. `INTERPRET` is the one switch the kernel tests pass
as `interpret=`: the Pallas interpreter on a CPU, the compiled kernel when a GPU is present.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

INTERPRET = jax.default_backend() != "gpu"  # interpret on CPU; compile on a GPU


def ragged_attention_batch(block_size, heads, head_dim, kv_dtype, q_dtype="float32", seed=0):
    """A NaN-poisoned ragged batch of paged attention; returns (args, kwargs) of the op.

    Decode (q_len 1), verification-sized (5) and prefill-chunk (17) queries over contexts of 1,
    S-1, S, S+1, 17 and a long context, a padded sequence (q_len 0, seq_len 0) in the middle and
    three padding rows at the end of q. Tables are random permutations whose unused entries are
    out of range; every page slot outside a live context and every padding row of q is NaN (int8
    pages hold junk instead and their scales are NaN).
    """
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
        kw = _attention_scales(k_scale, v_scale, live)
    elif kv_dtype == "float8_e4m3fn":
        k = np.where(live4, rng.standard_normal(shape) * 8, np.nan)
        v = np.where(live4, rng.standard_normal(shape) * 8, np.nan)
        kw = _attention_scales(
            rng.uniform(0.1, 0.2, shape[:3]), rng.uniform(0.1, 0.2, shape[:3]), live
        )
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


def _attention_scales(k_scale, v_scale, live):
    live3 = np.broadcast_to(live[:, None, :], k_scale.shape)
    return {
        "k_scale": jnp.asarray(np.where(live3, k_scale, np.nan), jnp.float32),
        "v_scale": jnp.asarray(np.where(live3, v_scale, np.nan), jnp.float32),
    }


def relative_error(y, ref) -> float:
    """max |y - ref| / max(1, max |ref|), in float64."""
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    return float(np.abs(y - ref).max() / max(1.0, np.abs(ref).max()))


def stack_layers(args, kw, layer, num_layers=3):
    """The batch's pages as layer `layer` of `num_layers`; every other layer is poison.

    Other layers hold NaN (float pages) or junk with NaN scales (int8), so reading any page of a
    wrong layer makes the output non-finite.
    """
    q, k, v, *meta = args

    def stack(x, fill):  # [num_blocks, ...] -> [L, num_blocks, ...]
        poison = jnp.full_like(x, fill)
        return jnp.stack([x if i == layer else poison for i in range(num_layers)])

    junk = 127 if k.dtype == jnp.int8 else jnp.nan
    stacked_kw = {name: stack(scale, jnp.nan) for name, scale in kw.items()}
    return [q, stack(k, junk), stack(v, junk), *meta], stacked_kw
