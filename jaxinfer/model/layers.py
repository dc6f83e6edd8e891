"""The layer functions shared by the paged and the dense forward: RMSNorm, RoPE, the gated MLP."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.ops.linear import linear


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32 (as HF does), weight applied after casting back: `[..., E]`."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    normed = (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return weight.astype(x.dtype) * normed


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies `[D/2]` float32, with linear or llama3 scaling. Static: numpy."""
    d = cfg.head_dim
    inv_freq = 1.0 / (
        np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    )
    inv_freq = inv_freq.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None or rs.rope_type == "default":
        return inv_freq
    if rs.rope_type == "linear":
        return (inv_freq / np.float32(rs.factor)).astype(np.float32)
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated, so the model keeps local resolution while its context stretches.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotates `x [..., T, heads, D]` by `positions [..., T]` (HF's rotate-half layout)."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, D/2]
    cos = jnp.cos(angles)[..., None, :].astype(x.dtype)  # [..., T, 1, D/2]
    sin = jnp.sin(angles)[..., None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)  # [..., T, heads, D/2] each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# cfg.hidden_act -> the gate activation, as transformers' ACT2FN computes it (keys: HIDDEN_ACTS).
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # exact: x·Φ(x) through erf
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),  # the tanh approximation
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def gated_activation(x: jax.Array, w_gate, w_up, backend: str = "auto", act: str = "silu"):
    """act(gate(x)) * up(x), the input of the MLP's down projection: `[..., E] -> [..., F]`."""
    gate = linear(x, w_gate, backend=backend)  # [..., F]
    up = linear(x, w_up, backend=backend)  # [..., F]
    return ACTIVATIONS[act](gate) * up


def layer_gated_activation(x: jax.Array, lp: dict, backend: str = "auto", act: str = "silu"):
    """`gated_activation` from one layer's params: `w_gate` and `w_up`, or the CPU layout's
    fused `w_gate_up` (`model.params.cpu_layout`: one `[E, 2F]` product, gate then up)."""
    if "w_gate_up" in lp:
        gate, up = jnp.split(linear(x, lp["w_gate_up"], backend=backend), 2, axis=-1)
        return ACTIVATIONS[act](gate) * up  # [..., F]
    return gated_activation(x, lp["w_gate"], lp["w_up"], backend, act)


def swiglu(
    x: jax.Array, w_gate, w_up, w_down, backend: str = "auto", act: str = "silu"
) -> jax.Array:
    """The gated MLP: down(act(gate(x)) * up(x)); `[..., E] -> [..., E]`.

    `act` is `cfg.hidden_act`: SiLU makes it Llama's SwiGLU, GELU the GeGLU of GELU checkpoints.
    """
    return linear(gated_activation(x, w_gate, w_up, backend, act), w_down, backend=backend)
