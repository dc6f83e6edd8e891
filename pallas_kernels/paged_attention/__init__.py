"""Ragged paged attention: one op for decode, verification and chunked prefill, in any mix.

Inputs (one layer):
  q             [T, H, D]               flat ragged batch of queries
  k/v_pages     [num_blocks, K, S, D]   paged KV cache (K kv heads, S tokens per block)
  query_start   [B+1] int32             sequence b owns query rows query_start[b]:query_start[b+1]
  seq_lens      [B] int32               context length of sequence b, its own queries included
  block_tables  [B, M] int32            logical block j of sequence b is physical block [b, j]
  k/v_scale     [num_blocks, K, S] f32  optional per-(token, head) scales of int8 / fp8 pages
or, with a scalar `layer`, every layer's pages `[L, num_blocks, K, S, D]` (scales
`[L, num_blocks, K, S]`), of which the kernel reads layer `layer` in place. The model's layer scan
holds the cache stacked; slicing `cache.k[layer]` there and handing the slice to the kernel would
copy the whole layer's cache every layer of every step.

Semantics: query i of sequence b (q_len queries) sits at position p = seq_lens[b] - q_len + i and
attends to key positions 0..p (and >= p - sliding_window + 1 with a window); the key at
position t lives at pages[block_tables[b, t // S], kv_head, t % S]; query head h uses kv head
h // (H / K); softmax in float32 with scale 1/sqrt(D). Slots beyond a sequence's context (and
whole unused blocks) may hold NaN, so every masked value is removed with `where`, never by a
multiplication with zero. Rows of q beyond query_start[B] are padding: their output is 0.

How the kernel is laid out (grid = (query tiles, kv heads, KV partitions)):
  * Query tiles. The host-side wrapper cuts each sequence's queries into tiles of `bq` tokens
    (`tile_schedule`, plain jnp) and hands the kernel, per tile, its sequence and first query
    as ordinary int32 inputs: Triton has no scalar prefetch, so all metadata (tile schedule,
    query_start, seq_lens, block_tables, layer) is read inside the kernel from ordinary refs.
  * GQA. A program owns one kv head and all its G = H / K query heads: the tile is
    bq tokens x G heads = `block_rows` rows, so each page is read once per tile, not G times.
  * Flash-decoding. The context is split into partitions of whole `block_kv` steps; each
    program runs an online softmax over its partition and writes its output (normalized by its
    own softmax sum) and log-sum-exp; `_combine_partitions` merges the partitions. At batch 1
    decode this is what gives the GPU enough programs.

Four layers: `_paged_attention_kernel` (on refs), `_paged_attention_pallas_call`, the jitted
`ragged_paged_attention` (validates inputs), and `ragged_paged_attention_reference` (pure jnp,
the kernel's test oracle). Written for the Pallas Triton backend: power-of-two loads, dots of at
least 16 x 16 x 16, masked `plgpu.load` / `plgpu.store`; on CPU it runs with `interpret=True`.
"""

from pallas_kernels.paged_attention.blocks import (
    ATTENTION_BLOCK_TABLE,
    AttentionBlockSizes,
    default_attention_block_sizes,
    tile_schedule,
)
from pallas_kernels.paged_attention.reference import ragged_paged_attention_reference

_KERNEL_NAMES = ("ragged_paged_attention",)


def __getattr__(name):
    # The kernel module imports Pallas: it loads when one of its names is first asked for, so
    # importing the reference or the block table stays Pallas-free.
    if name in _KERNEL_NAMES:
        from pallas_kernels.paged_attention import kernel

        return getattr(kernel, name)
    raise AttributeError(f"module 'pallas_kernels.paged_attention' has no attribute {name!r}")


__all__ = [
    "ATTENTION_BLOCK_TABLE",
    "AttentionBlockSizes",
    "default_attention_block_sizes",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "tile_schedule",
]
