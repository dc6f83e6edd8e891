"""KV connectors: how a prefilled request's KV blocks move from a prefill engine to a decode one.

The interface is shaped like vLLM's KV connector (v1): the prefill side `save`s a request's KV
once its prefill is done, the decode side learns which requests are `ready`, starts a load into
blocks it allocated beforehand (`start_load`, told how many leading blocks it already holds, which
are not sent), waits for it (`wait_for_load`), and either side calls `request_finished` when the
connector may forget the request (loaded, or aborted). Two implementations:

- `MeshConnector`: both engines in one process on disjoint sub-meshes; the blocks are a device
  array on the prefill mesh, and the load is `jax.device_put` onto the decode cache's sharding
  (asynchronous: `wait_for_load` blocks until it is done).
- `SocketConnector` (`socket_connector.py`): prefill and decode in two processes; the blocks go
  to host memory on the prefill side and over a TCP socket.

What moves is a `PagedKVCache` of n blocks (`k`, `v` `[L, n, K, S, D]`): exactly the blocks the
decode side lacks, so the bytes of a load are 2 · L · K · D · itemsize · n · S (`kv_bytes`).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import bucket
from jaxinfer.cache.paged import PagedKVCache, take_pages


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """What the decode side needs to continue a request whose prefill is done."""

    request_id: Hashable
    prompt: tuple[int, ...]  # [P]
    first_token: int  # sampled by the prefill side at position P
    num_blocks: int  # full prompt blocks saved (P // S): the partial last block is recomputed
    sampling: dict  # the request's SamplingParams fields
    saved_at: float  # the prefill side's clock when saved


def kv_bytes(blocks: PagedKVCache) -> int:
    """Bytes of the K/V (and scales) of a block payload: 2 · L · n · K · S · D · itemsize (+)."""
    return blocks.nbytes()


@functools.partial(jax.jit, static_argnames=("n",))
def _gather(cache: PagedKVCache, ids: jax.Array, n: int) -> PagedKVCache:
    """Blocks `ids[:n]` of every layer (ids padded to a bucket, so few compilations)."""

    return jax.tree.map(lambda x: take_pages(x, (slice(None), ids), cache.platform)[:, :n], cache)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _scatter(cache: PagedKVCache, blocks: PagedKVCache, ids: jax.Array) -> PagedKVCache:
    """Writes `blocks [L, n', ...]` into blocks `ids [n']` of `cache` (padding: id 0, the null
    block, whose contents are never read)."""
    return jax.tree.map(lambda c, b: c.at[:, ids].set(b.astype(c.dtype)), cache, blocks)


def gather_blocks(cache: PagedKVCache, block_ids: list[int]) -> PagedKVCache:
    """A copy of the cache's blocks `block_ids` (every layer), on the cache's devices."""
    n = len(block_ids)
    ids = np.zeros(bucket(max(n, 1)), np.int32)
    ids[:n] = block_ids
    return _gather(cache, ids, n)


def scatter_blocks(cache: PagedKVCache, blocks: PagedKVCache, block_ids: list[int]):
    """`cache` with `blocks` written into `block_ids` (donated: updated in place)."""
    n = len(block_ids)
    if blocks.k.shape[1] != n:
        raise ValueError(f"{blocks.k.shape[1]} blocks to write into {n} block ids {block_ids}")
    m = bucket(max(n, 1))
    ids = np.zeros(m, np.int32)
    ids[:n] = block_ids

    def pad(x):
        return jnp.pad(x, [(0, 0), (0, m - n)] + [(0, 0)] * (x.ndim - 2))

    return _scatter(cache, jax.tree.map(pad, blocks), ids)


class KVConnector(abc.ABC):
    """Moves prefilled requests' KV blocks from a prefill engine to a decode engine.

    Counters: `bytes_moved` (payload bytes loaded so far), `load_seconds` (start_load to the
    end of wait_for_load, summed), `num_loads`.
    """

    def __init__(self):
        self.bytes_moved = 0
        self.load_seconds = 0.0
        self.num_loads = 0

    # prefill side
    @abc.abstractmethod
    def save(self, info: Prefilled, blocks: PagedKVCache) -> None:
        """Keeps the request's `info.num_blocks` full prompt blocks until loaded or finished."""

    # decode side
    @abc.abstractmethod
    def ready(self) -> list[Prefilled]:
        """Requests saved since the last call, in save order."""

    @abc.abstractmethod
    def start_load(self, request_id: Hashable, skip: int) -> None:
        """Starts moving the request's blocks `[skip:]` (the decode side holds the first skip)."""

    @abc.abstractmethod
    def wait_for_load(self, request_id: Hashable) -> PagedKVCache:
        """The blocks of a started load, on the decode cache's devices and layout."""

    @abc.abstractmethod
    def load_arrived(self, request_id: Hashable) -> bool:
        """Whether `wait_for_load` would return without waiting on the other side."""

    # both sides
    @abc.abstractmethod
    def request_finished(self, request_id: Hashable) -> None:
        """Forgets the request (loaded or aborted): drops its saved blocks and any load."""

    @abc.abstractmethod
    def num_pending(self) -> int:
        """Requests the connector holds blocks or a load for."""


class MeshConnector(KVConnector):
    """Between sub-meshes of one process: `jax.device_put` onto the decode cache's layout.

    Args:
      target: the decode cache's sharding pytree (`jax.tree.map(lambda x: x.sharding, cache)`);
        the loaded blocks get the same layout (split over KV heads on the decode mesh).
    """

    def __init__(self, target: PagedKVCache):
        super().__init__()
        self.target = target
        self._saved: dict[Hashable, tuple[Prefilled, PagedKVCache]] = {}
        self._new: list[Prefilled] = []
        self._loads: dict[Hashable, tuple[PagedKVCache, float]] = {}

    def save(self, info: Prefilled, blocks: PagedKVCache) -> None:
        if info.request_id in self._saved:
            raise ValueError(f"request {info.request_id!r} was saved already")
        self._saved[info.request_id] = (info, blocks)
        self._new.append(info)

    def ready(self) -> list[Prefilled]:
        new, self._new = self._new, []
        return [i for i in new if i.request_id in self._saved]

    def start_load(self, request_id: Hashable, skip: int) -> None:
        info, blocks = self._saved[request_id]
        if not 0 <= skip <= info.num_blocks:
            raise ValueError(f"skip={skip} outside [0, {info.num_blocks}] for {request_id!r}")
        part = jax.tree.map(lambda x: x[:, skip:], blocks)
        start = time.perf_counter()
        moved = jax.device_put(part, self.target)  # asynchronous
        self._loads[request_id] = (moved, start)

    def wait_for_load(self, request_id: Hashable) -> PagedKVCache:
        moved, start = self._loads.pop(request_id)
        jax.block_until_ready(moved)
        self.load_seconds += time.perf_counter() - start
        self.bytes_moved += kv_bytes(moved)
        self.num_loads += 1
        return moved

    def load_arrived(self, request_id: Hashable) -> bool:
        return True  # the copy is enqueued on the decode devices: a step would wait for it anyway

    def request_finished(self, request_id: Hashable) -> None:
        self._saved.pop(request_id, None)
        self._loads.pop(request_id, None)

    def num_pending(self) -> int:
        return len(self._saved.keys() | self._loads.keys())
