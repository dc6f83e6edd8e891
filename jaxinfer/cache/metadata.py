"""Batch metadata: the small pytree the host fills and the jitted step consumes.

A step is a flat, ragged token batch (vLLM v1 / tpu-inference style): sequence b owns token rows
`query_start[b]:query_start[b+1]`; decode is q_len 1, verification q_len γ+1, chunked prefill
q_len = chunk, in any mix. T, B and M are padded to power-of-two buckets so a step compiles a
bounded number of times. Padding rows write into the null block 0 and are never read; padding
sequences have q_len 0 and seq_len 0.

`build_metadata` is host-side numpy and takes block tables from whoever owns them: the simple
contiguous tables of `generate` (`contiguous_block_tables`) or the engine's BlockAllocator.

The device side (`query_batch`, `decode_batch`, `slots_of`) builds the metadata of the decode
loops' uniform steps inside jitted code: every sequence feeds G tokens (1 to decode, γ+1 to
verify). `is_stop`, `finite_rows` and `start_flags` are the stop and first-token rules that
`ji.generate`, the speculative loop and the engine step apply to what they sample.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Padding tokens write into the null block and padded block-table entries point at it.
from jaxinfer.cache.allocator import NULL_BLOCK


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchMetadata:
    """One step's ragged batch. Every field is data (an array); sizes come from shapes."""

    tokens: jax.Array  # [T] int32 token ids (0 on padding rows)
    positions: jax.Array  # [T] int32 absolute position of each token in its sequence
    query_start: jax.Array  # [B+1] int32 row offsets; q_len_b = query_start[b+1] - query_start[b]
    seq_lens: jax.Array  # [B] int32 context length after this step (0 for padding sequences)
    block_tables: jax.Array  # [B, M] int32 physical block of logical block j (0: unused)
    slot_mapping: jax.Array  # [T] int32 flat slot (block * S + offset) each token writes
    logits_indices: jax.Array  # [N] int32 rows whose logits the forward returns


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): the padded size of a dimension."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class SeqChunk:
    """What one sequence computes in a step (host side)."""

    token_ids: Sequence[int]  # tokens whose K/V are written this step
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_table: Sequence[int]  # physical blocks covering positions 0 .. start_pos+len-1
    logits: str = "last"  # "last": logits of the last row only; "all": every row; "none"


