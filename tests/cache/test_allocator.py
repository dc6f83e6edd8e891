"""Tests of the host BlockAllocator: invariants over random operation sequences, copy-on-write
against a numpy stand-in for the device cache, prefix caching, hash collisions, LRU eviction."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxinfer.cache.allocator import NULL_BLOCK, BlockAllocator, NoFreeBlocksError


def kv_value(prefix: list[int]) -> int:
    """Stand-in for a token's K/V: like real K/V it depends on the whole prefix up to the token."""
    return hash(tuple(prefix)) & 0x7FFF_FFFF_FFFF


class AllocatorModel:
    """Drives a BlockAllocator the way an engine does, with a numpy array as the device cache.

    Every token computed writes `kv_value(prefix)` into its slot; `check()` verifies the allocator's
    bookkeeping and that every sequence reads back exactly its own K/V through its block table.
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool, hash_fn=None):
        self.alloc = BlockAllocator(num_blocks, block_size, caching, hash_fn=hash_fn)
        self.S = block_size
        self.kv = np.full((num_blocks, block_size), -1, np.int64)  # [num_blocks, S]
        self.tokens: dict[int, list[int]] = {}  # seq -> tokens with reserved slots
        self.computed: dict[int, int] = {}  # seq -> tokens whose K/V are written
        self.next_id = 0
        self.stats = collections.Counter()

    def _guarded(self, op, *args):
        before = self.alloc.snapshot()
        try:
            return op(*args)
        except NoFreeBlocksError as e:
            assert e.needed > e.available
            assert self.alloc.snapshot() == before, "a failed operation changed the state"
            self.stats["failed"] += 1
            return None

    def allocate(self, tokens: list[int]) -> int | None:
        sid = self.next_id
        self.next_id += 1
        expected_hit = len(self.alloc.match_prefix(tokens)) * self.S
        cached = self._guarded(self.alloc.allocate, sid, tokens)
        if cached is None:
            return None
        assert cached == expected_hit and cached % self.S == 0 and cached <= len(tokens) - 1
        self.stats["hit_tokens"] += cached
        self.tokens[sid], self.computed[sid] = list(tokens), cached
        return sid

    def append(self, sid: int, new: list[int]) -> None:
        copies = self._guarded(self.alloc.append_slots, sid, new)
        if copies is None:
            return
        assert len(copies) <= 1
        for src, dst in copies:
            self.kv[dst] = self.kv[src]
            self.stats["cow"] += 1
        self.tokens[sid].extend(new)

    def compute(self, sid: int, k: int) -> None:
        """Writes the K/V of the next k uncomputed tokens and reports them computed."""
        toks, table = self.tokens[sid], self.alloc.block_table(sid)
        start = self.computed[sid]
        for p in range(start, min(start + k, len(toks))):
            b = table[p // self.S]
            assert self.alloc.refcount(b) == 1, f"write into shared block {b}"
            self.kv[b, p % self.S] = kv_value(toks[: p + 1])
        self.computed[sid] = min(start + k, len(toks))
        self.alloc.mark_computed(sid, self.computed[sid])

    def fork(self, sid: int) -> int:
        self.compute(sid, len(self.tokens[sid]))  # an engine forks after the prefill
        child = self.next_id
        self.next_id += 1
        self.alloc.fork(sid, child)
        self.tokens[child], self.computed[child] = list(self.tokens[sid]), self.computed[sid]
        self.stats["fork"] += 1
        return child

    def free(self, sid: int) -> None:
        self.alloc.free(sid)
        del self.tokens[sid], self.computed[sid]

    def lookup(self, tokens: list[int]) -> None:
        before = self.alloc.snapshot()
        blocks = self.alloc.match_prefix(tokens)
        assert self.alloc.snapshot() == before
        for i, b in enumerate(blocks):  # a hit holds exactly this prefix's K/V
            want = [kv_value(tokens[: i * self.S + j + 1]) for j in range(self.S)]
            assert self.kv[b].tolist() == want

    def check(self) -> None:
        a, S = self.alloc, self.S
        usable = set(range(1, a.num_blocks))
        holders = collections.Counter(b for sid in self.tokens for b in a.block_table(sid))
        assert NULL_BLOCK not in holders and set(holders) <= usable
        for b in range(a.num_blocks):
            assert a.refcount(b) == holders[b], f"block {b}: refcount != tables holding it"
        free, evictable = a.free_block_ids(), a.evictable_block_ids()
        assert len(set(free)) == len(free) and len(set(evictable)) == len(evictable)  # no dups
        assert not set(free) & set(evictable) and not (set(free) | set(evictable)) & set(holders)
        assert set(free) | set(evictable) | set(holders) == usable
        assert a.num_free_blocks == len(free) + len(evictable)
        assert a.num_free_blocks + a.num_used_blocks == a.num_blocks - 1
        assert all(a.is_cached(b) for b in evictable) and not any(a.is_cached(b) for b in free)
        for sid, toks in self.tokens.items():
            table = a.block_table(sid)
            assert a.num_tokens(sid) == len(toks) and len(table) == -(-len(toks) // S)
            got = [int(self.kv[table[p // S], p % S]) for p in range(self.computed[sid])]
            assert got == [kv_value(toks[: p + 1]) for p in range(self.computed[sid])], sid
        a.check_invariants()

    def drain(self) -> None:
        for sid in list(self.tokens):
            self.free(sid)
        self.check()
        assert self.alloc.num_free_blocks == self.alloc.num_blocks - 1
        assert self.alloc.num_used_blocks == 0
        self.alloc.reset_prefix_cache()
        assert sorted(self.alloc.free_block_ids()) == list(range(1, self.alloc.num_blocks))


def _collide_mod3(parent, tokens):
    return hash((parent, tokens)) % 3  # frequent collisions; verification must catch them


def _ignore_parent(parent, tokens):
    return hash(tokens)  # equal blocks under different prefixes collide


def _random_tokens(rng, bases) -> list[int]:
    """A prompt that often shares a prefix with one of a few bases, so prefixes hit."""
    prefix = bases[rng.integers(len(bases))][: rng.integers(0, 17)]
    return prefix + rng.integers(0, 3, rng.integers(0 if prefix else 1, 8)).tolist()


def _random_run(seed: int, caching: bool, hash_fn, n_ops: int = 1500) -> AllocatorModel:
    rng = np.random.default_rng(seed)
    m = AllocatorModel(num_blocks=14, block_size=4, caching=caching, hash_fn=hash_fn)
    bases = [rng.integers(0, 3, 16).tolist() for _ in range(3)]
    ops = ["allocate", "append", "compute", "fork", "free", "lookup", "reset"]
    probs = [0.25, 0.25, 0.2, 0.08, 0.15, 0.05, 0.02]
    for _ in range(n_ops):
        op = rng.choice(ops, p=probs)
        live = list(m.tokens)
        sid = live[rng.integers(len(live))] if live else None
        if op == "allocate":
            m.allocate(_random_tokens(rng, bases))
        elif op == "lookup":
            m.lookup(_random_tokens(rng, bases))
        elif op == "reset":
            m.alloc.reset_prefix_cache()
        elif sid is None:
            continue
        elif op == "append":
            m.append(sid, rng.integers(0, 3, rng.integers(1, 4)).tolist())
        elif op == "compute":
            m.compute(sid, int(rng.integers(1, 9)))
        elif op == "fork":
            m.fork(sid)
        elif op == "free":
            m.free(sid)
        m.check()
    return m


@pytest.mark.parametrize(
    "caching,hash_fn",
    [(True, None), (True, _collide_mod3), (True, _ignore_parent), (False, None)],
    ids=["cache", "cache-collide-mod3", "cache-ignore-parent", "no-cache"],
)
def test_random_operations_keep_invariants(caching, hash_fn):
    for seed in range(2):
        m = _random_run(seed, caching, hash_fn)
        # The run exercised what it claims to test.
        assert m.stats["failed"] > 0 and m.stats["cow"] > 0 and m.stats["fork"] > 0
        if caching:
            assert m.stats["hit_tokens"] > 0 and m.alloc.num_evictions > 0
            assert m.alloc.prefix_cache_hits == m.stats["hit_tokens"]
        else:
            assert m.alloc.prefix_cache_queries == 0 and m.alloc.evictable_block_ids() == []
        m.drain()


class AllocatorMachine(RuleBasedStateMachine):
    """The same model under hypothesis, which shrinks a failing operation sequence."""

    def __init__(self):
        super().__init__()
        self.m = AllocatorModel(num_blocks=8, block_size=2, caching=True)

    tokens = st.lists(st.integers(0, 1), min_size=1, max_size=9)

    @rule(tokens=tokens)
    def allocate(self, tokens):
        self.m.allocate(tokens)

    @precondition(lambda self: self.m.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def append(self, data, new):
        self.m.append(data.draw(st.sampled_from(sorted(self.m.tokens))), new)

    @precondition(lambda self: self.m.tokens)
    @rule(data=st.data(), k=st.integers(1, 6))
    def compute(self, data, k):
        self.m.compute(data.draw(st.sampled_from(sorted(self.m.tokens))), k)

    @precondition(lambda self: self.m.tokens)
    @rule(data=st.data())
    def fork(self, data):
        self.m.fork(data.draw(st.sampled_from(sorted(self.m.tokens))))

    @precondition(lambda self: self.m.tokens)
    @rule(data=st.data())
    def free(self, data):
        self.m.free(data.draw(st.sampled_from(sorted(self.m.tokens))))

    @rule(tokens=tokens)
    def lookup(self, tokens):
        self.m.lookup(tokens)

    @invariant()
    def consistent(self):
        self.m.check()

    def teardown(self):
        self.m.drain()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ------------------------------------------------------------------------- copy-on-write


def _device_cache(num_blocks, S, seed=0):
    # [L, num_blocks, K, S, D], the PagedKVCache layout: a block of one layer is one slice.
    return np.random.default_rng(seed).standard_normal((2, num_blocks, 2, S, 3)).astype(np.float32)


def _apply_copies(cache, copies):
    for src, dst in copies:
        cache[:, dst] = cache[:, src]  # whole block, all layers


def _write(cache, table, pos, S, rng):
    b = table[pos // S]
    cache[:, b, :, pos % S] = rng.standard_normal(cache[:, b, :, pos % S].shape)


def _read(cache, table, n, S):
    return np.stack([cache[:, table[p // S], :, p % S] for p in range(n)], axis=1)  # [L, n, K, D]


def test_cow_copies_one_block_when_last_block_is_partial():
    S, rng = 4, np.random.default_rng(1)
    a = BlockAllocator(10, S)
    cache = _device_cache(10, S)
    a.allocate(0, [1, 2, 3, 4, 5, 6])  # 2 blocks, the last half full
    parent = a.block_table(0)
    for p in range(6):
        _write(cache, parent, p, S, rng)
    a.fork(0, 1)
    assert a.block_table(1) == parent and all(a.refcount(b) == 2 for b in parent)
    parent_kv = _read(cache, parent, 6, S).tobytes()
    parent_blocks = cache[:, parent].tobytes()

    copies = a.append_slots(1, [7])  # the child appends into the shared partial block
    child = a.block_table(1)
    assert copies == [(parent[1], child[1])] and child[0] == parent[0] and child[1] not in parent
    assert a.refcount(parent[0]) == 2 and a.refcount(parent[1]) == 1 and a.refcount(child[1]) == 1
    _apply_copies(cache, copies)
    _write(cache, child, 6, S, rng)
    assert cache[:, parent].tobytes() == parent_blocks  # the other branch, byte for byte
    assert _read(cache, child, 6, S).tobytes() == parent_kv  # the child kept the shared prefix

    assert a.append_slots(1, [8]) == []  # its block is private now
    child_kv = _read(cache, child, 7, S).tobytes()
    assert a.append_slots(0, [9]) == []  # the parent's last block is no longer shared
    _write(cache, parent, 6, S, rng)
    assert _read(cache, child, 7, S).tobytes() == child_kv
    assert a.block_table(0) == parent and a.num_cow_copies == 1


def test_no_cow_when_last_block_is_full():
    S = 4
    a = BlockAllocator(10, S)
    a.allocate(0, list(range(8)))  # two full blocks
    parent = a.block_table(0)
    a.fork(0, 1)
    assert a.append_slots(1, [8]) == []  # goes to a fresh block, nothing to copy
    child = a.block_table(1)
    assert child[:2] == parent and child[2] not in parent and a.block_table(0) == parent
    assert [a.refcount(b) for b in child] == [2, 2, 1]
    assert a.append_slots(0, [9]) == [] and a.block_table(0)[2] not in child
    assert a.num_cow_copies == 0


# ------------------------------------------------------------------------ prefix caching


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_prefix_cache_reuses_exactly_the_shared_full_blocks(k):
    S = 4
    a = BlockAllocator(20, S)
    first = list(range(100, 100 + 3 * S + 2))  # 3 full blocks + 2 tokens
    a.allocate(0, first)
    assert a.match_prefix(first + [0]) == []  # nothing is findable before it is computed
    a.mark_computed(0, len(first))
    second = first[: k * S] + [7] * (3 * S + 2 - k * S)  # differs from token k*S on
    assert a.allocate(1, second) == k * S
    t0, t1 = a.block_table(0), a.block_table(1)
    assert t1[:k] == t0[:k] and not set(t1[k:]) & set(t0)
    assert [a.refcount(b) for b in t0[:3]] == [2] * k + [1] * (3 - k)
    assert a.prefix_cache_hits == k * S and a.prefix_cache_queries == 2 * len(first)


def test_prefix_cache_always_leaves_the_last_token_to_compute():
    S = 4
    a = BlockAllocator(20, S)
    prompt = list(range(3 * S))  # exactly 3 full blocks
    a.allocate(0, prompt)
    a.mark_computed(0, len(prompt))
    a.free(0)
    assert a.allocate(1, prompt) == 2 * S  # the third block holds the last token: computed again
    assert a.allocate(2, prompt + [5]) == 3 * S


def test_forced_hash_collision_does_not_reuse_a_block():
    S = 2
    a = BlockAllocator(20, S, hash_fn=lambda parent, tokens: 0)  # every block collides
    a.allocate(0, [1, 2, 3, 4, 5])
    a.mark_computed(0, 5)
    assert a.allocate(1, [9, 9, 3, 4, 5]) == 0  # same hash, other tokens
    assert not set(a.block_table(1)) & set(a.block_table(0))
    assert a.allocate(2, [1, 2, 3, 4, 5]) == S  # block 1 hits; block 2 collided on registration


@pytest.mark.parametrize("hash_fn,expected", [(_ignore_parent, 2), (None, 4)])
def test_hit_needs_the_same_parent_block(hash_fn, expected):
    """Equal tokens under a different prefix are different K/V: a hash that ignores the parent
    must not make them match. The default hash is the negative control (the full prefix hits)."""
    a = BlockAllocator(20, 2, hash_fn=hash_fn)
    for sid, tokens in enumerate([[1, 1, 5, 5], [2, 2, 5, 5]]):
        a.allocate(sid, tokens)
        a.mark_computed(sid, 4)
    assert a.allocate(2, [2, 2, 5, 5, 0]) == expected


def test_lru_eviction_order():
    S = 2
    a = BlockAllocator(8, S)  # 7 usable blocks
    heads = {}
    for sid, t in enumerate([1, 2, 3]):
        a.allocate(sid, [t, t, 9])  # a full block and a partial one
        a.mark_computed(sid, 3)
        heads[t] = a.block_table(sid)[0]
    for sid in range(3):
        a.free(sid)
    assert a.evictable_block_ids() == [heads[1], heads[2], heads[3]]
    a.allocate(3, [2, 2, 5])  # touches block 2
    a.free(3)
    assert a.evictable_block_ids() == [heads[1], heads[3], heads[2]]
    a.allocate(4, [7] * 8)  # needs exactly the 4 truly free blocks: no eviction
    assert a.num_evictions == 0 and a.evictable_block_ids() == [heads[1], heads[3], heads[2]]
    a.allocate(5, [8] * 4)  # needs 2 more: evicts the two least recently used
    assert a.num_evictions == 2 and a.evictable_block_ids() == [heads[2]]
    assert a.match_prefix([1, 1, 0]) == [] and a.match_prefix([3, 3, 0]) == []
    assert a.match_prefix([2, 2, 0]) == [heads[2]]


def test_eviction_takes_the_deepest_block_of_a_sequence_first():
    a = BlockAllocator(5, 2)  # 4 usable
    a.allocate(0, [1, 1, 2, 2, 3])
    a.mark_computed(0, 5)
    head, child = a.block_table(0)[:2]
    a.free(0)  # tail first: the child block is older in LRU order than its parent
    assert a.evictable_block_ids() == [child, head]
    a.allocate(1, [4] * 6)  # 3 blocks: 2 free + 1 eviction
    assert a.num_evictions == 1 and a.match_prefix([1, 1, 2, 2, 0]) == [head]


# ------------------------------------------------------------------- errors and edge cases


def test_no_free_blocks_is_all_or_nothing():
    a = BlockAllocator(5, 2)  # 4 usable
    a.allocate(0, [1, 2, 3])  # 2 blocks
    a.fork(0, 1)
    before = a.snapshot()
    with pytest.raises(NoFreeBlocksError) as e:
        a.allocate(2, list(range(6)))
    assert (e.value.needed, e.value.available) == (3, 2) and a.snapshot() == before
    a.allocate(2, [5, 5, 5])  # takes the last 2 blocks
    before = a.snapshot()
    with pytest.raises(NoFreeBlocksError) as e:
        a.append_slots(1, [4])  # needs a copy of the shared partial block
    assert (e.value.needed, e.value.available) == (1, 0) and a.snapshot() == before
    assert not a.can_allocate(1) and not a.has_seq(3)


def test_allocate_by_count_has_no_prefix_caching():
    a = BlockAllocator(6, 2)
    assert a.allocate(0, 3) == 0 and a.append_slots(0, 2) == [] and a.num_tokens(0) == 5
    a.mark_computed(0, 5)
    assert a.evictable_block_ids() == [] and a.prefix_cache_queries == 0
    a.allocate(1, [1, 2])
    with pytest.raises(ValueError, match="needs ids"):
        a.append_slots(1, 1)


def test_usage_counts_shared_blocks_once():
    a = BlockAllocator(10, 4)
    a.allocate(0, [1, 2, 3, 4, 5])  # 2 blocks, 5 slots filled
    a.fork(0, 1)
    a.append_slots(1, [6])  # copy of the partial block, 6 tokens
    u = a.usage()
    assert (u.num_used_blocks, u.num_filled_slots, u.num_total_blocks) == (3, 4 + 1 + 2, 9)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: BlockAllocator(1, 4), "num_blocks"),
        (lambda: BlockAllocator(4, 0), "block_size"),
        (lambda: BlockAllocator(4, 2).free(0), "unknown sequence"),
        (lambda: BlockAllocator(4, 2).allocate(0, -1), ">= 0"),
    ],
)
def test_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_misuse_raises():
    a = BlockAllocator(6, 2)
    a.allocate(0, [1, 2, 3])
    with pytest.raises(ValueError, match="already allocated"):
        a.allocate(0, [1])
    with pytest.raises(ValueError, match="already allocated"):
        a.fork(0, 0)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        a.mark_computed(0, 4)
    a.free(0)
    with pytest.raises(ValueError, match="unknown sequence"):
        a.free(0)  # no double free


def _usage_by_walk(a: BlockAllocator, seq_ids) -> tuple[int, int]:
    """(used blocks, filled slots) by walking every block of every table: a block counts once,
    as filled as the fullest table holding it."""
    filled: dict[int, int] = {}
    for sid in seq_ids:
        n = a.num_tokens(sid)
        for i, b in enumerate(a.block_table(sid)):
            filled[b] = max(filled.get(b, 0), min(a.block_size, n - i * a.block_size))
    return len(filled), sum(filled.values())


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_usage_matches_a_walk_of_every_table(caching, monkeypatch):
    """`usage()` reads only each table's last block; it must agree with the full walk in every
    state of a random run, shared partial blocks (forks before copy-on-write) included."""
    check, shared_partial = AllocatorModel.check, []

    def check_with_usage(self):
        check(self)
        a, u = self.alloc, self.alloc.usage()
        assert (u.num_used_blocks, u.num_filled_slots) == _usage_by_walk(a, self.tokens)
        shared_partial.append(
            any(a.num_tokens(s) % a.block_size and a.refcount(a.block_table(s)[-1]) > 1
                for s in self.tokens)
        )  # fmt: skip

    monkeypatch.setattr(AllocatorModel, "check", check_with_usage)
    _random_run(0, caching, None, n_ops=600)
    assert any(shared_partial)  # the run reached the case a per-table sum would double count


def _random_mutations(a: BlockAllocator, rng, n_ops: int, next_id: int) -> None:
    """n_ops random allocator mutations, as a scheduler step makes them (no bookkeeping)."""
    for _ in range(n_ops):
        live = a.seq_ids()
        sid = live[rng.integers(len(live))] if live else None
        op = rng.choice(["allocate", "append", "compute", "fork", "free", "reset"])
        try:
            if op == "allocate":
                a.allocate(next_id, rng.integers(0, 3, rng.integers(1, 12)).tolist())
                next_id += 1
            elif op == "reset":
                a.reset_prefix_cache()
            elif sid is None:
                continue
            elif op == "append":
                a.append_slots(sid, rng.integers(0, 3, rng.integers(1, 4)).tolist())
            elif op == "compute":
                a.mark_computed(sid, int(rng.integers(0, a.num_tokens(sid) + 1)))
            elif op == "fork":
                a.fork(sid, next_id)
                next_id += 1
            elif op == "free":
                a.free(sid)
        except NoFreeBlocksError:
            pass


@pytest.mark.parametrize("caching", [True, False])
def test_restore_state_undoes_any_mutations_exactly(caching):
    """save_state / restore_state (the engine's undo of a failed step) is exact."""
    m = _random_run(0, caching, None, n_ops=300)
    a, rng = m.alloc, np.random.default_rng(1)
    for trial in range(200):
        before = a.snapshot()
        state = a.save_state()
        _random_mutations(a, rng, int(rng.integers(1, 12)), 10_000 + 100 * trial)
        a.restore_state(state)
        assert a.snapshot() == before, trial
        a.check_invariants()
    m.check()  # the model's K/V still read back through the restored tables


def test_invalidate_forgets_lost_blocks_and_their_descendants():
    a = BlockAllocator(10, 2, True)
    a.allocate(0, [1, 2, 3, 4, 5, 6, 7])
    a.mark_computed(0, 6)
    root, mid, leaf = a.block_table(0)[:3]
    assert all(a.is_cached(b) for b in (root, mid, leaf))
    with pytest.raises(ValueError, match="held"):
        a.invalidate([mid])
    a.free(0)
    a.invalidate([mid])
    assert a.is_cached(root) and not a.is_cached(mid) and not a.is_cached(leaf)
    assert a.match_prefix([1, 2, 3, 4, 5, 6, 7]) == [root]
    a.check_invariants()


def test_check_invariants_catches_corruption():
    """A negative control: the checker fails on each kind of broken bookkeeping."""

    def fresh():
        a = BlockAllocator(8, 2, True)
        a.allocate(0, [1, 2, 3, 4, 5])
        a.mark_computed(0, 4)
        a.fork(0, 1)
        a.check_invariants()
        return a

    corruptions = [
        lambda a: a._refcount.__setitem__(a.block_table(0)[0], 1),
        lambda a: a._free.append(a.block_table(0)[0]),
        lambda a: a._free.popleft(),
        lambda a: a._tables[0].append(0),
        lambda a: a._num_slots.__setitem__(1, 9),
        lambda a: a._hash_to_block.clear(),
        lambda a: a._evictable.__setitem__(a._free[0], None),
    ]
    for corrupt in corruptions:
        a = fresh()
        corrupt(a)
        with pytest.raises(AssertionError):
            a.check_invariants()
