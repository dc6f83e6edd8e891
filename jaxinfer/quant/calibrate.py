"""The calibration driver: `quantize(cfg, params, QuantConfig(...), calib_tokens) -> qparams`.

Layer by layer, as in the GPTQ and AWQ reference implementations: the calibration hidden states
enter layer l as produced by the *already quantized* layers 0..l-1, so each layer learns to
correct the error it actually receives. For each layer:

  1. the statistics of the inputs of its linears (`stats.tap_stats`: the float layer's own
     intermediates, XᵀX, max|x| and Σ|x| per channel over the calibration mini-batches);
  2. the method's layer function (`LAYER_METHODS`) turns the float layer into a quantized one;
  3. the hidden states advance through the quantized layer (`stats.layer_forward`, the model's
     own layer function).

GPTQ with `true_sequential` (AutoGPTQ's default; off here, where it measured neutral, see
BENCHMARKS.md) goes one step further *inside* the layer: it quantizes the linears in
`SEQUENTIAL_GROUPS` order (q/k/v, o, gate/up, down) and, before each later group, recomputes its
tap through the already quantized earlier groups (`partial_tap_stats`, one more pass over the
mini-batches per group), so wo, w_gate/w_up and w_down are calibrated on the inputs they will
see. Only attn_in's statistics come from step 1 then; the others are replaced.

Scale folding for AWQ and SmoothQuant (exact in float arithmetic):
  attn_in -> attn_norm   mlp_in -> mlp_norm   down_in -> w_up's output columns
  o_in -> wv's output columns (and bv), only without GQA (H == K): with GQA one v channel feeds
          H/K query heads' outputs, so a per-channel scale of wo's input is not a scale of wv's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import rms_norm
from jaxinfer.model.params import LINEAR_NAMES, check_params, lm_head
from jaxinfer.qtensor import resolve_group_size
from jaxinfer.quant import awq, gptq, smoothquant
from jaxinfer.quant.config import QuantConfig, QuantReport
from jaxinfer.quant.rtn import quantize_int8, rtn_quantize
from jaxinfer.quant.stats import (
    INPUT_OF,
    SEQUENTIAL_GROUPS,
    activation_stats,
    check_finite,
    layer_forward,
    partial_tap_stats,
    relative_error,
    sum_stats,
    tap_samples,
    tap_stats,
)

# (tap, linears reading it, where 1/s folds): the scale groups of AWQ and SmoothQuant.
SCALE_GROUPS = (
    ("attn_in", ("wq", "wk", "wv"), "attn_norm"),
    ("mlp_in", ("w_gate", "w_up"), "mlp_norm"),
    ("down_in", ("w_down",), "w_up"),
    ("o_in", ("wo",), "wv"),
)

_rtn_jit = jax.jit(rtn_quantize, static_argnames=("bits", "group_size", "sym", "scale_dtype"))
_int8_jit = jax.jit(quantize_int8, static_argnames=("act_quant",))
_smoothquant_jit = jax.jit(smoothquant.smoothquant_weight)
_relative_error = jax.jit(relative_error)


@dataclasses.dataclass(frozen=True)
class LayerCalibration:
    """One float layer and the calibration activations entering it."""

    lp: dict  # the float layer's params (no leading L axis)
    batches: list  # the calibration mini-batches entering the layer, each [bs, S, E]
    stats: dict  # tap -> `activation_stats` summed over `batches` (attn_in [E], o_in [H*D], ...)
    count: int  # calibration tokens per tap, N·S
    layer: int  # the layer index, for error messages and notes

    def hessian(self, tap: str) -> jax.Array:
        """H = 2 XᵀX / (N·S) of one tap, `[dim, dim]`."""
        return 2.0 * self.stats[tap]["xtx"] / self.count


# --------------------------------------------------------------------------------------------
# Methods: float layer + statistics -> (quantized layer, {linear: relative error})
# --------------------------------------------------------------------------------------------


def _weight_quantizer(qcfg: QuantConfig, dtype, w, clip=None):
    """The method's grid without calibration: RTN int4 / int8, or SmoothQuant's W8A8."""
    if qcfg.method == "smoothquant":
        return _smoothquant_jit(w)
    if qcfg.bits == 8:
        return _int8_jit(w, act_quant=False)
    g = resolve_group_size(qcfg.group_size, w.shape[0])
    return _rtn_jit(w, bits=qcfg.bits, group_size=g, sym=qcfg.sym, scale_dtype=dtype, clip=clip)


def _rtn_layer(c: LayerCalibration, cfg: ModelConfig, qcfg: QuantConfig, notes: list):
    out, errors = dict(c.lp), {}
    for name in LINEAR_NAMES:
        qw = _weight_quantizer(qcfg, jnp.dtype(cfg.dtype), c.lp[name])
        out[name] = qw
        errors[name] = float(_relative_error(c.hessian(INPUT_OF[name]), c.lp[name], qw))
    return out, errors


def _gptq_linear(w, h, qcfg, dtype, where):
    """GPTQ of one float weight `w [in, out]` on its Hessian `h [in, in]`."""
    qw, _, singular = gptq.gptq_core(
        w,
        h,
        bits=qcfg.bits,
        group_size=resolve_group_size(qcfg.group_size, w.shape[0]),
        sym=qcfg.sym,
        damp=float(qcfg.damp),
        act_order=qcfg.act_order,
        static_groups=qcfg.static_groups,
        blocksize=qcfg.blocksize,
        scale_dtype=dtype.name,
    )
    if bool(singular):
        gptq.raise_singular(where, qcfg.damp)
    return qw


def _gptq_layer(c: LayerCalibration, cfg: ModelConfig, qcfg: QuantConfig, notes: list):
    """GPTQ of every linear; with `true_sequential`, each group on its recomputed input.

    Without it every tap is the float layer's. With it only attn_in's statistics are (the layer
    input is the same); every later tap is recomputed over the mini-batches through the linears
    quantized so far. The errors are measured on the inputs GPTQ used.
    """
    dtype = jnp.dtype(cfg.dtype)
    out, errors = dict(c.lp), {}
    for tap, names in SEQUENTIAL_GROUPS:
        if qcfg.true_sequential and tap != "attn_in":
            st = sum_stats([{tap: partial_tap_stats(out, xb, cfg, tap)} for xb in c.batches])
            check_finite(st, c.layer)
            c = dataclasses.replace(c, stats={**c.stats, **st})
        h = c.hessian(tap)  # [dim, dim]
        for name in names:
            qw = _gptq_linear(c.lp[name], h, qcfg, dtype, f"layer {c.layer} {name}")
            out[name], errors[name] = qw, float(_relative_error(h, c.lp[name], qw))
    return out, {name: errors[name] for name in LINEAR_NAMES}


def scale_plan(cfg: ModelConfig, method: str, notes: list[str] | None = None) -> tuple:
    """The `SCALE_GROUPS` that `method` ("awq" or "smoothquant") scales for this model.

    AWQ also scales wo's input through wv's output columns when H == K; SmoothQuant smooths the
    three inputs produced by a norm or by w_up, as in the paper (qkv, gate/up) plus w_down.
    A skipped group is explained in `notes`.
    """
    groups = []
    for tap, names, fold in SCALE_GROUPS:
        if fold == "wv" and (method == "smoothquant" or cfg.num_kv_heads != cfg.num_heads):
            continue
        groups.append((tap, names, fold))
    if method == "awq" and cfg.num_kv_heads != cfg.num_heads and notes is not None:
        notes.append(
            f"AWQ scaling of wo skipped: GQA (H={cfg.num_heads}, K={cfg.num_kv_heads}) leaves "
            f"no exact fold into wv; wo is clipped and quantized unscaled"
        )
    return tuple(groups)


def fold_scales(lp: dict, scales: dict, plan: tuple) -> dict:
    """Folds input-channel scales into one float layer (exact in real arithmetic).

    Args:
      lp: one layer's dense params.
      scales: tap -> `[in]` scales s; the linears reading the tap get rows × s (float32, as
        they are quantized next), the op producing it ÷ s (norm weight, or w_up / wv output
        columns and bv).
      plan: the groups from `scale_plan`.

    Returns:
      The folded layer; its float outputs equal the original layer's.
    """
    lp = dict(lp)
    for tap, names, fold in plan:
        if tap not in scales:
            continue
        s = scales[tap]
        for name in names:
            lp[name] = lp[name].astype(jnp.float32) * s[:, None]
        if fold in ("attn_norm", "mlp_norm"):
            lp[fold] = (lp[fold].astype(jnp.float32) / s).astype(lp[fold].dtype)
        else:  # output columns of w_up or wv (and the v bias)
            lp[fold] = lp[fold].astype(jnp.float32) / s[None, :]
            if fold == "wv" and "bv" in lp:
                lp["bv"] = (lp["bv"].astype(jnp.float32) / s).astype(lp["bv"].dtype)
    return lp


def _scaled_layer(c, cfg, qcfg, plan, scales, clip_of):
    """Folds `scales` into the float layer, then quantizes every linear on its scaled input.

    `clip_of(name, h, w)` is the clipping of one folded weight (None: unclipped).
    """
    dtype = jnp.dtype(cfg.dtype)
    folded = fold_scales(c.lp, scales, plan)
    out, errors = dict(c.lp), {}
    for name in ("attn_norm", "mlp_norm", "bv"):
        if name in folded:
            out[name] = folded[name]
    for name in LINEAR_NAMES:
        tap = INPUT_OF[name]
        h = c.hessian(tap)
        if tap in scales:  # the Hessian of x / s
            h = h / scales[tap][:, None] / scales[tap][None, :]
        w = folded[name]
        qw = _weight_quantizer(qcfg, dtype, w, clip_of(name, h, w))
        out[name], errors[name] = qw, float(_relative_error(h, w, qw))
    return out, errors


def _awq_layer(c: LayerCalibration, cfg: ModelConfig, qcfg: QuantConfig, notes: list):
    dtype = jnp.dtype(cfg.dtype)
    plan = scale_plan(cfg, "awq", notes if c.layer == 0 else None)
    bs, s = c.batches[0].shape[:2]
    n_awq = max(1, min(len(c.batches), qcfg.awq_max_tokens // (bs * s)))  # the search sample
    parts = [tap_samples(c.lp, xb, cfg) for xb in c.batches[:n_awq]]
    samples = {t: jnp.concatenate([p[t] for p in parts]) for t in parts[0]}  # [T', dim]
    scales = {}
    for tap, names, _ in plan:
        ws = tuple(c.lp[n] for n in names)
        scales[tap], _, _ = awq.awq_search(
            samples[tap], c.stats[tap]["abssum"] / c.count, ws, bits=qcfg.bits,
            group_size=resolve_group_size(qcfg.group_size, ws[0].shape[0]), sym=qcfg.sym,
            n_grid=qcfg.awq_grid, scale_dtype=dtype.name,
        )  # fmt: skip

    def clip_of(name, h, w):
        # AWQ's reference leaves q/k unclipped: their errors are amplified by the softmax.
        if not qcfg.awq_clip or name in ("wq", "wk"):
            return None
        g = resolve_group_size(qcfg.group_size, w.shape[0])
        clip, _ = awq.awq_clip_search(
            awq.gram_from_xtx(h, g), w, bits=qcfg.bits, group_size=g, sym=qcfg.sym,
            scale_dtype=dtype.name,
        )  # fmt: skip
        return clip

    return _scaled_layer(c, cfg, qcfg, plan, scales, clip_of)


def _smoothquant_layer(c: LayerCalibration, cfg: ModelConfig, qcfg: QuantConfig, notes: list):
    plan = scale_plan(cfg, "smoothquant")
    scales = {
        tap: smoothquant.smooth_scales(
            c.stats[tap]["absmax"], tuple(c.lp[n] for n in names), qcfg.alpha
        )
        for tap, names, _ in plan
    }
    return _scaled_layer(c, cfg, qcfg, plan, scales, lambda name, h, w: None)


# method -> (layer calibration, cfg, qcfg, notes) -> (quantized layer, {linear: relative error})
LAYER_METHODS: dict[str, Callable] = {
    "rtn": _rtn_layer,
    "gptq": _gptq_layer,
    "awq": _awq_layer,
    "smoothquant": _smoothquant_layer,
}


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def _check_inputs(cfg: ModelConfig, params: dict, qcfg: QuantConfig, tokens) -> np.ndarray:
    if not isinstance(qcfg, QuantConfig):
        raise ValueError(f"qcfg must be a QuantConfig, got {type(qcfg).__name__}")
    check_params(cfg, params)
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.size == 0:
        raise ValueError(
            f"calib_tokens has shape {tokens.shape}; expected a non-empty [N, S] int array"
        )
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"calib_tokens has dtype {tokens.dtype}; expected integer token ids")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ValueError(
            f"calib_tokens ids span [{tokens.min()}, {tokens.max()}]; expected ids in "
            f"[0, {cfg.vocab_size})"
        )
    if tokens.shape[1] > cfg.max_position_embeddings:
        raise ValueError(
            f"calib_tokens rows have {tokens.shape[1]} tokens; the model's positions end at "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    layers = params["layers"]
    if not isinstance(layers, dict):
        raise ValueError(
            "quantize takes the stored params layout (stacked layers), not ji.inference_layout's"
        )
    for name in LINEAR_NAMES:
        if not isinstance(layers.get(name), jax.Array):
            raise ValueError(f"params['layers'][{name!r}] must be a dense array to quantize")
        d_in = layers[name].shape[1]
        g = resolve_group_size(qcfg.group_size, d_in)
        if qcfg.bits != 8 and (d_in % g or d_in % 8):
            raise ValueError(
                f"group_size={qcfg.group_size} does not divide the input dimension {d_in} of "
                f"{name} (or {d_in} is not a multiple of 8)"
            )
    if (
        qcfg.quantize_lm_head
        and qcfg.bits != 8
        and cfg.hidden_size % resolve_group_size(qcfg.group_size, cfg.hidden_size)
    ):
        raise ValueError(
            f"group_size={qcfg.group_size} does not divide the LM head's input dimension "
            f"{cfg.hidden_size}"
        )
    return tokens.astype(np.int32)


def _batch_size(n: int, want: int) -> int:
    """Largest divisor of n that is <= want: every mini-batch has one shape, one compile."""
    return max(d for d in range(1, min(n, want) + 1) if n % d == 0)


def _batch_size(n: int, want: int) -> int:
    """Largest divisor of n that is <= want: every mini-batch has one shape, one compile."""
    return max(d for d in range(1, min(n, want) + 1) if n % d == 0)


def quantize_with_report(
    cfg: ModelConfig,
    params: dict,
    qcfg: QuantConfig,
    calib_tokens,
    *,
    progress: bool = False,
) -> tuple[dict, QuantReport]:
    """Quantizes a model layer by layer and reports the per-layer errors.

    Args:
      cfg: the model config.
      params: dense params pytree.
      qcfg: the method and its settings.
      calib_tokens: `[N, S]` int calibration token ids (RTN uses them only for the report).
      progress: show a progress bar over layers.

    Returns:
      (qparams: the params pytree with every decoder linear replaced by an `Int4Weight` or
      `Int8Weight` stacked over layers, norms rescaled for AWQ / SmoothQuant, and `lm_head`
      quantized when asked; the `QuantReport`). Raises ValueError for bad inputs, non-finite
      calibration activations and (GPTQ) a Hessian that stays singular after dampening.
    """
    start = time.perf_counter()
    tokens = _check_inputs(cfg, params, qcfg, calib_tokens)
    n, s = tokens.shape
    bs = _batch_size(n, qcfg.batch_size)
    x = params["embed"][jnp.asarray(tokens)]  # [N, S, E] as in forward_dense
    method = LAYER_METHODS[qcfg.method]

    notes: list[str] = []
    qlayers, errors = [], []
    layer_ids = range(cfg.num_layers)
    if progress:
        from tqdm import tqdm

        layer_ids = tqdm(layer_ids, desc=f"{qcfg.method} layers")
    for layer in layer_ids:
        lp = jax.tree.map(lambda a, i=layer: a[i], params["layers"])
        batches = [x[i : i + bs] for i in range(0, n, bs)]  # each [bs, S, E]
        stats = sum_stats([tap_stats(lp, xb, cfg) for xb in batches])
        check_finite(stats, layer)
        calib = LayerCalibration(lp, batches, stats, count=n * s, layer=layer)
        qlp, errs = method(calib, cfg, qcfg, notes)
        x = jnp.concatenate([layer_forward(qlp, xb, cfg) for xb in batches])
        qlayers.append(qlp)
        errors.append(errs)

    qparams = dict(params)
    qparams["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *qlayers)
    report = QuantReport(qcfg.method, 0.0, errors, notes=notes)
    if qcfg.quantize_lm_head:
        qparams["lm_head"], report.lm_head_error = _quantize_head(params, cfg, qcfg, x, n * s)
        if cfg.tie_word_embeddings:
            notes.append("tied embeddings: the quantized lm_head is stored beside the embedding")
    report.seconds = time.perf_counter() - start
    return qparams, report


def _quantize_head(params, cfg, qcfg, x, count):
    """The LM head: GPTQ on the final hidden states for gptq, the method's grid otherwise."""
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)  # [N, S, E]
    H = 2.0 * activation_stats(h)["xtx"] / count
    w = lm_head(params)  # [E, V]
    if qcfg.method == "gptq":
        qw, _ = gptq.gptq_quantize(
            w, H, bits=qcfg.bits, group_size=qcfg.group_size, sym=qcfg.sym, damp=qcfg.damp,
            act_order=qcfg.act_order, static_groups=qcfg.static_groups,
            blocksize=qcfg.blocksize, scale_dtype=cfg.dtype, name="lm_head",
        )  # fmt: skip
    else:
        qw = _weight_quantizer(qcfg, jnp.dtype(cfg.dtype), w)
    return qw, float(_relative_error(H, w, qw))


def quantize(cfg: ModelConfig, params: dict, qcfg: QuantConfig, calib_tokens) -> dict:
    """`quantize_with_report` without the report: the quantized params pytree.

    Args:
      cfg: the model config.
      params: dense params pytree.
      qcfg: the method and its settings.
      calib_tokens: `[N, S]` int calibration token ids.

    Returns:
      The quantized params (see `quantize_with_report`).
    """
    return quantize_with_report(cfg, params, qcfg, calib_tokens)[0]
