"""The randomness of a speculative cycle, shared by the standalone loop (loop.py) and the engine
(engine/speculation.py): per-request, per-cycle keys and the draft's token choice with its q.

Rejection-mode noise never shares threefry counters with plain sampling; coupled mode drafts with
the target's own Gumbel noise at each position, so accepted drafts are the tokens plain sampling
would have drawn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops.argmax import argmax
from jaxinfer.sampling import SamplingBatch, gumbel_noise, process_logits

# Rejection-mode noise lives in its own stream, fold_in(key(seed), SPEC_STREAM): a datum no
# position reaches (positions are int32), so it never shares threefry counters with the plain
# sampling key fold_in(key(seed), position) that drew the prefill's token.
SPEC_STREAM = 0xFFFFFFFF
ACCEPT_TAG = 1  # fold_in tags under the stream's fold_in(·, cycle start): acceptance noise
DRAFT_TAG = 2  # ... and the draft's sampling noise


def cycle_keys(sb: SamplingBatch, cur: jax.Array, tag: int) -> jax.Array:
    """`[B]` typed keys, unique per request, cycle (its start position `cur`) and use `tag`."""

    def one(seed, c):
        stream = jax.random.fold_in(jax.random.key(seed), SPEC_STREAM)
        return jax.random.fold_in(jax.random.fold_in(stream, c), tag)

    return jax.vmap(one)(sb.seed, cur)


def make_pick(
    sb: SamplingBatch, cur: jax.Array, acceptance: str, sample_index: jax.Array | None = None
):
    """The draft's token choice at draft step j (position cur + 1 + j), and its q.

    `sample_index` `[B]` (the engine's n > 1 forks): a fork i > 0 drafts with its own noise,
    the rejection stream's keys folded with i and, in coupled mode, the target's noise of that
    fork (`gumbel_noise(..., sample_index)`); None or 0 gives sample 0's, the loop's.
    """
    greedy = sb.temperature <= 0  # [B]
    draft_keys = cycle_keys(sb, cur, DRAFT_TAG)  # [B]
    if sample_index is not None:
        folded = jax.vmap(jax.random.fold_in)(draft_keys, sample_index)
        data = jnp.where(
            (sample_index > 0)[:, None],
            jax.random.key_data(folded),
            jax.random.key_data(draft_keys),
        )  # [B, 2] uint32
        draft_keys = jax.random.wrap_key_data(data)

    def pick(logits, j):  # logits [B, V] -> (tokens [B], q [B, V])
        v = logits.shape[-1]

        def greedy_only():
            tok = argmax(logits)
            return tok, jax.nn.one_hot(tok, v, dtype=jnp.float32)

        def mixed():
            x = process_logits(logits, sb)  # [B, V]
            if acceptance == "coupled":  # the target's own noise at that position
                g = gumbel_noise(sb.seed, cur + 1 + j, v, sample_index)
            else:
                g = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, j), (v,)))(
                    draft_keys
                )  # [B, V]
            top = argmax(x)
            tok = jnp.where(greedy, top, argmax(x + g))
            q = jnp.where(
                greedy[:, None], jax.nn.one_hot(top, v, dtype=jnp.float32), jax.nn.softmax(x)
            )
            return tok, q

        # An all-greedy batch needs neither noise nor logits processing.
        return jax.lax.cond(jnp.all(greedy), greedy_only, mixed)

    return pick