def build_metadata(
    chunks: Sequence[SeqChunk],
    block_size: int,
    *,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    max_blocks: int | None = None,
    num_logits: int | None = None,
) -> tuple[BatchMetadata, np.ndarray]:
    """Builds padded batch metadata (numpy arrays) for a list of sequence chunks.

    Args:
      chunks: per sequence, the tokens to compute, their first position and the block table.
      block_size: S, tokens per KV block.
      num_tokens, num_seqs, max_blocks, num_logits: padded sizes T, B, M, N; default: the
        power-of-two bucket of what the chunks need.

    Returns:
      (metadata, logits_owner): `logits_owner [N]` is the index of the chunk each returned
      logits row belongs to (-1 for padding rows).
    """
    if not chunks:
        raise ValueError("build_metadata: no sequences to schedule")
    S = block_size
    q = [len(c.token_ids) for c in chunks]  # [nc] tokens per chunk
    ends = [c.start_pos + qi for c, qi in zip(chunks, q)]  # [nc] context length after the step
    total = sum(q)
    blocks_needed = max(-(-e // S) for e in ends)
    n_logits = sum(qi if c.logits == "all" else int(c.logits == "last") for c, qi in zip(chunks, q))
    t = num_tokens or bucket(total, 8)
    b = num_seqs or bucket(len(chunks))
    m = max_blocks or bucket(blocks_needed)
    n = num_logits or bucket(n_logits)
    if total > t or len(chunks) > b or blocks_needed > m or n_logits > n:
        raise ValueError(
            f"build_metadata: batch needs T={total}, B={len(chunks)}, M={blocks_needed}, "
            f"N={n_logits} but was given T={t}, B={b}, M={m}, N={n}"
        )
    # Each array is one np.fromiter over runs collected per chunk (per block for the slots),
    # rather than numpy calls per chunk or a vectorised pass of many numpy calls: the engine
    # calls this every step, right after a CPU device step has evicted the host's caches, where
    # each distinct numpy call costs tens of microseconds.
    query_start = [0, *itertools.accumulate(q)]  # [nc + 1]
    slots: list[range] = []  # per (chunk, block touched): the contiguous slots written there
    table_rows: list[Sequence[int]] = []  # per chunk: its table cut to M, then padding to M
    logits_rows: list[Sequence[int]] = []  # per chunk: its token rows whose logits are returned
    owner: list[Sequence[int]] = []  # per chunk: its index, once per returned row
    for i, c in enumerate(chunks):
        start, end, row = c.start_pos, ends[i], query_start[i]
        if q[i] == 0:
            raise ValueError(f"build_metadata: sequence {i} has no tokens to compute")
        if len(c.block_table) * S < end:
            raise ValueError(
                f"build_metadata: sequence {i} needs {-(-end // S)} blocks for {end} "
                f"tokens but its block table has {len(c.block_table)}"
            )
        for j in range(start // S, -(-end // S)):  # position p -> slot table[p // S] * S + p % S
            offset = int(c.block_table[j]) * S - j * S
            slots.append(range(offset + max(start, j * S), offset + min(end, (j + 1) * S)))
        table = c.block_table[:m]
        table_rows += [table, [NULL_BLOCK] * (m - len(table))]
        if c.logits == "all":
            logits_rows.append(range(row, row + q[i]))
            owner.append([i] * q[i])
        elif c.logits == "last":
            logits_rows.append([row + q[i] - 1])
            owner.append([i])

    def padded(runs: Iterable[Iterable[int]], size: int, fill: int = 0) -> np.ndarray:
        """The runs concatenated, padded with `fill` to `[size]` int32."""
        values = itertools.chain(itertools.chain.from_iterable(runs), itertools.repeat(fill))
        return np.fromiter(values, np.int32, size)

    meta = BatchMetadata(
        tokens=padded((c.token_ids for c in chunks), t),
        positions=padded((range(c.start_pos, e) for c, e in zip(chunks, ends)), t),
        query_start=padded([query_start], b + 1, total),
        seq_lens=padded([ends], b),
        block_tables=padded(table_rows, b * m, NULL_BLOCK).reshape(b, m),
        slot_mapping=padded(slots, t, NULL_BLOCK * S),
        logits_indices=padded(logits_rows, n),
    )
    return meta, padded(owner, n, -1)


def contiguous_block_tables(num_seqs: int, blocks_per_seq: int) -> np.ndarray:
    """`[B, M]` tables giving sequence i the blocks 1 + i*M .. (i+1)*M (block 0 is the null block).

    The minimal block manager of `generate`: every sequence owns a fixed, private range. The
    engine's BlockAllocator replaces it with shared, refcounted blocks; both feed build_metadata.
    """
    return 1 + np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(
        num_seqs, blocks_per_seq
    )


# ---------------------------------------------------------------------------------------------
# Device side: uniform decode / verify steps and the stop rules of the decode loops (jittable).
# ---------------------------------------------------------------------------------------------


def slots_of(tables: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
    """Flat cache slot of each `positions [B, ...]` through `tables [B, M]` -> `[B, ...]` int32."""
    rows = jnp.arange(tables.shape[0]).reshape((-1,) + (1,) * (positions.ndim - 1))
    return tables[rows, positions // block_size] * block_size + positions % block_size


def query_batch(
    tokens: jax.Array, start: jax.Array, tables: jax.Array, block_size: int
) -> BatchMetadata:
    """Every sequence feeds `tokens [B, G]` at positions start..start+G-1; logits of every row.

    Decode is G = 1 (`decode_batch`), speculative verification G = γ+1. `start [B]` int32 is the
    position of each sequence's first token; `tables [B, M]` its blocks.
    """
    b, g = tokens.shape
    pos = start[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]  # [B, G]
    return BatchMetadata(
        tokens=tokens.reshape(-1),  # [B·G]
        positions=pos.reshape(-1),  # [B·G]
        query_start=jnp.arange(b + 1, dtype=jnp.int32) * g,  # [B+1]
        seq_lens=start + g,  # [B]
        block_tables=tables,  # [B, M]
        slot_mapping=slots_of(tables, pos, block_size).reshape(-1),  # [B·G]
        logits_indices=jnp.arange(b * g, dtype=jnp.int32),  # [B·G]
    )


def decode_batch(
    tokens: jax.Array, positions: jax.Array, tables: jax.Array, block_size: int
) -> BatchMetadata:
    """One token per sequence: `tokens [B]` at `positions [B]`."""
    return query_batch(tokens[:, None], positions, tables, block_size)


def is_stop(tokens: jax.Array, stops: jax.Array) -> jax.Array:
    """`tokens [B, ...]` against `stops [B, n_stop]` (-1 padded) -> bool `[B, ...]`."""
    s = stops.reshape(stops.shape[:1] + (1,) * (tokens.ndim - 1) + stops.shape[1:])
    return jnp.any(tokens[..., None] == s, axis=-1)


def finite_rows(logits: jax.Array) -> jax.Array:
    """`logits [B, ...]` -> `[B]` bool, every value of the row finite.

    A NaN / Inf row would sample an arbitrary token (argmax of NaN is 0) forever: the loops
    stop such a sequence with an error instead.
    """
    return jnp.all(jnp.isfinite(logits.reshape(logits.shape[0], -1)), axis=-1)


def start_flags(
    first: jax.Array, max_tokens: jax.Array, stops: jax.Array, failed: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The progress of each sequence after its first token `first [B]` (sampled by prefill).

    Args:
      first: `[B]` int32 the token at position prompt_len.
      max_tokens: `[B]` int32 (0 for padding rows, which are done at once).
      stops: `[B, n_stop]` int32 stop ids, -1 padded.
      failed: `[B]` bool rows whose prefill logits were not finite (they emit nothing), or None.

    Returns:
      (n_out `[B]` int32 tokens emitted, stopped `[B]` bool the first token is a stop token,
      done `[B]` bool the sequence needs no decode step).
    """
    live = max_tokens > 0
    if failed is not None:
        live = live & ~failed
    n_out = live.astype(jnp.int32)
    stopped = live & is_stop(first, stops)
    return n_out, stopped, ~live | stopped | (n_out >= max_tokens)
