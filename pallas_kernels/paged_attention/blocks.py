"""Block sizes and the static tile plan of the ragged paged-attention kernel (no Pallas).

`AttentionBlockSizes` is the data a caller may tune; `ATTENTION_BLOCK_TABLE` holds the defaults
per class of mean query length; `plan` resolves them against one call's shapes, and
`tile_schedule` (plain jnp) cuts each sequence's queries into the kernel's query tiles. The XLA
attention of `jaxinfer.ops` reuses `tile_schedule`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MIN_DOT = 16  # Triton's dot needs every dimension >= 16

# ----------------------------------------------------------------------------- block sizes


@dataclasses.dataclass(frozen=True)
class AttentionBlockSizes:
    """Tile sizes of the paged-attention kernel (powers of two)."""

    block_rows: int = 16  # query rows per program = tokens x query heads of one kv head; >= 16
    block_kv: int = 64  # keys per inner step; rounded up to a whole number of pages
    num_partitions: int | None = None  # KV partitions per sequence; None: from target_programs
    target_programs: int = 1024  # partitions are added until the grid has about this many
    num_warps: int = 4  # Triton launch parameters, ignored in interpret mode
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_rows", "block_kv"):
            value = getattr(self, name)
            if value < MIN_DOT or value & (value - 1):
                raise ValueError(f"{name}={value}; expected a power of two >= {MIN_DOT}")
        if self.num_partitions is not None and self.num_partitions < 1:
            raise ValueError(f"num_partitions={self.num_partitions}; expected >= 1 or None")


# Defaults keyed on the mean query length ceil(T / B): decode (1), verification / short chunks,
# prefill. Decode is bound by reading pages; prefill by the dots, which want taller query tiles.
ATTENTION_BLOCK_TABLE: tuple[tuple[int, AttentionBlockSizes], ...] = (
    (1, AttentionBlockSizes(block_rows=16, block_kv=64)),
    (32, AttentionBlockSizes(block_rows=32, block_kv=64)),
    (2**62, AttentionBlockSizes(block_rows=64, block_kv=64, num_warps=8)),
)


def default_attention_block_sizes(
    num_tokens: int, num_seqs: int, head_dim: int = 128
) -> AttentionBlockSizes:
    """The table entry for a batch of `num_tokens` query rows over `num_seqs` sequences.

    Args:
      num_tokens: T, rows of q (padding included).
      num_seqs: B, sequences (padding included).
      head_dim: D. The table is sized for D <= 128; above that the key tile shrinks so that
        block_kv x D stays at most 64 x 128 (at D = 256 the 64-key tiles spill registers on
        sm_90: experiments/kernel_compile_check.py).

    Returns:
      The `AttentionBlockSizes` of the smallest mean-query-length class that holds T / B.
    """
    mean_q = -(-num_tokens // max(num_seqs, 1))
    last = ATTENTION_BLOCK_TABLE[-1][1]
    sizes = next((s for max_q, s in ATTENTION_BLOCK_TABLE if mean_q <= max_q), last)
    if head_dim > 128:
        block_kv = max(MIN_DOT, sizes.block_kv * 128 // next_pow2(head_dim))
        sizes = dataclasses.replace(sizes, block_kv=block_kv)
    return sizes


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Static tiling of one call."""

    group_pad: int  # Gp: query heads per kv head, padded to a power of two
    tile_tokens: int  # bq: tokens per query tile; bq * Gp = rows of a tile
    num_tiles: int  # upper bound on the number of query tiles
    block_kv: int  # keys per step (a whole number of pages)
    partition_tokens: int  # keys per partition (a whole number of steps)
    num_partitions: int


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def plan_attention(
    t, b, kv_heads, group, block_size, max_blocks, sizes: AttentionBlockSizes
) -> AttentionPlan:
    group_pad = next_pow2(group)
    tile_tokens = max(1, sizes.block_rows // group_pad)
    # sum_b ceil(q_len_b / bq) <= (T + B (bq - 1)) / bq, and a tile holds at least one query.
    num_tiles = max(1, min(t, (t + b * (tile_tokens - 1)) // tile_tokens))
    block_kv = max(sizes.block_kv, block_size)
    context = max_blocks * block_size  # longest context a block table can address
    steps = -(-context // block_kv)
    parts = sizes.num_partitions
    if parts is None:
        parts = -(-sizes.target_programs // (num_tiles * kv_heads))
    parts = max(1, min(parts, steps))
    steps_per_part = -(-steps // parts)
    parts = -(-steps // steps_per_part)  # no partition without work
    return AttentionPlan(
        group_pad, tile_tokens, num_tiles, block_kv, steps_per_part * block_kv, parts
    )


def tile_schedule(query_start: jax.Array, num_tiles: int, tile_tokens: int):
    """Cuts each sequence's queries into tiles of `tile_tokens`: (seq, first query) per tile.

    Tiles past the last one are empty: they point at the end of the last sequence.
    """
    b = query_start.shape[0] - 1
    q_lens = query_start[1:] - query_start[:-1]  # [B]
    tiles = (q_lens + tile_tokens - 1) // tile_tokens  # [B]
    ends = jnp.cumsum(tiles)  # [B] one past each sequence's last tile
    t = jnp.arange(num_tiles, dtype=jnp.int32)  # [NT]
    seq = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)  # [NT]
    live = seq < b
    seq = jnp.minimum(seq, b - 1)
    q0 = (t - (ends[seq] - tiles[seq])) * tile_tokens  # [NT]
    q0 = jnp.where(live, q0, q_lens[seq]).astype(jnp.int32)
    return seq, q0
