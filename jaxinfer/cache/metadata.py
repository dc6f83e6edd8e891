"""Batch metadata: the small pytree the host fills and the jitted step consumes.

A step is a flat, ragged token batch (vLLM v1 / tpu-inference style): sequence b owns token rows
`query_start[b]:query_start[b+1]`; decode is q_len 1, verification q_len γ+1, chunked prefill
q_len = chunk, in any mix. T, B and M are padded to power-of-two buckets so a step compiles a
bounded number of times. Padding rows write into the null block 0 and are never read; padding
sequences have q_len 0 and seq_len 0.

`build_metadata` is host-side numpy and takes block tables from whoever owns them: the simple
contiguous tables of `generate` (`contiguous_block_tables`) or the engine's BlockAllocator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

NULL_BLOCK = 0  # reserved: padding tokens write here, padded block-table entries point here


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
    total = sum(len(c.token_ids) for c in chunks)
    blocks_needed = max(-(-(c.start_pos + len(c.token_ids)) // block_size) for c in chunks)
    n_logits = sum(
        len(c.token_ids) if c.logits == "all" else int(c.logits == "last") for c in chunks
    )
    t = num_tokens or bucket(total, 8)
    b = num_seqs or bucket(len(chunks))
    m = max_blocks or bucket(blocks_needed)
    n = num_logits or bucket(n_logits)
    if total > t or len(chunks) > b or blocks_needed > m or n_logits > n:
        raise ValueError(
            f"build_metadata: batch needs T={total}, B={len(chunks)}, M={blocks_needed}, "
            f"N={n_logits} but was given T={t}, B={b}, M={m}, N={n}"
        )
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slots = np.full(t, NULL_BLOCK * block_size, np.int32)
    query_start = np.zeros(b + 1, np.int32)
    seq_lens = np.zeros(b, np.int32)
    tables = np.full((b, m), NULL_BLOCK, np.int32)
    logits_indices = np.zeros(n, np.int32)
    owner = np.full(n, -1, np.int32)
    row, li = 0, 0
    for i, c in enumerate(chunks):
        q = len(c.token_ids)
        if q == 0:
            raise ValueError(f"build_metadata: sequence {i} has no tokens to compute")
        end = c.start_pos + q
        if len(c.block_table) * block_size < end:
            raise ValueError(
                f"build_metadata: sequence {i} needs {-(-end // block_size)} blocks for {end} "
                f"tokens but its block table has {len(c.block_table)}"
            )
        pos = np.arange(c.start_pos, end, dtype=np.int32)
        table = np.asarray(c.block_table, np.int32)
        tokens[row : row + q] = c.token_ids
        positions[row : row + q] = pos
        slots[row : row + q] = table[pos // block_size] * block_size + pos % block_size
        tables[i, : min(len(table), m)] = table[:m]
        seq_lens[i] = end
        if c.logits == "all":
            logits_indices[li : li + q] = np.arange(row, row + q)
            owner[li : li + q] = i
            li += q
        elif c.logits == "last":
            logits_indices[li] = row + q - 1
            owner[li] = i
            li += 1
        row += q
        query_start[i + 1] = row
    query_start[len(chunks) + 1 :] = row
    meta = BatchMetadata(tokens, positions, query_start, seq_lens, tables, slots, logits_indices)
    return meta, owner


def contiguous_block_tables(num_seqs: int, blocks_per_seq: int) -> np.ndarray:
    """`[B, M]` tables giving sequence i the blocks 1 + i*M .. (i+1)*M (block 0 is the null block).

    The minimal block manager of `generate`: every sequence owns a fixed, private range. The
    engine's BlockAllocator replaces it with shared, refcounted blocks; both feed build_metadata.
    """
    return 1 + np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(
        num_seqs, blocks_per_seq
    )
