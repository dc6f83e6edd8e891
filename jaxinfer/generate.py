"""Batched generation: one ragged prefill, then decode in a `lax.while_loop` over the paged cache.

The whole request batch is one compiled program: prefill writes every prompt into the cache
and samples each first token; the loop then decodes all sequences together, one token per
sequence per iteration, until every sequence has stopped; the loop's carry is a `DecodeState`.
Shapes are bucketed to powers of two (batch, prompt tokens, blocks per sequence, new tokens) so
new prompt lengths within a bucket reuse the compilation (tests count compilations with
`_generate_core._cache_size()`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxinfer.cache.metadata import (
    BatchMetadata,
    bucket,
    decode_batch,
    finite_rows,
    is_stop,
    start_flags,
)
from jaxinfer.cache.paged import PagedKVCache, check_block_size, init_cache
from jaxinfer.config import ModelConfig
from jaxinfer.distributed.sharding import constrain_cache
from jaxinfer.distributed.sharding import prepare as prepare_tp
from jaxinfer.model.decoder import forward
from jaxinfer.model.params import check_params, loop_layout, remembered_loop_layout
from jaxinfer.ops.backend import resolve_backend, resolve_platform
from jaxinfer.penalties import PenaltyBatch, add_tokens, apply_penalties, history_counts, push_tail
from jaxinfer.requests import (  # noqa: F401  (GenerationOutput, stop_table, validate_requests:
    GenerationOutput,  # re-exported where users import them from since before requests.py)
    check_pad_to,
    new_tokens_bucket,
    prompt_batch,
    prompt_bucket,
    stop_table,
    token_list,
    validate_requests,
)
from jaxinfer.sampling import SamplingBatch, SamplingParams, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The decode loop's carry: the cache and each sequence's progress (B bucketed rows)."""

    cache: PagedKVCache  # holds positions 0..lens-1 of every sequence
    last: jax.Array  # [B] int32 the newest token, at position `lens`, not yet in the cache
    lens: jax.Array  # [B] int32 tokens in the cache: prompt + generated - 1 (while live)
    out: jax.Array  # [B, max_new] int32 generated tokens; the first n_out of a row are valid
    n_out: jax.Array  # [B] int32 tokens generated so far (the prefill samples the first)
    done: jax.Array  # [B] bool the sequence takes no more steps (see the stop rules below)
    stopped: jax.Array  # [B] bool finished on a stop token (finish reason "stop")
    failed: jax.Array  # [B] bool finished on non-finite logits (finish reason "error")
    step: jax.Array  # [] int32 tokens sampled per live row so far: 1 after the prefill
    # With penalties only (None otherwise): each row's output token counts, the tokens of its
    # prompt or output and its output's last P tokens (`jaxinfer.penalties`).
    counts: jax.Array | None = None  # [B, V] int32
    seen: jax.Array | None = None  # [B, V] bool
    tail: jax.Array | None = None  # [B, P] int32, -1 before the first output token


@functools.partial(
    jax.jit, static_argnames=("cfg", "max_new", "block_size", "backend", "platform", "mesh")
)
def _generate_core(
    params: dict,
    prefill: BatchMetadata,  # the ragged prompt batch; B padded rows of logits
    tables: jax.Array,  # [B, M] int32 each sequence's blocks
    prompt_lens: jax.Array,  # [B] int32 (0 for padding rows)
    sb: SamplingBatch,  # [B] rows
    stops: jax.Array,  # [B, n_stop] int32, -1 padded
    max_tokens: jax.Array,  # [B] int32 (0 for padding rows)
    penalties: tuple[PenaltyBatch, jax.Array] | None,  # [B] rows, [B, P] prompts (-1 padded)
    *,
    cfg: ModelConfig,
    max_new: int,
    block_size: int,
    backend: str,  # concrete (resolved by `generate`)
    platform: str,  # "cpu", "gpu", ... resolved by `generate`: the loop layout and cache
    mesh: Mesh | None = None,  # the TP mesh the params live on (None: one device)
):
    b, m = tables.shape
    rows = jnp.arange(b)
    params = loop_layout(params, platform, mesh)  # sliced once, outside the decode loop
    cache = init_cache(cfg, 1 + b * m, block_size, platform=platform)
    if mesh is not None:  # split over KV heads like the params (jaxinfer.distributed)
        cache = constrain_cache(cfg, cache, mesh)
    logits, cache = forward(params, cfg, prefill, cache, backend=backend)  # [B, V]
    counts = seen = tail = None
    if penalties is not None:
        pb, prompt_ids = penalties
        counts, seen = history_counts(prompt_ids, prompt_lens, cfg.vocab_size)  # [B, V] x2
        tail = jnp.full((b, pb.tail_width), -1, jnp.int32)  # [B, P] no output yet

    def penalized(logits, counts, seen, tail):  # [B, V]: what `sample` reads
        return logits if penalties is None else apply_penalties(logits, pb, counts, seen, tail)

    # The token at position prompt_len.
    first = sample(penalized(logits[:b], counts, seen, tail), sb, prompt_lens)
    # A row whose prefill logits are not finite fails at once and emits nothing.
    failed = (max_tokens > 0) & ~finite_rows(logits[:b])  # [B]
    n_out, stopped, done = start_flags(first, max_tokens, stops, failed)
    if penalties is not None:
        counts, seen = add_tokens(counts, seen, first, n_out > 0)
        tail = push_tail(tail, first, n_out > 0)
    state = DecodeState(
        cache=cache,
        last=first,
        lens=prompt_lens,
        out=jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(first),
        n_out=n_out,
        done=done,
        stopped=stopped,
        failed=failed,
        step=jnp.int32(1),
        counts=counts,
        seen=seen,
        tail=tail,
    )

    def cond(st: DecodeState):
        # Run while some sequence is live. The step bound is a guard only: every live row
        # samples one token per step and max_tokens <= max_new, so `done` ends the loop first.
        return ~jnp.all(st.done) & (st.step < max_new)

    def body(st: DecodeState) -> DecodeState:
        # `last` sits at position `lens`: write it, attend over lens + 1, sample position lens+1.
        batch = decode_batch(st.last, st.lens, tables, block_size)
        logits, cache = forward(params, cfg, batch, st.cache, backend=backend)  # [B, V]
        new = sample(penalized(logits, st.counts, st.seen, st.tail), sb, st.lens + 1)  # [B]
        bad = ~st.done & ~finite_rows(logits)  # stop 1: non-finite logits, nothing emitted
        live = ~st.done & ~bad
        counts, seen, tail = st.counts, st.seen, st.tail
        if penalties is not None:
            counts, seen = add_tokens(counts, seen, new, live)
            tail = push_tail(tail, new, live)
        at = jnp.minimum(st.n_out, max_new - 1)  # [B] the next output slot (clamped when done)
        out = st.out.at[rows, at].set(jnp.where(live, new, st.out[rows, at]))
        n_out = st.n_out + live
        hit = live & is_stop(new, stops)  # stop 2: a stop token, kept in the output
        # stop 3: max_tokens reached (padding rows have max_tokens 0 and were done at once)
        done = st.done | bad | hit | (n_out >= max_tokens)
        return DecodeState(
            cache=cache,
            last=jnp.where(live, new, st.last),
            lens=st.lens + live,
            out=out,
            n_out=n_out,
            done=done,
            stopped=st.stopped | hit,
            failed=st.failed | bad,
            step=st.step + 1,
            counts=counts,
            seen=seen,
            tail=tail,
        )

    st = jax.lax.while_loop(cond, body, state)
    return st.out, st.n_out, st.stopped, st.failed, st.step  # step: 1 + decode iterations run


