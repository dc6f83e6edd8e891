"""The logits of fixed windows `[B, S]` for the scoring loop of `jaxinfer.eval`, one host function
per model: the dense forward, or the paged forward over a fresh cache of a KV format.

Through the paged forward each window is prefilled as one ragged chunk with logits "all", its K/V
written into a fresh cache of the given format ("float", "int8", "fp8") and attended to as stored
(dequantized), so a quantized KV cache is measured exactly as the engine would run it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer.cache.metadata import SeqChunk, build_metadata, contiguous_block_tables
from jaxinfer.cache.paged import KV_FORMATS, init_cache
from jaxinfer.model.decoder import forward, forward_dense
from jaxinfer.ops.backend import resolve_backend, resolve_platform

# Windows per paged forward: the reference paged attention gathers every query's context,
# [T, M, K, S, D] floats per layer, so paged batches stay small on CPU.
PAGED_BATCH_SIZE = 4


def check_kv_format(kv_format) -> None:
    if kv_format is not None and kv_format not in KV_FORMATS:
        raise ValueError(
            f"kv_format={kv_format!r}; expected None (dense forward, no cache) or one of "
            f"{KV_FORMATS} (paged forward)"
        )


@functools.lru_cache(maxsize=16)
def paged_layout(num_windows: int, seq_len: int, block_size: int):
    """Metadata of `num_windows` windows, each prefilled as one chunk with logits "all".

    Window i owns blocks 1 + i·M .. (i+1)·M (block 0 is the null block). Only the tokens change
    from batch to batch, so the layout is built once (numpy, tokens left zero).

    Returns:
      (metadata, num_blocks of the cache).
    """
    m = -(-seq_len // block_size)  # blocks per window
    tables = contiguous_block_tables(num_windows, m)  # [B, M]
    chunks = [
        SeqChunk([0] * seq_len, 0, tables[i].tolist(), logits="all") for i in range(num_windows)
    ]
    t = num_windows * seq_len
    meta, _ = build_metadata(
        chunks, block_size, num_tokens=t, num_seqs=num_windows, max_blocks=m, num_logits=t
    )
    return meta, 1 + num_windows * m


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "kv_format", "num_blocks", "block_size", "backend", "platform"),
)
def paged_logits(params, inputs, meta, cfg, kv_format, num_blocks, block_size, backend, platform):
    """`inputs [B, S]` -> logits `[B, S, V]` through the paged forward and a fresh cache."""
    bsz, n = inputs.shape
    cache = init_cache(cfg, num_blocks, block_size, kv_format=kv_format, platform=platform)
    meta = dataclasses.replace(meta, tokens=inputs.reshape(-1))  # [B*S], rows in window order
    logits, _ = forward(params, cfg, meta, cache, backend=backend)  # [B*S, V]
    return logits.reshape(bsz, n, -1)


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def dense_logits(params, inputs, cfg, backend):
    return forward_dense(params, cfg, inputs, backend=backend)  # [B, S, V] float32


def logits_fn(cfg, params, kv_format, block_size: int, backend: str, batch_size: int):
    """A host function `inputs [batch_size, S] -> logits [batch_size, S, V]` for one model.

    kv_format None: the dense forward. Otherwise the paged forward over a `kv_format` cache, in
    sub-batches of at most PAGED_BATCH_SIZE windows (the largest divisor of batch_size).
    """
    platform = resolve_platform()  # once per model, on the host: static in the jitted calls
    if kv_format is None:
        dense_backend = resolve_backend("auto", platform)  # as forward_dense's default
        return lambda inputs: dense_logits(params, inputs, cfg, dense_backend)
    sub = max(d for d in range(1, min(batch_size, PAGED_BATCH_SIZE) + 1) if batch_size % d == 0)

    def run(inputs):
        meta, num_blocks = paged_layout(sub, inputs.shape[1], block_size)
        meta = jax.tree.map(jnp.asarray, meta)
        call = functools.partial(
            paged_logits, cfg=cfg, kv_format=kv_format, num_blocks=num_blocks,
            block_size=block_size, backend=backend, platform=platform,
        )  # fmt: skip
        parts = [call(params, inputs[i : i + sub], meta) for i in range(0, inputs.shape[0], sub)]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    return run
