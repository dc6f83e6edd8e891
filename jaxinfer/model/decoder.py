"""The decoder over the layers, paged (`forward`) or dense (`forward_dense`).

Both forwards share every layer function; `forward` serves prefill, chunked prefill, decode and
speculative verification over the ragged batch of `BatchMetadata`, in any mix. `forward` runs a
Python loop over the unrolled params form (`inference_layout`) or one `lax.scan` over the stacked
one; `forward_dense` (training, scoring, calibration: large batches) scans the stacked form and
loops over the unrolled one (a server scores prompts with its engine's laid-out params).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.cache.metadata import BatchMetadata
from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.config import ModelConfig
from jaxinfer.model.attention import dense_attention_heads, paged_attention_block
from jaxinfer.model.layers import layer_gated_activation, rms_norm
from jaxinfer.model.params import lm_head
from jaxinfer.ops.backend import resolve_backend
from jaxinfer.ops.linear import linear


def mlp_block(x: jax.Array, lp: dict, cfg: ModelConfig, backend: str = "auto") -> jax.Array:
    """Residual MLP sub-block: `x [..., E]` -> `x + mlp(norm(x))`."""
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    a = layer_gated_activation(h, lp, backend, cfg.hidden_act)  # [..., F]
    return x + linear(a, lp["w_down"], backend=backend)


def logits_from_hidden(
    params: dict, cfg: ModelConfig, x: jax.Array, backend: str = "auto"
) -> jax.Array:
    """Final norm and LM head: `[..., E]` -> float32 logits `[..., V]`."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return linear(x, lm_head(params), backend=backend).astype(jnp.float32)


def forward(
    params: dict,
    cfg: ModelConfig,
    batch: BatchMetadata,
    cache: PagedKVCache,
    *,
    backend: str = "auto",
    return_hidden: bool | tuple[int, ...] = False,
) -> tuple[jax.Array, PagedKVCache] | tuple[jax.Array, PagedKVCache, jax.Array]:
    """Runs the ragged paged batch through the model, writing its K/V into the cache.

    Args:
      params: the params pytree (dense or quantized linears), stacked or unrolled
        (`jaxinfer.model.params.inference_layout`; faster inside a compiled decode loop).
      cfg: the model config (static).
      batch: the step's metadata; `batch.tokens [T]`.
      cache: the paged KV cache; the new K/V are written through `batch.slot_mapping`.
      backend: attention backend, see `jaxinfer.ops.BACKENDS`.
      return_hidden: also return the last layer's output (before the final norm) of every row,
        the features a learned drafter (EAGLE, Medusa) reads, without a second pass; a tuple
        of layer indices returns those layers' outputs instead, concatenated (EAGLE-3).

    Returns:
      (logits `[N, V]` float32 of the rows `batch.logits_indices`, the updated cache), and with
      return_hidden the hidden states `[T, E]` (`[T, n·E]` for n layers) as a third element.
    """
    # "auto" resolved once here, for the cache's platform, not by every op of every layer.
    backend = resolve_backend(backend, cache.platform)
    x = params["embed"][batch.tokens]  # [T, E]
    taps = _Taps(cfg, return_hidden, x)

    def layer(carry, xs):
        x, cache, kept = carry
        lp, i = xs
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        attn, cache = paged_attention_block(h, lp, cfg, batch, cache, i, backend)
        x = mlp_block(x + attn, lp, cfg, backend)
        return (x, cache, taps.keep(kept, x, i)), None

    if isinstance(params["layers"], tuple | list):  # unrolled form: one Python loop
        if len(params["layers"]) != cfg.num_layers:
            raise ValueError(
                f"params hold {len(params['layers'])} layers, cfg.num_layers={cfg.num_layers}"
            )
        # Inside a jit, one trace serves every layer of the same shapes: a nested jit with the
        # index traced. XLA inlines its calls (the index a constant again: the optimized program
        # is the one the plain loop gives), and tracing and lowering each of SmolLM2's 30 layers
        # on its own cost ~4 s of each step shape's compilation. Called eagerly, the plain loop.
        tracing = isinstance(x, jax.core.Tracer)
        run = jax.jit(layer) if tracing else layer
        kept = taps.init
        for i, lp in enumerate(params["layers"]):
            (x, cache, kept), _ = run((x, cache, kept), (lp, jnp.int32(i) if tracing else i))
    else:  # stacked form: one scan (weights sliced per layer; see `inference_layout`)
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, cache, kept), _ = jax.lax.scan(
            layer, (x, cache, taps.init), (params["layers"], layer_ids)
        )
    logits = logits_from_hidden(params, cfg, x[batch.logits_indices], backend)
    return (logits, cache, taps.hidden(kept, x)) if return_hidden else (logits, cache)


