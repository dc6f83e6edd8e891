"""Activation statistics of calibration: the inputs of each linear, from the model's own layer.

The taps are the intermediates `decoder_layer_dense_taps` returns, the model's layer itself (so
the calibration sees what the model computes, activation included):

  attn_in  = rms_norm(x) · attn_norm           -> wq, wk, wv
  o_in     = attention output                  -> wo
  mlp_in   = rms_norm(x') · mlp_norm           -> w_gate, w_up
  down_in  = act(mlp_in @ w_gate) · (mlp_in @ w_up)  -> w_down   (act: cfg.hidden_act)

Per tap and calibration mini-batch: XᵀX, max|x| and Σ|x| per channel (sums, not means; the
driver adds the mini-batches with `sum_stats`). Every function is jitted once per shape and
reused by every layer (the layers share shapes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.decoder import decoder_layer_dense, decoder_layer_dense_taps
from jaxinfer.qtensor import dequantize, is_quantized

INPUT_OF = {  # linear -> the tap it reads
    "wq": "attn_in",
    "wk": "attn_in",
    "wv": "attn_in",
    "wo": "o_in",
    "w_gate": "mlp_in",
    "w_up": "mlp_in",
    "w_down": "down_in",
}
# GPTQ true-sequential order: (tap, linears reading it). Each tap after the first is recomputed
# through the layer with every earlier group already quantized.
SEQUENTIAL_GROUPS = (
    ("attn_in", ("wq", "wk", "wv")),
    ("o_in", ("wo",)),
    ("mlp_in", ("w_gate", "w_up")),
    ("down_in", ("w_down",)),
)
_HI = jax.lax.Precision.HIGHEST


def activation_stats(t: jax.Array) -> dict:
    """{"xtx" `[dim, dim]`, "absmax" `[dim]`, "abssum" `[dim]`} of `t [..., dim]` in float32."""
    t = t.reshape(-1, t.shape[-1]).astype(jnp.float32)  # [T, dim]
    return {
        "xtx": jnp.dot(t.T, t, precision=_HI),  # [dim, dim]
        "absmax": jnp.max(jnp.abs(t), axis=0),  # [dim]
        "abssum": jnp.sum(jnp.abs(t), axis=0),  # [dim]
    }


@functools.partial(jax.jit, static_argnames="cfg")
def tap_stats(lp: dict, x: jax.Array, cfg: ModelConfig) -> dict:
    """Per-tap statistics of one calibration mini-batch `x [B, S, E]` (sums, not means)."""
    _, taps = decoder_layer_dense_taps(x, lp, cfg)
    return {name: activation_stats(t) for name, t in taps.items()}


@functools.partial(jax.jit, static_argnames=("cfg", "tap"))
def partial_tap_stats(lp: dict, x: jax.Array, cfg: ModelConfig, tap: str) -> dict:
    """Statistics of one tap of `x [B, S, E]` through a partly quantized layer (true sequential).

    Quantized linears of `lp` are dequantized to x's dtype (`linear(x, w) == x @ dequantize(w)`
    on the XLA path), so the tap is what the layer's quantized earlier linears produce. Compiles
    once per tap: the layers share shapes and the set of linears quantized before each tap.
    """
    lp = {k: dequantize(v, x.dtype) if is_quantized(v) else v for k, v in lp.items()}
    _, taps = decoder_layer_dense_taps(x, lp, cfg)
    return activation_stats(taps[tap])  # XLA drops the parts of the layer after the tap


@functools.partial(jax.jit, static_argnames="cfg")
def tap_samples(lp: dict, x: jax.Array, cfg: ModelConfig) -> dict:
    """The taps of `x [B, S, E]` flattened to `[B*S, dim]` (AWQ's search subsample)."""
    _, taps = decoder_layer_dense_taps(x, lp, cfg)
    return {name: t.reshape(-1, t.shape[-1]) for name, t in taps.items()}


@functools.partial(jax.jit, static_argnames="cfg")
def layer_forward(lp: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The model's own dense layer, to advance the hidden states through a quantized layer."""
    return decoder_layer_dense(x, lp, cfg)


def sum_stats(parts: list[dict]) -> dict:
    """Adds per-mini-batch `{tap: stats}`; absmax is a max, not a sum."""
    total = parts[0]
    for p in parts[1:]:
        total = jax.tree.map(jnp.add, total, p)
    for tap in total:
        total[tap]["absmax"] = functools.reduce(jnp.maximum, [p[tap]["absmax"] for p in parts])
    return total


def check_finite(stats: dict, layer: int) -> None:
    """ValueError naming the layer and tap when a tap's statistics hold NaN or Inf."""
    for tap, st in stats.items():
        if not bool(jnp.all(jnp.isfinite(st["xtx"]))):
            raise ValueError(f"layer {layer}: calibration activations {tap!r} contain NaN or Inf")


def relative_error(H: jax.Array, w: jax.Array, qw) -> jax.Array:
    """‖X(W − Ŵ)‖² / ‖XW‖² from H ∝ XᵀX (`[in, in]`), w `[in, out]`, qw quantized (0 if XW = 0)."""
    w = w.astype(jnp.float32)
    d = w - dequantize(qw, jnp.float32)  # [in, out]
    num = jnp.sum(d * jnp.dot(H, d, precision=_HI))
    den = jnp.sum(w * jnp.dot(H, w, precision=_HI))
    return jnp.where(den > 0, num / den, 0.0)
