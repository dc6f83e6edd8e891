"""Host-side page manager for the paged KV cache: free list, refcounts, prefix cache, copy-on-write.

The device holds `num_blocks` KV blocks of `block_size` (S) token slots; this class decides which
physical block backs each logical block of each sequence and never touches device arrays (the
JetStream `kv_cache.py` / `batch_scheduler.py` split). Token t of a sequence lives in slot
`block_table[t // S] * S + t % S`. Block 0 is the null block that padding writes into: it is never
handed out.

A usable block is in exactly one of three states:

- used: referenced by at least one block table (refcount > 0);
- cached: refcount 0 but registered in the prefix cache, so a later sequence with the same prefix
  can reuse its K/V; kept in LRU order and evicted only when a block is needed and no free block
  is left;
- free: refcount 0 and holding nothing anyone can find.

Prefix caching keys each FULL block by `hash_fn(parent_hash, token_ids)`. The hash is only an
index: a hit is accepted only if the stored block's tokens and its parent block (the physical block
before it in the chain) both match, so a hash collision can never hand out the wrong K/V. Blocks
are registered only once the caller reports their tokens as computed (`mark_computed`), and only
along an unbroken chain of registered blocks, so every registered block's parent is registered too;
evicting a block unregisters its descendants, which are unreachable from then on.

Every mutating method is all-or-nothing: on `NoFreeBlocksError` the state is unchanged.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

import numpy as np

from jaxinfer.cache import allocator_state
from jaxinfer.cache.allocator_state import (  # noqa: F401  (the allocator's types, re-exported)
    NULL_BLOCK,
    BlockHashFn,
    CachedBlock,
    KVUsage,
    NoFreeBlocksError,
    cdiv,
    default_block_hash,
)
from jaxinfer.checks import as_int


class BlockAllocator:
    """Free list, refcounts and block tables of the paged KV cache, with prefix caching and CoW.

    Args:
      num_blocks: blocks in the device cache, including the null block 0 (so `num_blocks - 1`
        are usable).
      block_size: S, token slots per block.
      enable_prefix_caching: reuse computed full blocks across sequences with equal prefixes.
      hash_fn: `(parent_hash, token_ids) -> hashable`; injectable so tests can force collisions.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: BlockHashFn | None = None,
    ):
        if as_int(num_blocks) is None or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks!r}"
            )
        if as_int(block_size) is None or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.num_blocks = as_int(num_blocks)
        self.block_size = as_int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._hash_fn = default_block_hash if hash_fn is None else hash_fn

        # [num_blocks] tables holding each block; a list, since the per-step path reads and
        # writes single entries (numpy scalar indexing costs more than list indexing).
        self._refcount = [0] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(1, num_blocks))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._tables: dict[int, list[int]] = {}  # seq -> [cdiv(num_slots, S)] physical ids
        self._num_slots: dict[int, int] = {}  # seq -> token slots reserved
        self._tokens: dict[int, list[int] | None] = {}  # seq -> token ids; None: count only
        self._chain: dict[int, list[Hashable]] = {}  # seq -> hashes of its registered prefix
        self._broken: set[int] = set()  # seqs whose chain stopped (duplicate or collision)
        self._hash_to_block: dict[Hashable, int] = {}
        self._cached: dict[int, CachedBlock] = {}  # registered blocks
        self._children: dict[int, set[int]] = {}  # registered block -> registered children

        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache
        self.num_evictions = 0  # cached blocks handed out for new contents
        self.num_cow_copies = 0  # copy-on-write block copies requested

    # ----------------------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus cached-evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the cache over prompt tokens looked up (0 before any lookup)."""
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def has_seq(self, seq_id: int) -> bool:
        """Whether the sequence holds a block table."""
        return seq_id in self._tables

    def seq_ids(self) -> list[int]:
        return list(self._tables)

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table: `[cdiv(num_tokens, S)]` physical block ids."""
        return list(self._table(seq_id))

    def num_tokens(self, seq_id: int) -> int:
        """Token slots reserved for the sequence."""
        self._table(seq_id)
        return self._num_slots[seq_id]

    def refcount(self, block_id: int) -> int:
        """Number of block tables holding the block."""
        return int(self._refcount[block_id])

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is registered in the prefix cache (used or evictable)."""
        return block_id in self._cached

    def free_block_ids(self) -> list[int]:
        """Truly free blocks, in the order they will be handed out."""
        return list(self._free)

    def evictable_block_ids(self) -> list[int]:
        """Cached blocks with refcount 0, least recently used first (evicted first)."""
        return list(self._evictable)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding a prefix of `token_ids`; read-only, counts nothing.

        At most `(len(token_ids) - 1) // S` blocks match: the last token is always left to compute,
        because the step needs its logits.
        """
        if not self.enable_prefix_caching or len(token_ids) == 0:
            return []
        return self._walk_prefix(token_ids, (len(token_ids) - 1) // self.block_size)[0]

    def can_allocate(self, tokens: Sequence[int] | int) -> bool:
        """Whether `allocate` of these tokens (ids, or a count) would succeed now."""
        needed, available, _, _ = self._plan_allocate(*self._normalize(tokens))
        return needed <= available

    def usage(self) -> KVUsage:
        """Pool occupancy now; a slot of a block shared by several tables counts once.

        A block's filled slots are the most any table holding it fills. Every block but a table's
        last is full (a table has exactly `cdiv(num_slots, S)` blocks), so this walks the last
        blocks only: O(sequences), not O(blocks), since the engine calls it every step.
        """
        S = self.block_size
        partial: dict[int, list[int]] = {}  # block -> fill in each table it ends partially
        for seq_id, n in self._num_slots.items():
            if n % S:
                partial.setdefault(self._tables[seq_id][-1], []).append(n % S)
        # A partial block also held as a full one (by a table where it is not last, or is last
        # and full) counts as full.
        empty = sum(S - max(f) for b, f in partial.items() if len(f) == self._refcount[b])
        return KVUsage(
            num_total_blocks=self.num_blocks - 1,
            num_used_blocks=self.num_used_blocks,
            num_cached_blocks=len(self._evictable),
            num_free_blocks=len(self._free),
            num_filled_slots=self.num_used_blocks * S - empty,
            block_size=S,
        )

    def snapshot(self) -> dict:
        """A deep copy of every piece of state, for comparing before and after an operation."""
        return allocator_state.snapshot(self)

    def check_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant (`allocator_state`)."""
        allocator_state.check_invariants(self)

    def save_state(self) -> allocator_state.AllocatorState:
        """The state now, for `restore_state`; O(blocks + sequences), no token lists copied."""
        return allocator_state.save_state(self)

    def restore_state(self, state: allocator_state.AllocatorState) -> None:
        """Returns to a state from `save_state` (see `allocator_state.restore_state`)."""
        allocator_state.restore_state(self, state)

    # ---------------------------------------------------------------------------- mutations

    def invalidate(self, block_ids: Sequence[int]) -> None:
        """Forgets the prefix-cache entries of blocks whose device contents were lost.

        Each block must be held by no table (refcount 0): a held block's K/V are its holders'
        business. Registered blocks and their registered descendants become free.
        """
        for b in block_ids:
            if self._refcount[b]:
                raise ValueError(f"block {b} is held by {self._refcount[b]} tables")
        for b in block_ids:
            if b in self._cached:  # not already unregistered as a descendant
                del self._evictable[b]
                self._uncache(b)
                self._free.append(b)

    def allocate(self, seq_id: int, tokens: Sequence[int] | int) -> int:
        """Creates the block table of a new sequence, reusing cached prefix blocks.

        Args:
          seq_id: a sequence id not already allocated.
          tokens: the token ids whose slots to reserve, or just their count (no prefix caching
            for such a sequence, now or later).

        Returns:
          The number of leading tokens whose K/V are already in the cache (a multiple of S, at
          most `len(tokens) - 1`); the caller computes only the rest.

        Raises:
          NoFreeBlocksError: not enough blocks; nothing changed.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        n, token_ids = self._normalize(tokens)
        needed, available, matched, hashes = self._plan_allocate(n, token_ids)
        if needed > available:
            raise NoFreeBlocksError(needed, available)
        for b in matched:
            if self._refcount[b] == 0:
                del self._evictable[b]
            self._refcount[b] += 1
        table = matched + [self._take_block() for _ in range(needed)]
        self._tables[seq_id] = table
        self._num_slots[seq_id] = n
        self._tokens[seq_id] = None if token_ids is None else [int(t) for t in token_ids]
        self._chain[seq_id] = hashes
        if self.enable_prefix_caching and token_ids is not None:
            self.prefix_cache_queries += n
            self.prefix_cache_hits += len(matched) * self.block_size
        return len(matched) * self.block_size

    def append_slots(self, seq_id: int, tokens: Sequence[int] | int) -> list[tuple[int, int]]:
        """Reserves slots for tokens appended to a sequence.

        If the last block is partially filled and shared (refcount > 1, after `fork`), the
        sequence gets a private copy first: a new block, a `(src, dst)` copy the device must apply
        before writing, and one reference less on src. A full last block is never copied: the new
        tokens go to fresh blocks.

        Args:
          seq_id: an allocated sequence.
          tokens: the appended token ids (a count only for sequences allocated by count).

        Returns:
          The `(src, dst)` whole-block copies to apply on the device, in order (zero or one).

        Raises:
          NoFreeBlocksError: not enough blocks; nothing changed.
        """
        table = self._table(seq_id)
        k, token_ids = self._normalize(tokens)
        if token_ids is None and self._tokens[seq_id] is not None:
            raise ValueError(
                f"sequence {seq_id!r} tracks token ids; append_slots needs ids, got a count {k}"
            )
        if k == 0:
            return []
        length = self._num_slots[seq_id]
        # The block of slot `length`; lookahead blocks (`reserve_lookahead`) may follow it.
        last = length // self.block_size
        cow = length % self.block_size != 0 and self._refcount[table[last]] > 1
        grow = max(cdiv(length + k, self.block_size) - len(table), 0)
        needed = grow + int(cow)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(needed, self.num_free_blocks)
        copies = []
        if cow:
            src, dst = table[last], self._take_block()
            self._refcount[src] -= 1  # still >= 1: other tables hold it
            table[last] = dst
            copies.append((src, dst))
            self.num_cow_copies += 1
        table.extend(self._take_block() for _ in range(grow))
        self._num_slots[seq_id] = length + k
        if self._tokens[seq_id] is not None:
            self._tokens[seq_id].extend(int(t) for t in token_ids)
        return copies

    def lookahead_capacity(self, seq_id: int) -> int:
        """Slots past the sequence's reserved ones that `reserve_lookahead` could give it now."""
        table = self._table(seq_id)
        return (len(table) + self.num_free_blocks) * self.block_size - self._num_slots[seq_id]

    def reserve_lookahead(self, seq_id: int, k: int) -> None:
        """Gives the sequence blocks for `k` slots past its reserved ones without reserving them.

        Speculative decoding writes γ draft positions whose tokens are unknown until verified:
        the slots exist in the block table (the device may write them) but hold no token ids
        and never reach the prefix cache. `append_slots` of the accepted tokens fills them;
        `trim_lookahead` returns the rest. The last partial block must be private (it is after
        the step's `append_slots`: only a fork shares a partial block, and it copies on append).

        Raises:
          NoFreeBlocksError: not enough blocks; nothing changed.
        """
        table = self._table(seq_id)
        length = self._num_slots[seq_id]
        if length % self.block_size:
            assert self._refcount[table[length // self.block_size]] == 1, "shared partial block"
        grow = cdiv(length + k, self.block_size) - len(table)
        if grow > self.num_free_blocks:
            raise NoFreeBlocksError(grow, self.num_free_blocks)
        table.extend(self._take_block() for _ in range(max(grow, 0)))

    def trim_lookahead(self, seq_id: int) -> None:
        """Frees the blocks past the sequence's reserved slots (see `reserve_lookahead`)."""
        table = self._table(seq_id)
        keep = cdiv(self._num_slots[seq_id], self.block_size)
        while len(table) > keep:
            b = table.pop()  # a lookahead block: private, never registered
            self._refcount[b] -= 1
            self._free.append(b)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Makes `child_id` share every block of `parent_id` (one more reference on each)."""
        table = self._table(parent_id)
        if child_id in self._tables:
            raise ValueError(f"fork target {child_id!r} is already allocated")
        for b in table:
            self._refcount[b] += 1
        self._tables[child_id] = list(table)
        self._num_slots[child_id] = self._num_slots[parent_id]
        tokens = self._tokens[parent_id]
        self._tokens[child_id] = None if tokens is None else list(tokens)
        self._chain[child_id] = list(self._chain[parent_id])
        if parent_id in self._broken:
            self._broken.add(child_id)

    def free(self, seq_id: int) -> None:
        """Drops the sequence; blocks whose refcount reaches 0 become cached or free.

        Blocks are released tail first, so a sequence's deepest cached blocks are evicted first.
        """
        table = self._table(seq_id)
        for b in reversed(table):
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if b in self._cached:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        for d in (self._tables, self._num_slots, self._tokens, self._chain):
            del d[seq_id]
        self._broken.discard(seq_id)

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> None:
        """Registers in the prefix cache every full block among the first computed tokens.

        Call after the device step that wrote their K/V: a block is findable only once its
        contents are real.
        """
        table = self._table(seq_id)
        if not 0 <= num_computed_tokens <= self._num_slots[seq_id]:
            raise ValueError(
                f"num_computed_tokens must be in [0, {self._num_slots[seq_id]}] for sequence "
                f"{seq_id!r}, got {num_computed_tokens}"
            )
        tokens = self._tokens[seq_id]
        if not self.enable_prefix_caching or tokens is None or seq_id in self._broken:
            return
        chain = self._chain[seq_id]
        S = self.block_size
        while len(chain) < num_computed_tokens // S:
            i = len(chain)
            b = table[i]
            if b in self._cached:  # reached through the cache or shared by a fork
                chain.append(self._cached[b].block_hash)
                continue
            block_tokens = tuple(tokens[i * S : (i + 1) * S])
            h = self._hash_fn(chain[-1] if i else None, block_tokens)
            if h in self._hash_to_block:
                # Same contents computed twice, or a collision: keep the existing entry. The chain
                # stops, since every registered block's parent must be registered.
                self._broken.add(seq_id)
                return
            parent = table[i - 1] if i else NULL_BLOCK
            self._cached[b] = CachedBlock(h, parent, block_tokens)
            self._hash_to_block[h] = b
            self._children.setdefault(parent, set()).add(b)
            chain.append(h)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block with refcount 0; returns how many became free."""
        n = 0
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            n += 1 + self._uncache(b)
            self._free.append(b)
        return n

    # ------------------------------------------------------------------------------ helpers

    def _table(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r} (never allocated, or freed)") from None

    @staticmethod
    def _normalize(tokens: Sequence[int] | int) -> tuple[int, Sequence[int] | None]:
        if isinstance(tokens, (int, np.integer)):
            if tokens < 0:
                raise ValueError(f"number of tokens must be >= 0, got {tokens}")
            return int(tokens), None
        return len(tokens), tokens

    def _plan_allocate(
        self, n: int, token_ids: Sequence[int] | None
    ) -> tuple[int, int, list[int], list[Hashable]]:
        """(blocks needed, blocks available, matched prefix blocks, their hashes)."""
        matched, hashes = [], []
        if self.enable_prefix_caching and token_ids is not None and n > 0:
            matched, hashes = self._walk_prefix(token_ids, (n - 1) // self.block_size)
        # A hit on an evictable block takes it out of the evictable pool.
        evictable_hits = sum(1 for b in matched if self._refcount[b] == 0)
        needed = cdiv(n, self.block_size) - len(matched)
        return needed, self.num_free_blocks - evictable_hits, matched, hashes

    def _walk_prefix(
        self, token_ids: Sequence[int], max_blocks: int
    ) -> tuple[list[int], list[Hashable]]:
        S = self.block_size
        blocks: list[int] = []
        hashes: list[Hashable] = []
        parent_hash, parent = None, NULL_BLOCK
        for i in range(max_blocks):
            block_tokens = tuple(int(t) for t in token_ids[i * S : (i + 1) * S])
            h = self._hash_fn(parent_hash, block_tokens)
            b = self._hash_to_block.get(h)
            if b is None:
                break
            entry = self._cached[b]
            if entry.parent != parent or entry.token_ids != block_tokens:
                break  # hash collision: different contents behind the same key
            blocks.append(b)
            hashes.append(h)
            parent_hash, parent = h, b
        return blocks, hashes

    def _take_block(self) -> int:
        """A block for a new owner (refcount 1): a free one, else the evicted LRU cached one."""
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            self._uncache(b)
            self.num_evictions += 1
        self._refcount[b] = 1
        return b

    def _uncache(self, root: int) -> int:
        """Unregisters `root` and its registered descendants; the descendants (refcount 0, since
        a table holding a block holds its parent) move from evictable to free. Returns how many
        descendants moved."""
        moved = 0
        stack = [root]
        while stack:
            b = stack.pop()
            entry = self._cached.pop(b)
            del self._hash_to_block[entry.block_hash]
            siblings = self._children.get(entry.parent)
            if siblings is not None:
                siblings.discard(b)
                if not siblings:
                    del self._children[entry.parent]
            stack.extend(self._children.pop(b, ()))
            if b != root:
                del self._evictable[b]
                self._free.append(b)
                moved += 1
        return moved
