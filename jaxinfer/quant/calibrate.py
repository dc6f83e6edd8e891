"""The calibration driver: `quantize(cfg, params, QuantConfig(...), calib_tokens) -> qparams`.

Layer by layer, as in the GPTQ and AWQ reference implementations: the calibration hidden states
enter layer l as produced by the *already quantized* layers 0..l-1, so each layer learns to
correct the error it actually receives. For each layer:

  1. taps: the inputs of its linears, from the float layer (`layer_taps`):
       attn_in  = rms_norm(x) · attn_norm        -> wq, wk, wv
       o_in     = attention output               -> wo
       mlp_in   = rms_norm(x') · mlp_norm        -> w_gate, w_up
       down_in  = silu(mlp_in @ w_gate) · (mlp_in @ w_up)  -> w_down
     accumulated over calibration mini-batches into XᵀX, max|x| and Σ|x| per channel;
  2. the method turns the float layer into a quantized one (RTN, GPTQ, AWQ, SmoothQuant);
  3. the hidden states advance through the quantized layer (`decoder_layer_dense`, the model's
     own layer function).

GPTQ with `true_sequential` (AutoGPTQ's default; off here, where it measured neutral, see
BENCHMARKS.md) goes one step further *inside* the layer: it quantizes the linears in
`SEQUENTIAL_GROUPS` order (q/k/v, o, gate/up, down) and, before each later group, recomputes its
tap through the already quantized earlier groups (`partial_tap_stats`, one more pass over the
mini-batches per group), so wo, w_gate/w_up and w_down are calibrated on the inputs they will
see. Only attn_in's statistics come from step 1 then; the others are replaced.

Every per-layer function is jitted once and reused by every layer (the layers share shapes).
Scale folding for AWQ and SmoothQuant (exact in float arithmetic):
  attn_in -> attn_norm   mlp_in -> mlp_norm   down_in -> w_up's output columns
  o_in -> wv's output columns (and bv), only without GQA (H == K): with GQA one v channel feeds
          H/K query heads' outputs, so a per-channel scale of wo's input is not a scale of wv's.
The model itself is imported from `jaxinfer.model`; `layer_taps` is composed from its public
layer functions, and a test checks it reproduces `decoder_layer_dense`.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model.attention import project_qkv
from jaxinfer.model.decoder import decoder_layer_dense
from jaxinfer.model.layers import rms_norm
from jaxinfer.model.params import LINEAR_NAMES, check_params, lm_head
from jaxinfer.ops.attention import dense_causal_attention
from jaxinfer.ops.linear import linear
from jaxinfer.qtensor import INT4_BITS, dequantize, is_quantized, resolve_group_size
from jaxinfer.quant import awq, gptq, smoothquant
from jaxinfer.quant.rtn import quantize_int8, rtn_quantize

METHODS = ("rtn", "gptq", "awq", "smoothquant")
_BITS = {"rtn": (2, 3, 4, 8), "gptq": INT4_BITS, "awq": INT4_BITS, "smoothquant": (8,)}
INPUT_OF = {  # linear -> the tap it reads
    "wq": "attn_in",
    "wk": "attn_in",
    "wv": "attn_in",
    "wo": "o_in",
    "w_gate": "mlp_in",
    "w_up": "mlp_in",
    "w_down": "down_in",
}
# (tap, linears reading it, where 1/s folds): the scale groups of AWQ and SmoothQuant.
SCALE_GROUPS = (
    ("attn_in", ("wq", "wk", "wv"), "attn_norm"),
    ("mlp_in", ("w_gate", "w_up"), "mlp_norm"),
    ("down_in", ("w_down",), "w_up"),
    ("o_in", ("wo",), "wv"),
)
# GPTQ true-sequential order: (tap, linears reading it). Each tap after the first is recomputed
# through the layer with every earlier group already quantized.
SEQUENTIAL_GROUPS = (
    ("attn_in", ("wq", "wk", "wv")),
    ("o_in", ("wo",)),
    ("mlp_in", ("w_gate", "w_up")),
    ("down_in", ("w_down",)),
)
_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How to quantize a model. Frozen and hashable; saved with every artifact."""

    method: str = "rtn"  # "rtn" | "gptq" | "awq" | "smoothquant"
    bits: int = 4  # 2, 3, 4 (Int4Weight); 8: rtn -> W8A16, smoothquant -> W8A8 (its only choice)
    group_size: int | None = 128  # G, a multiple of 8; None (or -1, stored as None): G = in
    sym: bool = False  # symmetric grids (fixed zero point 2**(bits-1))
    damp: float = 0.01  # GPTQ: dampening in [0, 1], fraction of mean(diag H) (the paper's 1%)
    act_order: bool = False  # GPTQ: sweep inputs by decreasing diag(H)
    static_groups: bool = True  # GPTQ act order: grids from the original weights, no perm
    blocksize: int = 128  # GPTQ: rows per lazy-update block
    # GPTQ: calibrate o, gate/up, down on inputs recomputed through the layer's already quantized
    # earlier linears (AutoGPTQ's default; measured neutral here, so off). RTN ignores statistics;
    # AWQ and SmoothQuant ignore it.
    true_sequential: bool = False
    awq_grid: int = 20  # AWQ: grid points of the scaling exponent in [0, 1)
    awq_clip: bool = True  # AWQ: search a clipping ratio per group
    awq_max_tokens: int = 4096  # AWQ: tokens of the subsample the scale search runs on
    alpha: float = 0.5  # SmoothQuant migration strength
    quantize_lm_head: bool = False  # embeddings always stay dense; the head only when asked
    batch_size: int = 8  # calibration sequences per jitted statistics call

    def __post_init__(self):
        # Every field is checked for its kind and range: QuantConfig is the boundary of all
        # calibration code, and a wrong kind (blocksize=2.5, sym="no") would otherwise run.
        # numpy scalars of the right kind are accepted and stored as Python values (hashable,
        # JSON-serialisable).
        def put(name, value):
            object.__setattr__(self, name, value)

        def as_int(name, lo):
            v = getattr(self, name)
            if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer) or v < lo:
                raise ValueError(f"{name}={v!r}; expected an integer >= {lo}")
            put(name, int(v))

        def as_float(name, lo, hi):
            v = getattr(self, name)
            ok = isinstance(v, int | float | np.integer | np.floating) and not isinstance(
                v, bool | np.bool_
            )
            if not ok or not lo <= float(v) <= hi:  # NaN fails the comparison
                raise ValueError(f"{name}={v!r}; expected a number in [{lo}, {hi}]")
            put(name, float(v))

        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; expected one of {METHODS}")
        for name in (
            "sym",
            "act_order",
            "static_groups",
            "true_sequential",
            "awq_clip",
            "quantize_lm_head",
        ):
            v = getattr(self, name)
            if not isinstance(v, bool | np.bool_):
                raise ValueError(f"{name}={v!r}; expected a bool")
            put(name, bool(v))
        as_int("bits", 1)
        if self.bits not in _BITS[self.method]:
            raise ValueError(
                f"bits={self.bits!r} is not supported by {self.method}; expected one of "
                f"{_BITS[self.method]}"
            )
        g = self.group_size
        is_int = isinstance(g, int | np.integer) and not isinstance(g, bool | np.bool_)
        if is_int and g == -1:
            put("group_size", None)  # AutoGPTQ / GPTQModel / AWQ spell per channel -1
        elif g is not None:
            if not is_int or g < 8 or g % 8:
                raise ValueError(
                    f"group_size={g!r}; expected None or -1 (per channel) or a multiple of 8"
                )
            put("group_size", int(g))
        as_float("damp", 0.0, 1.0)  # a fraction of mean(diag H), as AutoGPTQ's damp_percent
        as_float("alpha", 0.0, 1.0)  # SmoothQuant's migration strength
        for name in ("blocksize", "awq_grid", "awq_max_tokens", "batch_size"):
            as_int(name, 1)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown QuantConfig field(s) {unknown}")
        return cls(**d)


