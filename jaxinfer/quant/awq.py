"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression").

Salient input channels (large mean |activation|) are protected by scaling them up before
quantization and folding the inverse scale into the op that produces the activations:

  y = x W = (x / s) (diag(s) W)  ≈  (x / s) Q(diag(s) W)

with s = mean|x|^α normalised to geometric mid-range 1, and α chosen on a grid in [0, 1) to
minimise the output error of every linear that shares the input x (α = 0 is s = 1, plain RTN,
so the chosen loss is never above RTN's). Then the range of each group may be clipped (shrunk by
a ratio on a grid) to minimise that group's output error: the error of group g, output n is
d_gnᵀ (X_gᵀ X_g) d_gn with d the weight error, so only the diagonal blocks of XᵀX are needed.

This module is the per-group math (weights and activations in, scales and ratios out). Which
linears share an input and where the scales fold (RMSNorm weights, w_up's output columns, wv's
output columns without GQA) is the calibration driver's business (`calibrate.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.quant.rtn import rtn_fake_quantize

_HI = lax.Precision.HIGHEST
_MIN_SCALE = 1e-4


def awq_scales(x_mean: jax.Array, alpha: jax.Array | float) -> jax.Array:
    """s = x_mean^α, normalised so that sqrt(max(s) · min(s)) = 1.

    Args:
      x_mean: `[in]` mean |activation| per input channel.
      alpha: the exponent (0: no scaling).

    Returns:
      `[in]` float32 scales, all >= 1e-4 before normalisation.
    """
    s = jnp.maximum(x_mean.astype(jnp.float32), _MIN_SCALE) ** alpha
    return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


def scaled_quant_loss(
    x: jax.Array,
    ws: tuple[jax.Array, ...],
    s: jax.Array,
    *,
    bits: int,
    group_size: int,
    sym: bool,
    scale_dtype=jnp.float32,
) -> jax.Array:
    """Σ over the linears of mean((x W − (x / s) Q(diag(s) W))²).

    Args:
      x: `[T, in]` calibration inputs shared by the linears.
      ws: dense weights `[in, out_i]`.
      s: `[in]` input-channel scales (ones: plain RTN).
      bits, group_size, sym, scale_dtype: the quantization grid.

    Returns:
      Scalar float32 loss.
    """
    x = x.astype(jnp.float32)
    xs = x / s  # [T, in]
    loss = jnp.float32(0.0)
    for w in ws:
        w = w.astype(jnp.float32)
        wq = rtn_fake_quantize(
            w * s[:, None], bits=bits, group_size=group_size, sym=sym, scale_dtype=scale_dtype
        )  # [in, out]
        ref = jnp.dot(x, w, precision=_HI)  # [T, out]
        loss = loss + jnp.mean((ref - jnp.dot(xs, wq, precision=_HI)) ** 2)
    return loss


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sym", "n_grid", "scale_dtype"))
def awq_search(
    x: jax.Array,
    x_mean: jax.Array,
    ws: tuple[jax.Array, ...],
    *,
    bits: int,
    group_size: int,
    sym: bool,
    n_grid: int = 20,
    scale_dtype: str = "float32",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Grid search of the scaling exponent α ∈ {0, 1/n, ..., (n−1)/n}.

    Args:
      x: `[T, in]` calibration inputs (a token subsample) shared by the linears `ws`.
      x_mean: `[in]` mean |x| per channel (over all calibration tokens).
      ws: the dense weights `[in, out_i]` that read x.
      bits, group_size, sym, scale_dtype: the quantization grid (group_size resolved).
      n_grid: grid points.

    Returns:
      (scales `[in]` of the best α, best α, losses `[n_grid]`; losses[0] is α = 0 i.e. RTN).
    """
    alphas = jnp.arange(n_grid, dtype=jnp.float32) / n_grid  # [n_grid]
    grid = dict(bits=bits, group_size=group_size, sym=sym, scale_dtype=jnp.dtype(scale_dtype))

    def loss_at(alpha):
        return scaled_quant_loss(x, ws, awq_scales(x_mean, alpha), **grid)

    losses = lax.map(loss_at, alphas)  # [n_grid], one α at a time (bounded memory)
    losses = jnp.where(jnp.isfinite(losses), losses, jnp.inf)
    best = jnp.argmin(losses)  # first minimum: ties keep the smaller α (α = 0 first)
    return awq_scales(x_mean, alphas[best]), alphas[best], losses


def clip_ratios(max_shrink: float = 0.5, n_grid: int = 20) -> tuple[float, ...]:
    """AWQ's clipping grid: 1, 1 − 1/n, ..., down to (but excluding) 1 − max_shrink."""
    return tuple(1.0 - i / n_grid for i in range(int(max_shrink * n_grid)))


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sym", "ratios", "scale_dtype"))
def awq_clip_search(
    gram: jax.Array,
    w: jax.Array,
    *,
    bits: int,
    group_size: int,
    sym: bool,
    ratios: tuple[float, ...] = clip_ratios(),
    scale_dtype: str = "float32",
) -> tuple[jax.Array, jax.Array]:
    """Per-(group, output) range shrink ratio minimising that group's output error.

    Args:
      gram: `[in/G, G, G]` diagonal blocks of XᵀX of the weight's (already scaled) inputs.
      w: `[in, out]` dense (already scaled) weight.
      bits, group_size, sym, scale_dtype: the quantization grid.
      ratios: candidate ratios; include 1.0 so clipping never increases the error.

    Returns:
      (ratios `[in/G, out]` float32, errors `[in/G, out]` at those ratios).
    """
    d_in, d_out = w.shape
    ng = d_in // group_size
    w = w.astype(jnp.float32)
    wg = w.reshape(ng, group_size, d_out)  # [g, G, out]
    grid = dict(bits=bits, group_size=group_size, sym=sym, scale_dtype=jnp.dtype(scale_dtype))

    def err_at(r):
        d = wg - rtn_fake_quantize(w, clip=r, **grid).reshape(ng, group_size, d_out)
        return jnp.einsum("gkn,gkl,gln->gn", d, gram, d, precision=_HI)  # [g, out]

    r = jnp.asarray(ratios, jnp.float32)  # [R]
    errs = lax.map(err_at, r)  # [R, g, out]
    best = jnp.argmin(errs, axis=0)  # [g, out]; ties keep the earlier (larger) ratio
    return r[best], jnp.take_along_axis(errs, best[None], axis=0)[0]


def gram_blocks(x: jax.Array, group_size: int) -> jax.Array:
    """Diagonal `[in/G, G, G]` blocks of XᵀX for `x [T, in]` (float32)."""
    t, d_in = x.shape
    xg = x.astype(jnp.float32).reshape(t, d_in // group_size, group_size)  # [T, g, G]
    return jnp.einsum("tgk,tgl->gkl", xg, xg, precision=_HI)


def gram_from_xtx(xtx: jax.Array, group_size: int) -> jax.Array:
    """Diagonal `[in/G, G, G]` blocks of a full `[in, in]` XᵀX."""
    ng = xtx.shape[0] // group_size
    blocks = xtx.reshape(ng, group_size, ng, group_size)  # [g, G, g', G]
    idx = jnp.arange(ng)
    return blocks[idx, :, idx, :]  # [g, G, G]
