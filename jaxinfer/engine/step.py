"""The engine's jitted device functions: the step (forward over the paged cache, then sampling),
its logprobs variant, and copy-on-write block copies; plus the host side that builds a step's
padded batch from a `Schedule` and runs it (`build_batch`, `apply_copies`; `Engine._run` runs it).

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

from jaxinfer.cache.metadata import BatchMetadata, SeqChunk, bucket, build_metadata, finite_rows
from jaxinfer.cache.paged import PagedKVCache, copy_blocks
from jaxinfer.config import ModelConfig
from jaxinfer.engine.buckets import pad_tokens
from jaxinfer.engine.head_drafting import HeadPool, copy_pool_blocks
from jaxinfer.engine.scheduler import Schedule
from jaxinfer.model.decoder import forward
from jaxinfer.penalties import PenaltyBatch, apply_penalties, history_counts, output_tail
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
    pen: Penalties | None = None,  # only for a batch with a penalized row
    *,
    cfg: ModelConfig,
    backend: str,
) -> tuple[jax.Array, PagedKVCache]:
    logits, cache = forward(params, cfg, meta, cache, backend=backend)  # [B, V]
    rows = logits[sample_src]  # [B, V]
    tokens = sample(_penalized(rows, pen), sb, sample_pos, sample_index)  # [B]
    # A non-finite row is flagged as -1, so the one [B] transfer carries the check too.
    return jnp.where(finite_rows(rows), tokens, -1), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Penalties:
    """A step's penalty inputs (`jaxinfer.penalties`): settings and each sample row's tokens."""

    pb: PenaltyBatch  # [B] rows
    history: jax.Array  # [B, H] int32 prompt then output tokens before the sampled one, -1 pad
    num_prompt: jax.Array  # [B] int32 prompt tokens at the head of each history


def _penalized(rows: jax.Array, pen: Penalties | None) -> jax.Array:
    """`rows [B, V]` with each row's penalties and logit bias applied (None: as they are)."""
    if pen is None:
        return rows
    counts, seen = history_counts(pen.history, pen.num_prompt, rows.shape[-1])  # [B, V] x2
    tail = output_tail(pen.history, pen.num_prompt, pen.pb.tail_width)  # [B, P]
    return apply_penalties(rows, pen.pb, counts, seen, tail)


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
    params,
    cache,
    meta,
    sample_src,
    sb,
    sample_pos,
    sample_index,
    pen=None,
    *,
    cfg,
    backend,
    num_logprobs,
):
    """`_step` that also returns `_token_logprobs` of the sampled rows (top `num_logprobs`): the
    model's distribution, before penalties and sampling settings, as vLLM reports it."""
    logits, cache = forward(params, cfg, meta, cache, backend=backend)
    rows = logits[sample_src]  # [B, V]
    tokens = sample(_penalized(rows, pen), sb, sample_pos, sample_index)  # [B]
    lp = _token_logprobs(rows, tokens, num_logprobs)
    return (jnp.where(finite_rows(rows), tokens, -1), lp), cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy(cache, src: jax.Array, dst: jax.Array):
    """`copy_blocks` of a paged cache or of a head drafter's `HeadPool`."""
    if isinstance(cache, HeadPool):
        return copy_pool_blocks(cache, src, dst)
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
    pen: Penalties | None = None  # with a penalized row only


def _padded(values: list[int], n: int) -> np.ndarray:
    """`values` zero-padded to `[n]` int32."""
    out = np.zeros(n, np.int32)
    out[: len(values)] = values
    return out


# ------------------------------------------------------------------------------- host side


def apply_copies(engine, copies: Sequence[tuple[int, int]]) -> None:
    """Applies a schedule's copy-on-write block copies to the engine's caches (target, draft)."""
    for group in _copy_groups(copies):
        n = bucket(len(group))
        src = np.zeros(n, np.int32)  # padding: null block 0 -> 0, harmless
        dst = np.zeros(n, np.int32)
        src[: len(group)], dst[: len(group)] = zip(*group)
        engine.cache = _copy(engine.cache, src, dst)
        if engine.dcache is not None:
            engine.dcache = _copy(engine.dcache, src, dst)


def padded_shape(schedule: Schedule, config, token_buckets: Sequence[int]) -> tuple[int, int, int]:
    """The (T, B, M) a step of `schedule` runs at: T padded to `token_buckets` (`buckets.py`),
    B (sequences or sample rows) and M (blocks per sequence) to powers of two above
    `config.min_seq_bucket` / `config.min_block_bucket`. The simulator pads with it too."""
    seqs = schedule.seqs
    n_rows = sum(len(s.sample_seq_ids) for s in seqs)
    b = bucket(max(len(seqs), n_rows), config.min_seq_bucket)
    t = pad_tokens(schedule.num_batched_tokens, token_buckets)
    m = bucket(max(len(s.block_table) for s in seqs), config.min_block_bucket)
    return t, b, m


def build_batch(engine, schedule: Schedule) -> _Batch:
    """The padded device batch of a schedule (host only). T is padded to the engine's measured
    token buckets (`buckets.py`), B and M to powers of two above their minimums."""
    cfg = engine.config
    S = cfg.block_size
    seqs = schedule.seqs
    chunks = [
        SeqChunk(s.token_ids, s.start_pos, s.block_table, "last" if s.sample else "none")
        for s in seqs
    ]
    t, b, m = padded_shape(schedule, cfg, engine.token_buckets)
    meta, owner = build_metadata(chunks, S, num_tokens=t, num_seqs=b, max_blocks=m, num_logits=b)
    # One sample row per sampled sequence id: the logits row of its chunk, the position its
    # token will occupy, its sample index and its request's settings.
    row_of = {c: r for r, c in enumerate(owner.tolist()) if c >= 0}  # chunk -> logits row
    rows = [(i, sid) for i, s in enumerate(seqs) for sid in s.sample_seq_ids]  # [R]
    ids = [sid for _, sid in rows]
    src = _padded([row_of[i] for i, _ in rows], b)
    pos = _padded([seqs[i].start_pos + len(seqs[i].token_ids) for i, _ in rows], b)
    index = _padded([engine._sample_index[sid] for sid in ids], b)
    sps = [engine._live[seqs[i].request_id].sampling for i, _ in rows]
    sb = SamplingBatch.from_params(sps, pad_to=b)
    pen = None
    if any(sp.penalized for sp in sps):
        seq_states = [engine.scheduler.sequence(seqs[i].seq_id) for i, _ in rows]
        pen = penalty_inputs(engine.cfg, sps, seq_states, pos, b)
    return _Batch(meta, src, sb, pos, index, ids, (t, b, m), tuple(sps), pen)


def penalty_inputs(cfg: ModelConfig, sps, seq_states, pos: np.ndarray, b: int) -> Penalties:
    """Each sample row's tokens before the one it samples (its sequence's first `pos`), padded
    to `[b, H]`, H a power of two >= 16: few compilations as outputs grow."""
    h = bucket(max(int(pos.max()), 1), 16)
    history = np.full((b, h), -1, np.int32)
    num_prompt = np.zeros(b, np.int32)
    for r, seq in enumerate(seq_states):
        history[r, : pos[r]] = seq.token_ids[: pos[r]]
        num_prompt[r] = seq.num_prompt_tokens - seq.request.num_generated
    return Penalties(PenaltyBatch.from_params(sps, cfg, pad_to=b), history, num_prompt)
