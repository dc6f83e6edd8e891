"""Drafters: what proposes the γ tokens of a speculative cycle.

Two drafters, both pure functions of the committed sequence state:

* **model** (`draft_with_model`): a small model with its own paged KV cache runs γ decode steps
  — a ragged catch-up step, then a `lax.scan` of γ−1 one-token steps. At the start of a cycle the
  draft cache holds positions `0 .. dlen−1` and the last committed token sits at position `cur`;
  `cur − dlen` is 0 after a rejection (the draft has not seen the correction token) or 1 after a
  full accept (it has not seen the last drafted token nor the bonus token), so the first step feeds
  q_len = cur − dlen + 1 ∈ {1, 2} tokens. Rejected positions are never rolled back: the next cycle
  simply writes over them.
* **n-gram** (`ngram_lookup`, prompt lookup): no model. Match the last n committed tokens
  (n = max_n down to 1) against earlier context and propose the tokens that followed the most
  recent match; its q is one-hot.

`prefer_ngram` combines the n-gram with a learned head (`heads/`): per row, the n-gram's
proposal where the suffix recurs, the head's elsewhere (a `Head` with `ngram_first` set, in the
loop and in the engine, which skip the head's drafting when every row takes the n-gram's).

Tokens are chosen by a `pick(logits [B, V], step) -> (tokens [B], q [B, V])` callback that the
loop builds for the acceptance mode (greedy, rejection noise or the coupled Gumbel noise), so the
drafter never needs to know how its proposals will be judged.

Shapes: B sequences, V vocabulary, γ drafted tokens, C = hist capacity per sequence, M blocks per
sequence, S block size.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.cache.metadata import NULL_BLOCK, BatchMetadata, decode_batch, slots_of
from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.config import ModelConfig
from jaxinfer.model.decoder import forward

Pick = Callable[[jax.Array, int | jax.Array], tuple[jax.Array, jax.Array]]


def catch_up_batch(
    hist: jax.Array,  # [B, C] int32 committed tokens (prompt and generated)
    cur: jax.Array,  # [B] int32 position of the last committed token
    dlen: jax.Array,  # [B] int32 positions already in the draft cache; cur - dlen in {0, 1}
    tables: jax.Array,  # [B, M] int32
    block_size: int,
    width: int = 2,
) -> BatchMetadata:
    """The draft's first, ragged step: feed positions dlen..cur, logits of cur.

    q_len = cur − dlen + 1 is at most `width` (static): 2 for the draft model (`cur − dlen` in
    {0, 1}), γ + 1 for the EAGLE head (it re-reads every position committed since its last cycle).
    """
    b = cur.shape[0]
    t = width * b  # static row budget: at most `width` rows per sequence
    q_len = cur - dlen + 1  # [B] in 1..width
    query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_len)]).astype(jnp.int32)
    offs = jnp.arange(width, dtype=jnp.int32)  # [W]
    pos = dlen[:, None] + offs[None, :]  # [B, W]
    valid = offs[None, :] < q_len[:, None]  # [B, W]
    pos = jnp.where(valid, pos, cur[:, None])  # keep gathers in range on unused entries
    rows = jnp.where(valid, query_start[:-1, None] + offs[None, :], t)  # [B, W]; t = dropped
    tok = hist[jnp.arange(b)[:, None], pos]  # [B, W]
    slot = slots_of(tables, pos, block_size)  # [B, W]

    def scatter(values, fill):
        return (
            jnp.full((t,), fill, jnp.int32)
            .at[rows.reshape(-1)]
            .set(values.reshape(-1), mode="drop")
        )

    return BatchMetadata(
        tokens=scatter(tok, 0),  # [T]
        positions=scatter(pos, 0),  # [T]
        query_start=query_start,  # [B+1]
        seq_lens=cur + 1,  # [B]
        block_tables=tables,  # [B, M]
        slot_mapping=scatter(slot, NULL_BLOCK * block_size),  # [T]; padding -> null block
        logits_indices=query_start[1:] - 1,  # [B] the row of position cur
    )


def row_seq(query_start: jax.Array, num_rows: int) -> jax.Array:
    """The sequence of each of `num_rows` rows of a ragged batch (`query_start [B+1]`) -> `[T]`;
    padding rows past `query_start[-1]` get B (out of range: drop them in scatters)."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    return (jnp.searchsorted(query_start, rows, side="right") - 1).astype(jnp.int32)


