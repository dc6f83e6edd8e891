"""SmoothQuant (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training Quantization
for Large Language Models"): W8A8 with activation outliers migrated into the weights.

Per-token int8 activations lose the small channels when a few channels carry outliers. A
per-input-channel smoothing factor moves the difficulty into the weights, where it is per
output channel and harmless:

  s_j = max|X_j|^α / max|W_j|^(1−α)      (α: migration strength, 0.5 by default)
  y = x W = (x / s) (diag(s) W)

The division by s folds exactly into the RMSNorm weight that produces x (or into w_up's output
columns for w_down's input), so the float model is unchanged; then every linear is quantized to
int8 per output channel and runs with dynamic per-token int8 activations (`Int8Weight` with
`act_quant=True`, int8 × int8 → int32 in `ops.linear`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.qtensor import Int8Weight
from jaxinfer.quant.rtn import quantize_int8

_MIN_SCALE = 1e-5


def smooth_scales(
    act_absmax: jax.Array, ws: tuple[jax.Array, ...], alpha: float = 0.5
) -> jax.Array:
    """The smoothing factors of the linears `ws` that share one input.

    Args:
      act_absmax: `[in]` max |x| per input channel over the calibration tokens.
      ws: dense weights `[in, out_i]` reading that input.
      alpha: migration strength in [0, 1] (0: no smoothing of activations, 1: all into weights).

    Returns:
      `[in]` float32 factors s (x is divided by s, weight rows multiplied by s). Channels with
      no activation or no weight keep s = 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r}; expected a migration strength in [0, 1]")
    a = act_absmax.astype(jnp.float32)
    wmax = jnp.max(jnp.stack([jnp.max(jnp.abs(w.astype(jnp.float32)), axis=1) for w in ws]), 0)
    s = jnp.maximum(a, _MIN_SCALE) ** alpha / jnp.maximum(wmax, _MIN_SCALE) ** (1.0 - alpha)
    return jnp.where((a > 0) & (wmax > 0), jnp.maximum(s, _MIN_SCALE), 1.0)


def smoothquant_weight(w: jax.Array, s: jax.Array | None = None) -> Int8Weight:
    """W8A8 weight of a linear whose input is divided by `s` (None: unsmoothed).

    Args:
      w: `[in, out]` dense weight.
      s: optional `[in]` smoothing factors.

    Returns:
      `Int8Weight` with `act_quant=True` of diag(s) W.
    """
    w32 = w.astype(jnp.float32)
    if s is not None:
        w32 = w32 * s[:, None]
    return quantize_int8(w32, act_quant=True)
