"""Batched generation: one ragged prefill, then decode in a `lax.while_loop` over the paged cache.

The whole request batch is one compiled program: prefill writes every prompt into the cache
and samples each first token; the loop then decodes all sequences together, one token per
sequence per iteration, until every sequence has stopped. Shapes are bucketed to powers of two
(batch, prompt tokens, blocks per sequence, new tokens) so new prompt lengths within a bucket
reuse the compilation (tests count compilations with `_generate_core._cache_size()`).
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
    SeqChunk,
    bucket,
    build_metadata,
    contiguous_block_tables,
)
from jaxinfer.cache.paged import check_block_size, init_cache
from jaxinfer.checks import as_int
from jaxinfer.config import ModelConfig
from jaxinfer.distributed.sharding import constrain_cache
from jaxinfer.distributed.sharding import prepare as prepare_tp
from jaxinfer.model.decoder import forward
from jaxinfer.model.params import check_params, loop_layout, remembered_loop_layout
from jaxinfer.sampling import SamplingBatch, SamplingParams, sample


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    """One request's result."""

    token_ids: list[int]  # generated ids, prompt excluded, stop token included
    finish_reason: str  # "stop" (a stop token), "length" (max_tokens) or "error"
    # With "error": what failed, e.g. non-finite logits. Keyword-only, so subclasses
    # (SpeculativeOutput) may add fields without defaults.
    error: str | None = dataclasses.field(default=None, kw_only=True)


