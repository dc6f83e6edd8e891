"""Parameter pytree: random init (tests, training from scratch) and shapes without allocating.

Layout (per-layer weights stacked on a leading L axis so the decoder is one `lax.scan`; a linear
weight is `[in, out]`, applied as `x @ w`):

  embed       [V, E]
  layers/
    attn_norm [L, E]        mlp_norm [L, E]
    wq [L, E, H*D]  wk [L, E, K*D]  wv [L, E, K*D]  wo [L, H*D, E]
    bq [L, H*D]     bk [L, K*D]     bv [L, K*D]       (only with cfg.attention_bias)
    w_gate [L, E, F]  w_up [L, E, F]  w_down [L, F, E]
  final_norm  [E]
  lm_head     [E, V]        (absent with cfg.tie_word_embeddings)

`inference_layout` gives the form the compiled decode loops run on: the same leaves with `layers` a
tuple of L per-layer dicts (no leading axis), and a tied output projection materialised as its
own `lm_head [E, V]`. `forward` takes either form. Both changes are about XLA on a CPU inside a
compiled decode loop (`ji.generate`, the speculative loop): there a `lax.scan` over stacked
weights slices (copies) every layer's weights at every step, three to four times a decode step's
weight traffic, and `x @ embed.T` compiles to a slower product than one against a contiguous
`[E, V]`. A program that runs one step per call (the engine's) measured no faster with it.
`loop_layout` applies it on a CPU only (the copy would double the weights' memory on a GPU,
where it has not been measured).

On a CPU (one device) the loops and the engine go one step further, `cpu_layout`: every dense
projection is held transposed, `[out, in]`, in a `jaxinfer.transposed.TransposedDense`, which
`ops.linear` applies by a pass over the weight that costs ~1.2-1.6x a GEMV at 2-16 rows, where
`x @ w` costs 2-4x (verification, batched decode, the engine's padded steps). A tied head is then
the embedding table itself, read in its stored `[V, E]` layout. The projections that read one
input are fused where all are dense (`FUSED`): `wqkv [(H + 2K) * D, E]` (with `bqkv`) and
`w_gate_up [2F, E]`, one product each instead of three and two (vLLM's QKVParallelLinear and
MergedColumnParallelLinear). Measured on SmolLM2 (an interleaved A/B of one paged step at T = 1,
2, 5, 8, 16 rows, BENCHMARKS.md 2026-12-04): 0.97-0.98x the step of the projections apart.
W8A16 weights with one scale per output channel take the same layout, int8 with their scales
(fused likewise: the scales concatenate); int4 and grouped int8 weights are cut into blocks of
output columns (`qtensor.ColumnBlocks`, their projections apart). `transposed` says why and how
they are applied.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.qtensor import ColumnBlocks, Int4Weight, Int8Weight, column_blocks, is_quantized
from jaxinfer.transposed import TransposedDense, column_block, transpose_dense

LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> dict:
    """Random parameters: normal(0, std) weights, unit norm weights, zero biases.

    Args:
      cfg: the model config.
      key: a PRNG key.
      std: standard deviation of the weights (GPT-2 / HF `initializer_range`).

    Returns:
      The params pytree described in this module's docstring, in `cfg.dtype`.
    """
    e, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    hd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dt = cfg.jnp_dtype
    shapes = {
        "wq": (n, e, hd),
        "wk": (n, e, kd),
        "wv": (n, e, kd),
        "wo": (n, hd, e),
        "w_gate": (n, e, f),
        "w_up": (n, e, f),
        "w_down": (n, f, e),
    }
    keys = jax.random.split(key, len(shapes) + 2)
    layers = {
        name: (std * jax.random.normal(k, shape, jnp.float32)).astype(dt)
        for k, (name, shape) in zip(keys, shapes.items())
    }
    layers["attn_norm"] = jnp.ones((n, e), dt)
    layers["mlp_norm"] = jnp.ones((n, e), dt)
    if cfg.attention_bias:
        layers["bq"] = jnp.zeros((n, hd), dt)
        layers["bk"] = jnp.zeros((n, kd), dt)
        layers["bv"] = jnp.zeros((n, kd), dt)
    params = {
        "embed": (std * jax.random.normal(keys[-2], (v, e), jnp.float32)).astype(dt),
        "layers": layers,
        "final_norm": jnp.ones((e,), dt),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = (std * jax.random.normal(keys[-1], (e, v), jnp.float32)).astype(dt)
    return params


def check_params(cfg: ModelConfig, params) -> None:
    """Raises ValueError naming the first key or leaf shape of `params` that disagrees with `cfg`.

    The boundary check of every entry point that takes (cfg, params): without it a mismatched
    pair fails deep inside a trace with a reshape or scan error. Takes the stored form and
    `inference_layout`'s. Dense leaves must match `param_shapes(cfg)`; a quantized weight must
    have the `(in, out)` and the leading axes of the dense leaf it replaces. A tied model may
    carry its own `lm_head` (a quantized head, or the inference layout's copy). A dense leaf must
    also have `cfg.dtype`: bf16 params against a float32 config are refused, not converted (the
    conversion would copy the whole model at every call, and the config decides the activation
    and cache dtypes, so running the params' own dtype would contradict it).
    """
    if not isinstance(params, dict) or not isinstance(params.get("layers"), dict | tuple | list):
        raise ValueError(
            f"params must be a dict with a 'layers' entry (init_params' pytree), got "
            f"{type(params).__name__}"
        )
    want = _cached_shapes(cfg)
    layers = params["layers"]
    unrolled = isinstance(layers, tuple | list)
    if unrolled and len(layers) != cfg.num_layers:
        raise ValueError(f"params hold {len(layers)} layers, cfg.num_layers={cfg.num_layers}")
    _check_keys(set(params), set(want), {"lm_head"}, "params")
    if unrolled:  # (where, layer, its expected leaves), cpu_layout's fused leaves included
        specs = [(f"layers[{i}]", x, _fused_specs(want["layers"], x)) for i, x in enumerate(layers)]
    else:
        specs = [("layers", layers, want["layers"])]
    for where, layer, layer_specs in specs:
        _check_keys(set(layer), set(layer_specs), set(), f"params['{where}']")

    for key, spec in want.items():
        if key != "layers":
            _check_leaf(key, spec, params[key])
    for where, layer, layer_specs in specs:
        for key, spec in layer_specs.items():
            _check_leaf(f"{where}/{key}", spec, layer[key], unstacked=unrolled)
    if "lm_head" in params and "lm_head" not in want:
        head = jax.ShapeDtypeStruct((cfg.hidden_size, cfg.vocab_size), cfg.jnp_dtype)
        _check_leaf("lm_head", head, params["lm_head"])


def _fused_specs(specs: dict, layer: dict) -> dict:
    """A layer's expected leaves with the parts that `cpu_layout` fused in `layer` replaced by the
    fused leaf (the parts' outputs side by side)."""
    specs = dict(specs)
    for fused, (parts, bias, bias_parts) in FUSED.items():
        if fused not in layer:
            continue
        for names, name in ((parts, fused), (bias_parts if bias in layer else (), bias)):
            if names:
                got = [specs.pop(n) for n in names]
                shape = (*got[0].shape[:-1], sum(g.shape[-1] for g in got))
                specs[name] = jax.ShapeDtypeStruct(shape, got[0].dtype)
    return specs


def _check_keys(got: set, expected: set, extra_ok: set, where: str) -> None:
    if expected - got or got - expected - extra_ok:
        raise ValueError(
            f"{where} has keys {sorted(got)}; the model config implies {sorted(expected)}"
        )


def _narrow(leaf) -> bool:
    """A quantized weight in the CPU layout: its dtype is its format's, not the model's."""
    return isinstance(leaf, ColumnBlocks) or getattr(leaf, "scale", None) is not None


def _check_leaf(name: str, spec: jax.ShapeDtypeStruct, leaf, unstacked: bool = False) -> None:
    expected = tuple(spec.shape[1:] if unstacked else spec.shape)
    if is_quantized(leaf):
        lead, inner = expected[:-2], expected[-2:]
        if tuple(leaf.shape) != inner or leaf.lead_shape != lead:
            raise ValueError(
                f"shape mismatch at {name}: quantized weight of shape {leaf.shape} with leading "
                f"axes {leaf.lead_shape}; the model config implies {expected}"
            )
    elif not hasattr(leaf, "shape") or tuple(leaf.shape) != expected:
        got = tuple(leaf.shape) if hasattr(leaf, "shape") else type(leaf).__name__
        raise ValueError(f"shape mismatch at {name}: {got}; the model config implies {expected}")
    elif not _narrow(leaf) and leaf.dtype != spec.dtype:
        want = jnp.dtype(spec.dtype).name
        raise ValueError(
            f"dtype mismatch at {name}: {jnp.dtype(leaf.dtype).name}; the model config says "
            f"dtype={want!r}. Convert deliberately, e.g. jax.tree.map(lambda a: a.astype("
            f"cfg.jnp_dtype), params) for dense params, or use cfg.replace(dtype=...)"
        )


@functools.lru_cache(maxsize=64)
def _cached_shapes(cfg: ModelConfig) -> dict:
    return param_shapes(cfg)  # read-only here: callers of check_params never see it


def param_shapes(cfg: ModelConfig) -> dict:
    """The params pytree as `jax.ShapeDtypeStruct`s, computed without allocating anything."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def inference_layout(params: dict) -> dict:
    """The params laid out for the compiled decode loops (see the module docstring).

    `layers` becomes a tuple of per-layer dicts (each leaf `a[i]`) and, for a tied model, the
    output projection `embed.T` becomes its own `lm_head [E, V]` array; every other leaf is
    shared. Idempotent. Under `jax.jit` the copies are made once per call, outside the loop the
    caller then runs; eagerly they are made now (and take memory beside the stored params).

    Raises:
      ValueError: if the stacked leaves disagree on the number of layers.
    """
    layers = params["layers"]
    unrolled = isinstance(layers, tuple | list)
    if unrolled and "lm_head" in params:
        return params
    out = dict(params)
    if not unrolled:
        counts = {leaf.shape[0] for leaf in jax.tree.leaves(layers)}
        if len(counts) != 1:
            raise ValueError(f"stacked layer leaves disagree on the layer count: {sorted(counts)}")
        (n,) = counts
        out["layers"] = tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n))
    if "lm_head" not in out:
        out["lm_head"] = jnp.asarray(out["embed"].T)  # its own [E, V] array (jitted: a transpose)
    return out


def cpu_layout(params: dict) -> dict:
    """`inference_layout(params)` with every dense projection held transposed (module docstring).

    The layer projections (`LINEAR_NAMES`) and the head become `TransposedDense`; q/k/v and
    gate/up are each fused into one (`wqkv`, `bqkv`, `w_gate_up`; parts in that order) where all
    the parts are dense; the head keeps its `[E, V]` form beside (for one-row products), and a
    tied head's `[V, E]` is the embedding's own array. Quantized weights, norms, the other
    biases and the embedding are unchanged. Idempotent.
    """
    if isinstance(params.get("lm_head"), TransposedDense):
        return params
    tied = "lm_head" not in params
    out = inference_layout(params)  # a tied head materialised [E, V]

    def t(w, keep=False):
        if isinstance(w, jax.Array) and w.ndim == 2:
            return transpose_dense(w, keep)
        if isinstance(w, Int8Weight) and w.group_size is None and not w.act_quant:
            return TransposedDense(jnp.asarray(w.q.T), scale=w.scales.astype(jnp.float32))
        if isinstance(w, Int4Weight) or (isinstance(w, Int8Weight) and not w.act_quant):
            ob = column_block(w.shape[1])
            return column_blocks(w, ob) if ob else w
        return w

    out["layers"] = tuple(
        _fuse_siblings({k: t(v) if k in LINEAR_NAMES else v for k, v in layer.items()})
        for layer in out["layers"]
    )
    if tied:  # the embedding [V, E] is the head's [out, in] already
        out["lm_head"] = TransposedDense(params["embed"], out["lm_head"])
    else:  # the head keeps [E, V] too: its one-row product is faster so (jaxinfer.transposed)
        out["lm_head"] = t(out["lm_head"], keep=True)
    return out


# Projections that read the same input, fused by `cpu_layout` into one `[out, in]` product when
# all are dense: fused name -> (its parts, their biases' fused name, the parts' bias names).
FUSED = {
    "wqkv": (("wq", "wk", "wv"), "bqkv", ("bq", "bk", "bv")),
    "w_gate_up": (("w_gate", "w_up"), None, ()),
}


def _fuse_siblings(lp: dict) -> dict:
    """One layer's transposed projections with q/k/v and gate/up each fused into one
    `TransposedDense` (the parts' rows stacked in order), where every part is dense."""
    lp = dict(lp)
    for fused, (parts, bias, bias_parts) in FUSED.items():
        ws = [lp.get(p) for p in parts]
        if not all(isinstance(w, TransposedDense) for w in ws):
            continue  # an int4 or grouped part: the projections stay apart
        if len({w.scale is None for w in ws}) > 1 or len({w.wt.dtype for w in ws}) > 1:
            continue  # int8 beside float: apart
        scale = None if ws[0].scale is None else jnp.concatenate([w.scale for w in ws])
        lp[fused] = TransposedDense(jnp.concatenate([w.wt for w in ws], axis=0), scale=scale)
        for p in parts:
            del lp[p]
        if bias is not None and all(b in lp for b in bias_parts):
            lp[bias] = jnp.concatenate([lp.pop(b) for b in bias_parts])
    return lp


def loop_layout(params: dict, platform: str, mesh=None) -> dict:
    """The layout the compiled decode loops run on: `cpu_layout` on a CPU with one device,
    `inference_layout` on a CPU tensor-parallel mesh (`mesh`: its sharding rules name the
    `[in, out]` leaves), `params` unchanged on other platforms.

    The compiled decode loops call this with the platform their entry point resolved
    (`ops.backend.resolve_platform`), a static value: nothing traced reads the platform. The
    layout's gain was measured on XLA's CPU backend. On a GPU the copy would double the weights'
    memory for the whole loop, and nothing has been measured there yet.
    """
    if platform != "cpu":
        return params
    return inference_layout(params) if mesh is not None else cpu_layout(params)


# The last stored params pytree `remembered_loop_layout` laid out: (weak references to its leaves,
# its treedef, the laid-out pytree). One entry; dropped when the stored params are freed.
_REMEMBERED: list = []


def remembered_loop_layout(params: dict, platform: str) -> dict:
    """`loop_layout(params, platform)`, computed once per stored params pytree and then reused.

    Inside a compiled decode loop the layout is a copy of every weight made at every call: for
    SmolLM2 (538 MB of float32) that copy cost more than a quarter of a 200-token prefill. Made
    here, outside the program, it is made once while the same arrays (jax arrays are immutable)
    keep being passed in; peak memory is what the in-program copy already took, but it now lives
    as long as the stored params (it is released with them, or when another pytree comes).
    Params already in the layout, params off a CPU and traced params pass through unchanged.
    """
    if platform != "cpu" or isinstance(params.get("lm_head"), TransposedDense):
        return params
    leaves, treedef = jax.tree.flatten(params)
    if any(isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) for x in leaves):
        return params
    if _REMEMBERED:
        refs, tdef, laid_out = _REMEMBERED[0]
        if tdef == treedef and len(refs) == len(leaves):
            if all(r() is x for r, x in zip(refs, leaves)):
                return laid_out
    laid_out = cpu_layout(params)  # eagerly: leaves it does not change stay shared
    # Forgotten when a stored leaf the layout does not hold is freed (a shared one never is:
    # the remembered layout holds it).
    held = {id(x) for x in jax.tree.leaves(laid_out)}
    own = [x for x in leaves if id(x) not in held]
    if not own:  # the layout copied nothing (unrolled, quantized, tied): nothing to remember
        return laid_out
    _REMEMBERED[:] = [([weakref.ref(x) for x in leaves], treedef, laid_out)]
    weakref.finalize(own[0], _forget, id(laid_out))
    return laid_out


def _forget(laid_out_id: int) -> None:
    if _REMEMBERED and id(_REMEMBERED[0][2]) == laid_out_id:
        _REMEMBERED.clear()


def lm_head(params: dict):
    """The output projection `[E, V]` (the transposed embedding when tied; a `TransposedDense`
    or a quantized weight where the params hold one)."""
    if "lm_head" in params:
        return params["lm_head"]
    return params["embed"].T