def _penalty_inputs(cfg, prompts, sampling, b: int):
    """`_generate_core`'s penalties: None unless a request has one; else the `[b]` rows and the
    prompts as a `[b, P]` int32 array, -1 padded, P bucketed to a power of two."""
    if not any(sp.penalized for sp in sampling):
        return None
    ids = np.full((b, bucket(max(len(p) for p in prompts))), -1, np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = token_list(p)
    return PenaltyBatch.from_params(sampling, cfg, pad_to=b), ids


def generate(
    cfg: ModelConfig,
    params: dict,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    block_size: int = 16,
    backend: str = "auto",
    pad_to: Mapping[str, int] | None = None,
    mesh: Mesh | int | None = None,
) -> list[GenerationOutput]:
    """Generates a continuation for each prompt.

    Args:
      cfg: model config.
      params: params pytree (dense or quantized).
      prompts: token-id lists of any lengths.
      sampling: one SamplingParams for all prompts, or one per prompt.
      block_size: tokens per KV block.
      backend: attention backend ("auto", "xla", "reference", "pallas", "pallas-interpret").
      pad_to: optional minimum padded sizes {"seqs", "tokens", "blocks", "new_tokens"}: a
        caller that runs many batches (a static-batching server) fixes them to compile once.
      mesh: run tensor-parallel on this device mesh (or degree): params are placed by
        `ji.shard_params` first. Params already placed by it run sharded without this.

    Returns:
      One GenerationOutput per prompt, in order. A sequence whose logits turn non-finite (NaN
      or Inf weights or activations) stops there with finish_reason "error" and an `error`
      naming the position; the others are unaffected.
    """
    sampling = validate_requests(cfg, prompts, sampling)
    check_params(cfg, params)
    params, mesh = prepare_tp(cfg, params, mesh)
    block_size = check_block_size(block_size)
    platform = resolve_platform()  # once, here: passed down static, never read under jit
    backend = resolve_backend(backend, platform)
    if mesh is None:  # the decode loop's layout, made once per params pytree (see its docstring)
        params = remembered_loop_layout(params, platform)
    pad_to = check_pad_to(pad_to)
    max_new = new_tokens_bucket(sampling, max(8, pad_to.get("new_tokens", 8)))
    longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, sampling))
    batch = prompt_batch(prompts, sampling, block_size, capacity=longest, pad_to=pad_to)
    b = len(batch.prompt_lens)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):  # Pallas: shard_map
        out, n_out, stopped, failed, _ = _generate_core(
            params,
            batch.meta,
            batch.tables,
            batch.prompt_lens,
            SamplingBatch.from_params(sampling, pad_to=b),
            stop_table(cfg, sampling, b),
            batch.max_tokens,
            _penalty_inputs(cfg, prompts, sampling, b),
            cfg=cfg,
            max_new=max_new,
            block_size=block_size,
            backend=backend,
            platform=platform,
            mesh=mesh,
        )
    out, n_out, stopped, failed = jax.device_get((out, n_out, stopped, failed))
    outs = []
    for i in range(batch.n):
        tokens = out[i, : n_out[i]].tolist()
        if failed[i]:
            pos = len(prompts[i]) + len(tokens)
            error = f"non-finite logits (NaN or Inf) sampling position {pos} of prompt {i}"
            outs.append(GenerationOutput(tokens, "error", error=error))
        else:
            outs.append(GenerationOutput(tokens, "stop" if stopped[i] else "length"))
    return outs
