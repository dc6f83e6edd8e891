"""The allocator's types and its state as a whole: snapshots, invariant checks, save and restore.

`BlockAllocator` (allocator.py) owns the bookkeeping; these functions read and rewrite all of it
at once, for tests (`snapshot`, `check_invariants`) and for the engine's failed-step undo
(`save_state` before a step, `restore_state` if it fails). They are the allocator's methods of
the same names, kept beside it so allocator.py holds the allocation logic alone.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable, Hashable

NULL_BLOCK = 0  # reserved for padding; never allocated (re-exported by allocator.py)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


BlockHashFn = Callable[[Hashable | None, tuple[int, ...]], Hashable]


def default_block_hash(parent_hash: Hashable | None, token_ids: tuple[int, ...]) -> Hashable:
    """Hash of a full block given its parent's hash (None for the first block) and its tokens."""
    return hash((parent_hash, token_ids))


class NoFreeBlocksError(RuntimeError):
    """Raised when an operation needs more blocks than the pool can hand out; state is unchanged."""

    def __init__(self, needed: int, available: int):
        super().__init__(f"need {needed} free KV blocks but only {available} can be handed out")
        self.needed = needed
        self.available = available


@dataclasses.dataclass(frozen=True)
class CachedBlock:
    """A block registered in the prefix cache."""

    block_hash: Hashable  # key in the hash -> block index
    parent: int  # physical id of the previous block in the chain; NULL_BLOCK for the first
    token_ids: tuple[int, ...]  # [S] the tokens whose K/V the block holds


@dataclasses.dataclass(frozen=True)
class KVUsage:
    """A snapshot of pool occupancy, for metrics."""

    num_total_blocks: int  # usable blocks (the null block excluded)
    num_used_blocks: int  # refcount > 0
    num_cached_blocks: int  # refcount 0, findable by the prefix cache
    num_free_blocks: int  # refcount 0, holding nothing
    num_filled_slots: int  # slots of used blocks that hold a token of some sequence
    block_size: int  # S


@dataclasses.dataclass(frozen=True)
class AllocatorState:
    """What `save_state` keeps (see there)."""

    refcount: list[int]
    free: collections.deque
    evictable: collections.OrderedDict
    tables: dict
    num_slots: dict
    tokens: dict  # seq -> (its token list or None, its length then)
    chain: dict  # seq -> (its hash list, its length then)
    broken: set
    hash_to_block: dict
    cached: dict
    children: dict
    counters: tuple[int, int, int, int]


def snapshot(alloc) -> dict:
    """A deep copy of every piece of state, for comparing before and after an operation."""
    return copy.deepcopy(
        {
            "refcount": list(alloc._refcount),
            "free": list(alloc._free),
            "evictable": list(alloc._evictable),
            "tables": alloc._tables,
            "num_slots": alloc._num_slots,
            "tokens": alloc._tokens,
            "chain": alloc._chain,
            "broken": sorted(alloc._broken),
            "hash_to_block": alloc._hash_to_block,
            "cached": alloc._cached,
            "children": alloc._children,
            "counters": (
                alloc.prefix_cache_queries,
                alloc.prefix_cache_hits,
                alloc.num_evictions,
                alloc.num_cow_copies,
            ),
        }
    )


