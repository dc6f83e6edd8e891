"""The engine's jitted device functions: the step (forward over the paged cache, then sampling),
its logprobs variant, and copy-on-write block copies; plus their host-side helpers.

The cache is donated to every call, so it is updated in place. Tests count compilations with the
jitted functions' own `_cache_size()`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import BatchMetadata, finite_rows
from jaxinfer.cache.paged import PagedKVCache, copy_blocks
from jaxinfer.config import ModelConfig
from jaxinfer.model.decoder import forward
from jaxinfer.sampling import SamplingBatch, SamplingParams, sample


@functools.partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnames=("cache",))
def _step(
    params: dict,
    cache: PagedKVCache,
    meta: BatchMetadata,  # T tokens, B sequences, N = B logits rows
    sample_src: jax.Array,  # [B] int32 logits row of each sample row
    sb: SamplingBatch,  # [B] rows
    sample_pos: jax.Array,  # [B] int32 position of each sampled token
    sample_index: jax.Array,  # [B] int32
    *,
    cfg: ModelConfig,
    backend: str,
) -> tuple[jax.Array, PagedKVCache]:
    logits, cache = forward(params, cfg, meta, cache, backend=backend)  # [B, V]
    rows = logits[sample_src]  # [B, V]
    tokens = sample(rows, sb, sample_pos, sample_index)  # [B]
    # A non-finite row is flagged as -1, so the one [B] transfer carries the check too.
    return jnp.where(finite_rows(rows), tokens, -1), cache


def _token_logprobs(logits: jax.Array, tokens: jax.Array, k: int):
    """Log-probabilities of `tokens [B]` under `logits [B, V]` and the top `k` of each row."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, V]
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]  # [B]
    top_lp, top_ids = jax.lax.top_k(logp, k)  # [B, k]
    return chosen, top_ids, top_lp


@functools.partial(
    jax.jit, static_argnames=("cfg", "backend", "num_logprobs"), donate_argnames=("cache",)
)
def _step_logprobs(
    params, cache, meta, sample_src, sb, sample_pos, sample_index, *, cfg, backend, num_logprobs
):
    """`_step` that also returns `_token_logprobs` of the sampled rows (top `num_logprobs`)."""
    logits, cache = forward(params, cfg, meta, cache, backend=backend)
    rows = logits[sample_src]  # [B, V]
    tokens = sample(rows, sb, sample_pos, sample_index)  # [B]
    lp = _token_logprobs(rows, tokens, num_logprobs)
    return (jnp.where(finite_rows(rows), tokens, -1), lp), cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    return copy_blocks(cache, src, dst)


def _copy_groups(copies: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Splits ordered copies into groups one parallel scatter applies exactly: a copy starts a new
    group if it reads or overwrites a block an earlier copy of the group wrote."""
    groups: list[list[tuple[int, int]]] = []
    written: set[int] = set()
    for src, dst in copies:
        if not groups or src in written or dst in written:
            groups.append([])
            written = set()
        groups[-1].append((src, dst))
        written.add(dst)
    return groups


def _host_logprobs(ids, sps, chosen, top_ids, top_lp) -> dict[int, tuple]:
    """seq id -> [(logprob, ((id, logprob), ...))] for the rows that asked for logprobs."""
    out = {}
    for r, (sid, sp) in enumerate(zip(ids, sps)):
        if sp.logprobs is not None:
            top = tuple(zip(top_ids[r, : sp.logprobs].tolist(), top_lp[r, : sp.logprobs].tolist()))
            out[sid] = [(float(chosen[r]), top)]
    return out


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A step's device inputs, built on the host before anything reaches the device."""

    meta: BatchMetadata  # T tokens, B sequences
    src: np.ndarray  # [B] int32 logits row of each sample row
    sb: SamplingBatch  # [B] rows
    pos: np.ndarray  # [B] int32 position of each sampled token
    index: np.ndarray  # [B] int32 sample index
    ids: list[int]  # [R] seq id of each real sample row
    shape: tuple[int, int, int]  # (T, B, M)
    sps: tuple[SamplingParams, ...]  # [R] the request settings of each real sample row


def _padded(values: list[int], n: int) -> np.ndarray:
    """`values` zero-padded to `[n]` int32."""
    out = np.zeros(n, np.int32)
    out[: len(values)] = values
    return out