class _Taps:
    """The hidden states `forward(..., return_hidden=...)` keeps: none, the last layer's (the
    output itself), or the outputs of chosen layers, carried through the layers as `[n, ..., E]`
    (a select per layer; no stack of every layer's output)."""

    def __init__(self, cfg: ModelConfig, return_hidden: bool | tuple[int, ...], x: jax.Array):
        self.layers = None
        if not isinstance(return_hidden, bool):
            layers = tuple(return_hidden)
            if not layers or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.num_layers
                for i in layers
            ):
                raise ValueError(
                    f"return_hidden={return_hidden!r}; expected a bool or layer indices in "
                    f"[0, {cfg.num_layers})"
                )
            self.layers = layers
        n = 0 if self.layers is None else len(self.layers)
        self.init = jnp.zeros((n, *x.shape), x.dtype)  # [n, ..., E]

    def keep(self, kept: jax.Array, x: jax.Array, i) -> jax.Array:
        if self.layers is None:
            return kept
        hit = jnp.asarray(self.layers, jnp.int32) == i  # [n]
        return jnp.where(hit.reshape(-1, *([1] * x.ndim)), x[None], kept)

    def hidden(self, kept: jax.Array, x: jax.Array) -> jax.Array:
        if self.layers is None:
            return x
        return jnp.concatenate(list(kept), axis=-1)  # [..., n·E]


def decoder_layer_dense_taps(
    x: jax.Array, lp: dict, cfg: ModelConfig, backend: str = "auto"
) -> tuple[jax.Array, dict]:
    """One full decoder layer over whole sequences that also returns the inputs of its linears.

    Calibration reads the taps; `decoder_layer_dense` drops them (XLA removes the unused).

    Args:
      x: `[B, S, E]` hidden states entering the layer.
      lp: one layer's params (no leading L axis).
      cfg: the model config (static).
      backend: kernel backend for quantized linears, see `jaxinfer.ops.BACKENDS`.

    Returns:
      (`[B, S, E]` output, taps {"attn_in" [B, S, E] (wq, wk, wv), "o_in" [B, S, H*D] (wo),
      "mlp_in" [B, S, E] (w_gate, w_up), "down_in" [B, S, F] (w_down)}).
    """
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)  # [B, S, E]
    o = dense_attention_heads(h, lp, cfg, backend)  # [B, S, H*D]
    x = x + linear(o, lp["wo"], backend=backend)
    h2 = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)  # [B, S, E]
    a = layer_gated_activation(h2, lp, backend, cfg.hidden_act)  # [B, S, F]
    x = x + linear(a, lp["w_down"], backend=backend)
    return x, {"attn_in": h, "o_in": o, "mlp_in": h2, "down_in": a}


def decoder_layer_dense(
    x: jax.Array, lp: dict, cfg: ModelConfig, backend: str = "auto"
) -> jax.Array:
    """One full decoder layer over whole sequences: `x [B, S, E]` -> `[B, S, E]`."""
    return decoder_layer_dense_taps(x, lp, cfg, backend)[0]


def forward_dense(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    *,
    backend: str = "auto",
    return_hidden: bool | tuple[int, ...] = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scores whole sequences without a cache (training, scoring, calibration).

    Args:
      params: the params pytree.
      cfg: the model config (static).
      tokens: `[B, S]` int32, every sequence starting at position 0.
      backend: kernel backend for quantized linears, see `jaxinfer.ops.BACKENDS`.
      return_hidden: also return the last layer's output `[B, S, E]` (before the final norm);
        a tuple of layer indices: those layers' outputs, concatenated `[B, S, n·E]`.

    Returns:
      logits `[B, S, V]` float32; with return_hidden, (logits, hidden).
    """
    backend = resolve_backend(backend)  # "auto" read once here, not by every op of every layer
    x = params["embed"][tokens]  # [B, S, E]
    taps = _Taps(cfg, return_hidden, x)

    def layer(carry, xs):
        x, kept = carry
        lp, i = xs
        x = decoder_layer_dense(x, lp, cfg, backend)
        return (x, taps.keep(kept, x, i)), None

    kept = taps.init
    if isinstance(params["layers"], tuple | list):  # the unrolled form (an engine's on a CPU)
        for i, lp in enumerate(params["layers"]):
            (x, kept), _ = layer((x, kept), (lp, i))
    else:
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, kept), _ = jax.lax.scan(layer, (x, kept), (params["layers"], layer_ids))
    logits = logits_from_hidden(params, cfg, x, backend)
    return (logits, taps.hidden(kept, x)) if return_hidden else logits