def check_invariants(alloc) -> None:
    """Raises AssertionError naming the first broken invariant of the bookkeeping.

    Refcounts equal the tables holding each block; used, cached-evictable and free blocks
    partition the usable blocks; the null block is never held; every table covers exactly
    its slots; the prefix index, the registered blocks and their parent links agree, and
    every registered block's parent is registered (or the null block).
    """
    usable = set(range(1, alloc.num_blocks))
    holders = collections.Counter(b for t in alloc._tables.values() for b in t)
    assert NULL_BLOCK not in holders, "the null block is in a block table"
    assert set(holders) <= usable, f"unknown blocks in tables: {set(holders) - usable}"
    for b in range(alloc.num_blocks):
        assert alloc._refcount[b] == holders[b], (
            f"block {b}: refcount {alloc._refcount[b]} but {holders[b]} tables hold it"
        )
    free, evictable = list(alloc._free), list(alloc._evictable)
    assert len(set(free)) == len(free), "a block is twice in the free list"
    assert not set(free) & set(evictable), "a block is both free and evictable"
    assert not (set(free) | set(evictable)) & set(holders), "a held block is free/evictable"
    assert set(free) | set(evictable) | set(holders) == usable, "a block is lost"
    assert all(b in alloc._cached for b in evictable), "an evictable block is not cached"
    assert not any(b in alloc._cached for b in free), "a free block is still cached"
    for sid, table in alloc._tables.items():
        n = alloc._num_slots[sid]
        assert len(table) == cdiv(n, alloc.block_size), f"seq {sid}: table != its slots"
        tokens = alloc._tokens[sid]
        assert tokens is None or len(tokens) == n, f"seq {sid}: tokens != its slots"
        assert len(alloc._chain[sid]) <= n // alloc.block_size, f"seq {sid}: chain too long"
    assert set(alloc._hash_to_block.values()) == set(alloc._cached), "prefix index mismatch"
    for b, entry in alloc._cached.items():
        assert alloc._hash_to_block[entry.block_hash] == b, f"block {b}: index mismatch"
        assert entry.parent == NULL_BLOCK or entry.parent in alloc._cached, (
            f"registered block {b} has an unregistered parent {entry.parent}"
        )
        assert b in alloc._children.get(entry.parent, ()), f"block {b}: not its parent's child"
    for parent, kids in alloc._children.items():
        assert kids, f"block {parent}: empty children set"
        assert all(alloc._cached[k].parent == parent for k in kids), f"block {parent}: kids"


def save_state(alloc) -> AllocatorState:
    """The state now, for `restore_state`; O(blocks + sequences), no token lists copied.

    Token and hash lists only grow between a save and a restore (the scheduler's steps),
    so the saved state keeps each list with its length and truncates it on restore.
    """
    return AllocatorState(
        refcount=list(alloc._refcount),
        free=collections.deque(alloc._free),
        evictable=collections.OrderedDict(alloc._evictable),
        tables={s: list(t) for s, t in alloc._tables.items()},
        num_slots=dict(alloc._num_slots),
        tokens={s: (t, None if t is None else len(t)) for s, t in alloc._tokens.items()},
        chain={s: (c, len(c)) for s, c in alloc._chain.items()},
        broken=set(alloc._broken),
        hash_to_block=dict(alloc._hash_to_block),
        cached=dict(alloc._cached),
        children={b: set(k) for b, k in alloc._children.items()},
        counters=(
            alloc.prefix_cache_queries,
            alloc.prefix_cache_hits,
            alloc.num_evictions,
            alloc.num_cow_copies,
        ),
    )


def restore_state(alloc, state: AllocatorState) -> None:
    """Returns to a state from `save_state`, provided the token and hash lists of the
    sequences then alive were only appended to since (true of any scheduler steps)."""
    alloc._refcount = list(state.refcount)
    alloc._free = collections.deque(state.free)
    alloc._evictable = collections.OrderedDict(state.evictable)
    alloc._tables = {s: list(t) for s, t in state.tables.items()}
    alloc._num_slots = dict(state.num_slots)
    alloc._tokens = {}
    for s, (tokens, n) in state.tokens.items():
        if tokens is not None:
            del tokens[n:]
        alloc._tokens[s] = tokens
    alloc._chain = {}
    for s, (chain, n) in state.chain.items():
        del chain[n:]
        alloc._chain[s] = chain
    alloc._broken = set(state.broken)
    alloc._hash_to_block = dict(state.hash_to_block)
    alloc._cached = dict(state.cached)
    alloc._children = {b: set(k) for b, k in state.children.items()}
    (
        alloc.prefix_cache_queries,
        alloc.prefix_cache_hits,
        alloc.num_evictions,
        alloc.num_cow_copies,
    ) = state.counters