def draft_with_model(
    dparams: dict,
    dcfg: ModelConfig,
    dcache: PagedKVCache,
    hist: jax.Array,  # [B, C] int32
    cur: jax.Array,  # [B] int32
    dlen: jax.Array,  # [B] int32
    tables: jax.Array,  # [B, M] int32
    pick: Pick,
    *,
    gamma: int,
    block_size: int,
    backend: str,
) -> tuple[PagedKVCache, jax.Array, jax.Array]:
    """γ draft decode steps over the draft's own paged cache.

    Args:
      dparams, dcfg: the draft model.
      dcache: the draft's paged cache, holding positions 0..dlen-1 of each sequence.
      hist: committed tokens; `hist[b, cur[b]]` is the last one.
      cur: position of each sequence's last committed token.
      dlen: tokens of each sequence already in the draft cache (cur - dlen in {0, 1}).
      tables: each sequence's blocks (shared layout with the target cache).
      pick: chooses a token and its draft distribution from logits; `step` j drafts position
        cur + 1 + j.
      gamma: tokens to draft.
      block_size: S.
      backend: attention backend.

    Returns:
      (dcache holding positions 0..cur+γ-1, draft tokens `[B, γ]` int32, q `[B, γ, V]` float32).
    """
    batch = catch_up_batch(hist, cur, dlen, tables, block_size)
    logits, dcache = forward(dparams, dcfg, batch, dcache, backend=backend)  # [B, V]
    tok, q = pick(logits, 0)

    def step(carry, j):
        dcache, tok = carry
        batch = decode_batch(tok, cur + j, tables, block_size)  # d_j sits at position cur + j
        logits, dcache = forward(dparams, dcfg, batch, dcache, backend=backend)
        new, q = pick(logits, j)
        return (dcache, new), (new, q)

    (dcache, _), (toks, qs) = jax.lax.scan(step, (dcache, tok), jnp.arange(1, gamma))
    tokens = jnp.concatenate([tok[:, None], jnp.moveaxis(toks, 0, 1)], axis=1)  # [B, γ]
    q_all = jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)  # [B, γ, V]
    return dcache, tokens, q_all


def ngram_lookup(
    hist: jax.Array,  # [B, C] int32
    cur: jax.Array,  # [B] int32
    *,
    gamma: int,
    max_n: int = 3,
) -> tuple[jax.Array, jax.Array]:
    """Prompt-lookup drafting: γ tokens that followed the latest earlier match of the suffix.

    For n = max_n down to 1, the last n committed tokens `hist[cur-n+1 .. cur]` are matched
    against every earlier window ending at e < cur; the longest n with a match wins, and among
    its matches the most recent. The proposal is `hist[e+1 ..]`; where it would run past `cur`
    it wraps with period cur − e (the matched text repeating itself). With no match at any n the
    last token is proposed γ times.

    Args:
      hist: committed tokens per sequence.
      cur: position of the last committed token.
      gamma: tokens to propose.
      max_n: longest suffix to match.

    Returns:
      (`[B, γ]` int32 proposals, `[B]` int32 length n of the suffix matched, 0 for none).
    """
    b, c = hist.shape
    rows = jnp.arange(b)
    ends = jnp.arange(c, dtype=jnp.int32)[None, :]  # [1, C] candidate match ends e
    best = jnp.full((b,), -1, jnp.int32)
    length = jnp.zeros((b,), jnp.int32)
    for n in range(max_n, 0, -1):
        match = (ends >= n - 1) & (ends < cur[:, None]) & (cur[:, None] >= n - 1)  # [B, C]
        for k in range(n):
            tail = hist[rows, jnp.maximum(cur - k, 0)]  # [B]
            shifted = jnp.roll(hist, k, axis=1)  # shifted[:, e] = hist[:, e - k] for e >= k
            match &= shifted == tail[:, None]
        latest = jnp.max(jnp.where(match, ends, -1), axis=1)  # [B]
        length = jnp.where((best < 0) & (latest >= 0), n, length)
        best = jnp.where(best < 0, latest, best)
    period = jnp.maximum(cur - best, 1)  # [B]
    j = jnp.arange(gamma, dtype=jnp.int32)[None, :]  # [1, γ]
    idx = best[:, None] + 1 + j % period[:, None]  # [B, γ] <= cur
    proposal = hist[rows[:, None], jnp.clip(idx, 0, c - 1)]
    last = hist[rows, cur][:, None]
    return jnp.where(best[:, None] >= 0, proposal, last).astype(jnp.int32), length