def validate_requests(
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] | None,
) -> list[SamplingParams]:
    """Checks prompts and sampling params; returns one SamplingParams per prompt.

    Raises ValueError naming the bad value: no prompts, an empty prompt, a token id outside the
    vocabulary, a stop token id outside the vocabulary, prompt + max_tokens beyond
    max_position_embeddings, a sampling list of the wrong length, n != 1. A prompt is a list,
    tuple, numpy or jax array of integer token ids.
    """
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {prompts!r}")
    if sampling is None:
        sampling = SamplingParams()
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    sampling = list(sampling)
    if len(sampling) != len(prompts):
        raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
    for i, (p, sp) in enumerate(zip(prompts, sampling)):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling[{i}] is {type(sp).__name__}, expected SamplingParams")
        if sp.n != 1:
            raise ValueError(f"sampling[{i}].n={sp.n}: ji.generate samples n=1; use ji.Engine")
        if (
            isinstance(p, str | bytes)
            or not isinstance(p, Sequence | np.ndarray | jax.Array)
            or len(p) == 0
        ):
            raise ValueError(f"prompt {i} is empty or not a list of token ids: {p!r}")
        arr = np.asarray(p)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {i} must be a flat list of ints, got dtype {arr.dtype}")
        bad = arr[(arr < 0) | (arr >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(
                f"prompt {i} has token id {int(bad[0])} outside the vocabulary [0, "
                f"{cfg.vocab_size})"
            )
        bad_stops = [t for t in sp.stop_token_ids if t >= cfg.vocab_size]
        if bad_stops:
            raise ValueError(
                f"sampling[{i}].stop_token_ids has {bad_stops[0]}, outside the vocabulary "
                f"[0, {cfg.vocab_size}): the model can never emit it"
            )
        if len(p) + sp.max_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i}: length {len(p)} + max_tokens {sp.max_tokens} = "
                f"{len(p) + sp.max_tokens} exceeds max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
    return sampling


def stop_table(cfg: ModelConfig, sampling: Sequence[SamplingParams], rows: int) -> np.ndarray:
    """`[rows, n_stop]` int32 stop ids per request (eos unless ignore_eos), padded with -1."""
    stops = []
    for sp in sampling:
        s = set(sp.stop_token_ids)
        if cfg.eos_token_id is not None and not sp.ignore_eos:
            s.add(cfg.eos_token_id)
        stops.append(sorted(s))
    width = bucket(max([len(s) for s in stops] + [1]))
    table = np.full((rows, width), -1, np.int32)
    for i, s in enumerate(stops):
        table[i, : len(s)] = s
    return table


def prompt_bucket(n: int, minimum: int = 16) -> int:
    """The padded token count of a prefill of `n` prompt tokens: a power of two up to 128, then the
    next multiple of 1/16 of the power of two above (8 sizes an octave, at most 12.5% padding).

    Prefill is compute-bound on the linears, so padding costs its share of the time (200 tokens
    padded to 256 cost 28% more); finer buckets than `bucket` trade a few more compilations.
    """
    n = max(int(n), int(minimum), 1)
    p = bucket(n)
    step = max(p // 16, 8)
    return p if p <= 128 else -(-n // step) * step


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "block_size", "backend", "mesh"))
def _generate_core(
    params: dict,
    prefill: BatchMetadata,  # the ragged prompt batch; B padded rows of logits
    tables: jax.Array,  # [B, M] int32 each sequence's blocks
    prompt_lens: jax.Array,  # [B] int32 (0 for padding rows)
    sb: SamplingBatch,  # [B] rows
    stops: jax.Array,  # [B, n_stop] int32, -1 padded
    max_tokens: jax.Array,  # [B] int32 (0 for padding rows)
    *,
    cfg: ModelConfig,
    max_new: int,
    block_size: int,
    backend: str,
    mesh: Mesh | None = None,  # the TP mesh the params live on (None: one device)
):
    b, m = tables.shape
    params = loop_layout(params)  # sliced once, outside the decode loop
    cache = init_cache(cfg, 1 + b * m, block_size)
    if mesh is not None:  # split over KV heads like the params (jaxinfer.distributed)
        cache = constrain_cache(cfg, cache, mesh)
    logits, cache = forward(params, cfg, prefill, cache, backend=backend)  # [B, V]
    first = sample(logits[:b], sb, prompt_lens)  # the token at position prompt_len

    def is_stop(tok):  # [B] -> [B] bool
        return jnp.any(tok[:, None] == stops, axis=-1)

    def finite(x):  # [B, V] -> [B] bool: a NaN / Inf row would sample token 0 forever
        return jnp.all(jnp.isfinite(x), axis=-1)

    real = max_tokens > 0
    failed = real & ~finite(logits[:b])  # [B] stopped at a non-finite row, which emits nothing
    out = jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(first)
    n_out = (real & ~failed).astype(jnp.int32)
    stopped = real & ~failed & is_stop(first)
    done = ~real | failed | stopped | (n_out >= max_tokens)

    def cond(state):
        done, step = state[5], state[-1]  # not `stopped`: a max_tokens finish stops the loop too
        # Stop when every sequence has hit a stop token or its max_tokens; the step bound
        # is a guard (max_tokens <= max_new already bounds the loop).
        return ~jnp.all(done) & (step < max_new)

    def body(state):
        cache, last, lens, out, n_out, done, stopped, failed, step = state
        # `last` sits at position `lens`: write it, attend over lens + 1, sample position lens+1.
        slot = tables[jnp.arange(b), lens // block_size] * block_size + lens % block_size
        batch = BatchMetadata(
            tokens=last,
            positions=lens,
            query_start=jnp.arange(b + 1, dtype=jnp.int32),
            seq_lens=lens + 1,
            block_tables=tables,
            slot_mapping=slot,
            logits_indices=jnp.arange(b, dtype=jnp.int32),
        )
        logits, cache = forward(params, cfg, batch, cache, backend=backend)
        new = sample(logits, sb, lens + 1)
        bad = ~done & ~finite(logits)
        failed = failed | bad
        live = ~done & ~bad
        out = out.at[jnp.arange(b), jnp.minimum(n_out, max_new - 1)].set(
            jnp.where(live, new, out[jnp.arange(b), jnp.minimum(n_out, max_new - 1)])
        )
        n_out = n_out + live
        hit = live & is_stop(new)
        stopped = stopped | hit
        done = done | bad | hit | (n_out >= max_tokens)
        lens = lens + live
        last = jnp.where(live, new, last)
        return cache, last, lens, out, n_out, done, stopped, failed, step + 1

    state = (cache, first, prompt_lens, out, n_out, done, stopped, failed, jnp.int32(1))
    _, _, _, out, n_out, _, stopped, failed, steps = jax.lax.while_loop(cond, body, state)
    return out, n_out, stopped, failed, steps  # steps: 1 + decode iterations run (tests read it)


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
    if mesh is None:  # the decode loop's layout, made once per params pytree (see its docstring)
        params = remembered_loop_layout(params)
    block_size = check_block_size(block_size)
    pad_to = dict(pad_to or {})
    unknown = set(pad_to) - {"seqs", "tokens", "blocks", "new_tokens"}
    if unknown:
        raise ValueError(f"pad_to has unknown keys {sorted(unknown)}")
    for key, value in pad_to.items():
        v = as_int(value)  # numpy / jax ints too (jaxinfer.checks)
        if v is None or v < 1:
            raise ValueError(f"pad_to[{key!r}]={value!r} is invalid: expected an int >= 1")
        pad_to[key] = v
    n = len(prompts)
    b = bucket(n, pad_to.get("seqs", 1))
    lens = [len(p) for p in prompts]
    max_new = bucket(max(sp.max_tokens for sp in sampling), max(8, pad_to.get("new_tokens", 8)))
    longest = max(n_p + sp.max_tokens for n_p, sp in zip(lens, sampling))
    m = bucket(-(-longest // block_size), pad_to.get("blocks", 1))
    tables = contiguous_block_tables(b, m)
    chunks = [SeqChunk(np.asarray(p).tolist(), 0, tables[i]) for i, p in enumerate(prompts)]
    prefill, _ = build_metadata(
        chunks, block_size, num_tokens=prompt_bucket(sum(lens), max(16, pad_to.get("tokens", 16))),
        num_seqs=b, max_blocks=m,
        num_logits=b,
    )  # fmt: skip
    prompt_lens = np.zeros(b, np.int32)
    prompt_lens[:n] = lens
    max_tokens = np.zeros(b, np.int32)
    max_tokens[:n] = [sp.max_tokens for sp in sampling]
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):  # Pallas: shard_map
        out, n_out, stopped, failed, _ = _generate_core(
            params,
            prefill,
            tables,
            prompt_lens,
            SamplingBatch.from_params(sampling, pad_to=b),
            stop_table(cfg, sampling, b),
            max_tokens,
            cfg=cfg,
            max_new=max_new,
            block_size=block_size,
            backend=backend,
            mesh=mesh,
        )
    out, n_out, stopped, failed = jax.device_get((out, n_out, stopped, failed))
    outs = []
    for i in range(n):
        tokens = out[i, : n_out[i]].tolist()
        if failed[i]:
            pos = lens[i] + len(tokens)
            error = f"non-finite logits (NaN or Inf) sampling position {pos} of prompt {i}"
            outs.append(GenerationOutput(tokens, "error", error=error))
        else:
            outs.append(GenerationOutput(tokens, "stop" if stopped[i] else "length"))
    return outs