@dataclasses.dataclass
class QuantReport:
    """What calibration measured: per-layer relative output errors and wall time."""

    method: str
    seconds: float  # wall time of the whole calibration
    errors: list[dict[str, float]]  # per layer: linear -> ‖X(W − Ŵ)‖² / ‖XW‖² on its inputs
    lm_head_error: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Layer functions (jitted once per shape, shared by every layer)
# --------------------------------------------------------------------------------------------


def layer_taps(lp: dict, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, dict]:
    """One dense decoder layer that also returns the inputs of its linears.

    Args:
      lp: one layer's params (no leading L axis).
      cfg: the model config.
      x: `[B, S, E]` hidden states entering the layer.

    Returns:
      (`[B, S, E]` output, taps {"attn_in" [B,S,E], "o_in" [B,S,H*D], "mlp_in" [B,S,E],
      "down_in" [B,S,F]}).
    """
    bsz, n, _ = x.shape
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)  # [B, S, E]
    positions = jnp.broadcast_to(jnp.arange(n), (bsz, n))
    q, k, v = project_qkv(h, lp, cfg, positions)
    o = dense_causal_attention(q, k, v, sliding_window=cfg.sliding_window)  # [B, S, H, D]
    o = o.reshape(bsz, n, cfg.num_heads * cfg.head_dim)
    x = x + linear(o, lp["wo"])
    h2 = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)  # [B, S, E]
    a = jax.nn.silu(linear(h2, lp["w_gate"])) * linear(h2, lp["w_up"])  # [B, S, F]
    x = x + linear(a, lp["w_down"])
    return x, {"attn_in": h, "o_in": o, "mlp_in": h2, "down_in": a}