def ngram_propose(
    hist: jax.Array,  # [B, C] int32
    cur: jax.Array,  # [B] int32
    *,
    gamma: int,
    max_n: int = 3,
) -> jax.Array:
    """`ngram_lookup`'s `[B, γ]` proposals alone."""
    return ngram_lookup(hist, cur, gamma=gamma, max_n=max_n)[0]


def ngram_rows(
    hist: jax.Array,  # [B, C] int32
    cur: jax.Array,  # [B] int32
    *,
    gamma: int,
    max_n: int,
    min_match: int,
) -> tuple[jax.Array, jax.Array]:
    """The hybrid drafter's choice: (`ngram_lookup`'s proposals `[B, γ]`, `[B]` bool: the rows
    whose last `min_match`+ tokens recur earlier, which take them)."""
    ngram, length = ngram_lookup(hist, cur, gamma=gamma, max_n=max_n)
    return ngram, length >= min_match


def take_ngram(
    tokens: jax.Array,  # [B, γ] int32 a learned drafter's proposals
    q: jax.Array | None,  # [B, γ, V] float32 their draft distributions (None: not needed)
    ngram: jax.Array,  # [B, γ] int32
    use: jax.Array,  # [B] bool
) -> tuple[jax.Array, jax.Array | None]:
    """Rows in `use` take the n-gram's proposal with a one-hot q; the rest keep the drafter's."""
    tokens = jnp.where(use[:, None], ngram, tokens)
    if q is not None:
        one_hot = jax.nn.one_hot(ngram, q.shape[-1], dtype=q.dtype)  # [B, γ, V]
        q = jnp.where(use[:, None, None], one_hot, q)
    return tokens, q


def prefer_ngram(
    tokens: jax.Array,  # [B, γ] int32 a learned drafter's proposals
    q: jax.Array | None,  # [B, γ, V] float32 their draft distributions (None: not needed)
    hist: jax.Array,  # [B, C] int32
    cur: jax.Array,  # [B] int32
    *,
    max_n: int,
    min_match: int,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """The hybrid drafter: rows whose last `min_match`+ tokens recur earlier take the n-gram
    proposal (its q one-hot) instead of the drafter's; the rest keep the drafter's.

    Text that repeats itself (code, lists, a model's own loops) is where prompt lookup is
    accepted whole and a small drafter is not; elsewhere the learned drafter wins (suffix
    decoding's hybrid with a learned speculator, Arctic Inference). Exactness is per row: each
    row's q is the distribution its proposal was drawn from. The loop and the engine call
    `ngram_rows` first and run the learned drafter only when some row needs it.

    Returns:
      (tokens `[B, γ]`, q `[B, γ, V]` or None, `[B]` bool: the rows that took the n-gram's).
    """
    ngram, use = ngram_rows(hist, cur, gamma=tokens.shape[1], max_n=max_n, min_match=min_match)
    tokens, q = take_ngram(tokens, q, ngram, use)
    return tokens, q, use