def _stats(t: jax.Array) -> dict:
    t = t.reshape(-1, t.shape[-1]).astype(jnp.float32)  # [T, dim]
    return {
        "xtx": jnp.dot(t.T, t, precision=_HI),  # [dim, dim]
        "absmax": jnp.max(jnp.abs(t), axis=0),  # [dim]
        "abssum": jnp.sum(jnp.abs(t), axis=0),  # [dim]
    }


@functools.partial(jax.jit, static_argnames="cfg")
def tap_stats(lp: dict, x: jax.Array, cfg: ModelConfig) -> dict:
    """Per-tap statistics of one calibration mini-batch `x [B, S, E]` (sums, not means)."""
    _, taps = layer_taps(lp, cfg, x)
    return {name: _stats(t) for name, t in taps.items()}


@functools.partial(jax.jit, static_argnames=("cfg", "tap"))
def partial_tap_stats(lp: dict, x: jax.Array, cfg: ModelConfig, tap: str) -> dict:
    """Statistics of one tap of `x [B, S, E]` through a partly quantized layer (true sequential).

    Quantized linears of `lp` are dequantized to x's dtype (`linear(x, w) == x @ dequantize(w)`
    on the XLA path), so the tap is what the layer's quantized earlier linears produce. Compiles
    once per tap: the layers share shapes and the set of linears quantized before each tap.
    """
    lp = {k: dequantize(v, x.dtype) if is_quantized(v) else v for k, v in lp.items()}
    _, taps = layer_taps(lp, cfg, x)
    return _stats(taps[tap])  # XLA drops the parts of the layer after the tap


@functools.partial(jax.jit, static_argnames="cfg")
def tap_samples(lp: dict, x: jax.Array, cfg: ModelConfig) -> dict:
    """The taps of `x [B, S, E]` flattened to `[B*S, dim]` (AWQ's search subsample)."""
    _, taps = layer_taps(lp, cfg, x)
    return {name: t.reshape(-1, t.shape[-1]) for name, t in taps.items()}


@functools.partial(jax.jit, static_argnames="cfg")
def layer_forward(lp: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The model's own dense layer, to advance the hidden states through a quantized layer."""
    return decoder_layer_dense(x, lp, cfg)


@jax.jit
def relative_error(H: jax.Array, w: jax.Array, qw) -> jax.Array:
    """‖X(W − Ŵ)‖² / ‖XW‖² from H ∝ XᵀX (`[in, in]`), w `[in, out]`, qw quantized."""
    w = w.astype(jnp.float32)
    d = w - dequantize(qw, jnp.float32)
    num = jnp.sum(d * jnp.dot(H, d, precision=_HI))
    den = jnp.sum(w * jnp.dot(H, w, precision=_HI))
    return jnp.where(den > 0, num / den, 0.0)


_rtn_jit = jax.jit(rtn_quantize, static_argnames=("bits", "group_size", "sym", "scale_dtype"))
_int8_jit = jax.jit(quantize_int8, static_argnames=("act_quant",))


# --------------------------------------------------------------------------------------------
# Methods: float layer + statistics -> quantized layer
# --------------------------------------------------------------------------------------------


def _weight_quantizer(qcfg: QuantConfig, dtype, w, clip=None):
    """The method-independent part: RTN int4 / int8 of one (possibly scaled) float weight."""
    if qcfg.bits == 8:
        return _int8_jit(w, act_quant=qcfg.method == "smoothquant")
    g = resolve_group_size(qcfg.group_size, w.shape[0])
    return _rtn_jit(w, bits=qcfg.bits, group_size=g, sym=qcfg.sym, scale_dtype=dtype, clip=clip)


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


def _scaled_H(H: jax.Array, s: jax.Array | None) -> jax.Array:
    return H if s is None else H / s[:, None] / s[None, :]


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


def _gptq_sequential(lp, stats, batches, count, cfg, qcfg, layer):
    """True-sequential GPTQ of one float layer -> (quantized layer, {linear: relative error}).

    `stats` are the float layer's (only attn_in's are used: the layer input is the same); every
    later tap is recomputed over `batches` through the linears quantized so far, and its
    statistics replace the float ones. The errors are measured on the inputs GPTQ used.
    """
    dtype = jnp.dtype(cfg.dtype)
    out, errors = dict(lp), {}
    for tap, names in SEQUENTIAL_GROUPS:
        if tap != "attn_in":
            st = _sum_stats([{tap: partial_tap_stats(out, xb, cfg, tap)} for xb in batches])
            _check_finite(st, layer)
            stats = {**stats, **st}
        h = 2.0 * stats[tap]["xtx"] / count  # [dim, dim]
        for name in names:
            qw = _gptq_linear(lp[name], h, qcfg, dtype, f"layer {layer} {name}")
            out[name], errors[name] = qw, float(relative_error(h, lp[name], qw))
    return out, {name: errors[name] for name in LINEAR_NAMES}


def _quantize_layer(lp, stats, samples, count, cfg, qcfg, layer, notes):
    """One float layer -> (quantized layer, {linear: relative error})."""
    dtype = jnp.dtype(cfg.dtype)
    H = {tap: 2.0 * st["xtx"] / count for tap, st in stats.items()}  # [dim, dim] per tap
    out, errors = dict(lp), {}
    if qcfg.method in ("rtn", "gptq"):
        for name in LINEAR_NAMES:
            h = H[INPUT_OF[name]]
            if qcfg.method == "rtn":
                qw = _weight_quantizer(qcfg, dtype, lp[name])
            else:
                qw = _gptq_linear(lp[name], h, qcfg, dtype, f"layer {layer} {name}")
            out[name], errors[name] = qw, float(relative_error(h, lp[name], qw))
        return out, errors

    plan = scale_plan(cfg, qcfg.method, notes if layer == 0 else [])
    scales = {}
    for tap, names, _ in plan:
        ws = tuple(lp[n] for n in names)
        if qcfg.method == "awq":
            g = resolve_group_size(qcfg.group_size, ws[0].shape[0])
            s, _, _ = awq.awq_search(
                samples[tap],
                stats[tap]["abssum"] / count,
                ws,
                bits=qcfg.bits,
                group_size=g,
                sym=qcfg.sym,
                n_grid=qcfg.awq_grid,
                scale_dtype=dtype.name,
            )
        else:
            s = smoothquant.smooth_scales(stats[tap]["absmax"], ws, qcfg.alpha)
        scales[tap] = s
    folded = fold_scales(lp, scales, plan)
    for name in ("attn_norm", "mlp_norm", "bv"):
        if name in folded:
            out[name] = folded[name]
    for name in LINEAR_NAMES:
        tap = INPUT_OF[name]
        h = _scaled_H(H[tap], scales.get(tap))
        w = folded[name]
        clip = None
        # AWQ's reference leaves q/k unclipped: their errors are amplified by the softmax.
        if qcfg.method == "awq" and qcfg.awq_clip and name not in ("wq", "wk"):
            g = resolve_group_size(qcfg.group_size, w.shape[0])
            clip, _ = awq.awq_clip_search(
                awq.gram_from_xtx(h, g), w, bits=qcfg.bits, group_size=g, sym=qcfg.sym,
                scale_dtype=dtype.name,
            )  # fmt: skip
        qw = _weight_quantizer(qcfg, dtype, w, clip)
        out[name], errors[name] = qw, float(relative_error(h, w, qw))
    return out, errors


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


def _check_finite(stats: dict, layer: int) -> None:
    for tap, st in stats.items():
        if not bool(jnp.all(jnp.isfinite(st["xtx"]))):
            raise ValueError(f"layer {layer}: calibration activations {tap!r} contain NaN or Inf")


def _sum_stats(parts: list[dict]) -> dict:
    total = parts[0]
    for p in parts[1:]:
        total = jax.tree.map(jnp.add, total, p)
    # absmax is a max, not a sum
    for tap in total:
        total[tap]["absmax"] = functools.reduce(jnp.maximum, [p[tap]["absmax"] for p in parts])
    return total


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
    count = n * s  # calibration tokens per tap
    x = params["embed"][jnp.asarray(tokens)]  # [N, S, E] as in forward_dense
    n_awq = max(1, min(n // bs, qcfg.awq_max_tokens // (bs * s)))  # batches in the AWQ sample

    notes: list[str] = []
    qlayers, errors = [], []
    layer_ids = range(cfg.num_layers)
    if progress:
        from tqdm import tqdm

        layer_ids = tqdm(layer_ids, desc=f"{qcfg.method} layers")
    for layer in layer_ids:
        lp = jax.tree.map(lambda a, i=layer: a[i], params["layers"])
        batches = [x[i : i + bs] for i in range(0, n, bs)]  # each [bs, S, E]
        stats = _sum_stats([tap_stats(lp, xb, cfg) for xb in batches])
        _check_finite(stats, layer)
        samples = None
        if qcfg.method == "awq":
            parts = [tap_samples(lp, xb, cfg) for xb in batches[:n_awq]]
            samples = {t: jnp.concatenate([p[t] for p in parts]) for t in parts[0]}
        if qcfg.method == "gptq" and qcfg.true_sequential:
            qlp, errs = _gptq_sequential(lp, stats, batches, count, cfg, qcfg, layer)
        else:
            qlp, errs = _quantize_layer(lp, stats, samples, count, cfg, qcfg, layer, notes)
        x = jnp.concatenate([layer_forward(qlp, xb, cfg) for xb in batches])
        qlayers.append(qlp)
        errors.append(errs)

    qparams = dict(params)
    qparams["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *qlayers)
    report = QuantReport(qcfg.method, 0.0, errors, notes=notes)
    if qcfg.quantize_lm_head:
        qparams["lm_head"], report.lm_head_error = _quantize_head(params, cfg, qcfg, x, count)
        if cfg.tie_word_embeddings:
            notes.append("tied embeddings: the quantized lm_head is stored beside the embedding")
    report.seconds = time.perf_counter() - start
    return qparams, report


def _quantize_head(params, cfg, qcfg, x, count):
    """The LM head: GPTQ on the final hidden states for gptq, the method's grid otherwise."""
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)  # [N, S, E]
    H = 2.0 * _stats(h)["xtx"] / count
    w = lm_head(params)  # [E, V]
    if qcfg.method == "gptq":
        qw, _ = gptq.gptq_quantize(
            w, H, bits=qcfg.bits, group_size=qcfg.group_size, sym=qcfg.sym, damp=qcfg.damp,
            act_order=qcfg.act_order, static_groups=qcfg.static_groups,
            blocksize=qcfg.blocksize, scale_dtype=cfg.dtype, name="lm_head",
        )  # fmt: skip
    else:
        qw = _weight_quantizer(qcfg, jnp.dtype(cfg.dtype), w)
    return qw, float(relative_error(H, w, qw))


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
