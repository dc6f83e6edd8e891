"""Token padding buckets of the engine's step, chosen by a cost table measured at construction.

A step's T (tokens) is padded to a bucket so a run compiles a bounded number of times. A fixed
minimum (the old `min_token_bucket=16`) makes every decode step of a few requests pay for 16 rows:
on a CPU a 16-row float32 GEMM costs ~2-3x the GEMV of one row, and a memory-bound GPU step
costs about the same at 1 and 16 rows. So the engine measures instead of assuming:

    buckets = measure_token_buckets(cfg, params, lo=1, hi=16)  # e.g. (1, 4, 8, 16) on a CPU
    t = pad_tokens(n, buckets)  # the smallest kept bucket >= n; past the largest, 2^k

The cost table times the step's products at each power of two T in lo..hi: every layer's
projections (q/k/v, o, the MLP; no attention) and then the head, over the params as the step
holds them (dense, transposed, quantized, stacked or unrolled, on their devices). It allocates no
weight of its own and reads as many bytes per call as the step (up to `_PROBE_BYTES` of layers),
so it streams them from memory as the step does. One product probed alone does not: SmolLM2's
113 MB head fits the 300 MiB L3 of an Intel machine here, and timed alone (as this module did
before) its 1-row product took 1.1-1.4x its 4-row one in five fresh processes of six, so 1 was
dropped; timed with the layers, the products at 1 row took 0.71-0.88x those at 4 in ten, and
1 was kept in all (BENCHMARKS.md, 2026-12-05 night).
Going down from hi, a bucket is kept when it costs at most `1 - margin` of the smallest bucket
kept above it: padding a step to the next kept bucket then costs less than `margin` more, and
each dropped bucket is one compilation fewer. Past hi, T is a power of two as before.

The margin is 5%, not more, because the two mistakes are not alike. A bucket kept in vain costs
one compilation; a bucket dropped in vain costs every step of its size (a one-request decode
step run at 4 rows instead of 1 took 1.46x the time on SmolLM2 here).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import bucket
from jaxinfer.checks import as_int
from jaxinfer.config import ModelConfig
from jaxinfer.model.attention import project_qkv
from jaxinfer.model.decoder import mlp_block
from jaxinfer.ops.linear import linear

MARGIN = 0.05  # keep a bucket when it saves at least this fraction of the next kept one's cost
_REPEATS = 5  # timed rounds per T; the table keeps the minimum (the least disturbed)
# The layers timed: the first ones holding this many bytes, or all. More than a CPU's last-level
# cache, so the probe streams the weights as the step does; 1-2 layers of a 7B model.
_PROBE_BYTES = 1 << 30


def layer_products(lp: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """One layer's projections at `x [T, E]` as the step runs them, without attention (the
    cost table's probe; `experiments/step_ab.py --products` chains them too)."""
    t = x.shape[0]
    q, k, v = project_qkv(x, lp, cfg, jnp.zeros((t,), jnp.int32))  # [T,H,D], [T,K,D], [T,K,D]
    x = x + linear(q.reshape(t, -1), lp["wo"])  # [T, E]
    x = x + 1e-6 * (k.sum() + v.sum())  # k and v used: their products are not dropped
    return mlp_block(x, lp, cfg)  # [T, E]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _unrolled_layer(lp, x, cfg):
    return layer_products(lp, x, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stacked_layer(layers, i, x, cfg):  # layer i of the stacked `[L, ...]` weights
    return layer_products(jax.tree_util.tree_map(lambda a: a[i], layers), x, cfg)


@functools.partial(jax.jit, static_argnames=("tied",))
def _head_product(w, x, tied: bool) -> jax.Array:
    return linear(x, w.T if tied else w)  # [T, V]; a tied embedding [V, E] is transposed here


def _head(params: dict) -> tuple[object, bool]:
    """(the head weight as `lm_head` reads it, tied): a tied model's is its embedding `[V, E]`."""
    return (params["lm_head"], False) if "lm_head" in params else (params["embed"], True)


def _nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def _probe_calls(cfg: ModelConfig, params: dict) -> list:
    """The layer calls of one probe, `x -> x`: the first layers holding `_PROBE_BYTES`, or all."""
    layers, calls, held = params["layers"], [], 0
    unrolled = isinstance(layers, list | tuple)
    per_layer = None if unrolled else _nbytes(layers) // cfg.num_layers
    for i in range(cfg.num_layers):
        if unrolled:
            calls.append(functools.partial(_unrolled_layer, layers[i], cfg=cfg))
            held += _nbytes(layers[i])
        else:
            calls.append(functools.partial(_stacked_layer, layers, np.int32(i), cfg=cfg))
            held += per_layer
        if held >= _PROBE_BYTES:
            break
    return calls


def _run(calls: list, head, tied: bool, x: jax.Array) -> jax.Array:
    for call in calls:
        x = call(x)  # [T, E]
    return _head_product(head, x, tied)  # [T, V]


def probe(cfg: ModelConfig, params: dict, t: int) -> jax.Array:
    """What the cost table times once at T = t rows: the probed layers' products, then the
    head, on a fixed `[T, E]` input; `[T, V]` float32."""
    x = jnp.ones((t, cfg.hidden_size), cfg.jnp_dtype) / cfg.hidden_size  # [T, E]
    return _run(_probe_calls(cfg, params), *_head(params), x)


def cost_table(cfg: ModelConfig, params: dict, sizes: Sequence[int]) -> dict[int, float]:
    """Seconds of the step's products at T rows for each T in `sizes` (see the module docstring):
    the minimum of `_REPEATS` round-robin rounds after a compiling call."""
    calls, (head, tied) = _probe_calls(cfg, params), _head(params)
    xs = {t: jnp.ones((t, cfg.hidden_size), cfg.jnp_dtype) / cfg.hidden_size for t in sizes}

    def run(t: int) -> jax.Array:
        return _run(calls, head, tied, xs[t])

    for t in sizes:
        run(t).block_until_ready()  # compiles
    table = dict.fromkeys(sizes, np.inf)
    for _ in range(_REPEATS):  # round-robin: a busy spell of a shared machine hits every T
        for t in sizes:
            t0 = time.perf_counter()
            run(t).block_until_ready()
            table[t] = min(table[t], time.perf_counter() - t0)
    return table


def choose_buckets(table: dict[int, float], margin: float = MARGIN) -> tuple[int, ...]:
    """The kept buckets of a cost table {T: seconds} (see the module docstring); the largest T
    is always kept."""
    sizes = sorted(table)
    kept = [sizes[-1]]
    for t in reversed(sizes[:-1]):
        if table[t] <= (1 - margin) * table[kept[-1]]:
            kept.append(t)
    return tuple(sorted(kept))


# (cfg, lo, hi, the params' form) -> buckets: engines built alike in a process pad alike.
_MEASURED: dict[tuple, tuple[int, ...]] = {}


def _params_form(params: dict) -> tuple:
    """What the products' cost depends on: the params' pytree (types, static fields) and each
    leaf's shape, dtype and placement; not their values."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    return tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


def measure_token_buckets(cfg: ModelConfig, params: dict, lo: int, hi: int = 16) -> tuple[int, ...]:
    """The token buckets for T up to `bucket(hi)`, from `lo` (a power of two is taken above it),
    chosen by a cost table of the step's products on these params (see the module docstring).
    Measured once per config, range and params form in a process, so engines built alike (a
    benchmark's, a warm-up's) pad alike and share their compilations."""
    lo, hi = bucket(lo), bucket(max(lo, hi))
    sizes = [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]
    if len(sizes) == 1:
        return (lo,)
    key = (cfg, lo, hi, _params_form(params))
    if key not in _MEASURED:
        _MEASURED[key] = choose_buckets(cost_table(cfg, params, sizes))
    return _MEASURED[key]


def check_buckets(buckets, name: str = "token_buckets") -> tuple[int, ...]:
    """Explicit token buckets validated: a non-empty sequence of increasing powers of two >= 1
    (as `measure_token_buckets` returns them), as a tuple of Python ints.

    Raises:
      ValueError naming `name` and the value otherwise.
    """
    if isinstance(buckets, str | bytes) or not isinstance(buckets, Sequence):
        raise ValueError(f"{name}={buckets!r}: expected a sequence of powers of two")
    ints = [as_int(b) for b in buckets]  # numpy / jax ints too; bools and floats: None
    pow2 = all(b is not None and b >= 1 and not b & (b - 1) for b in ints)
    if not ints or not pow2 or ints != sorted(set(ints)):
        raise ValueError(f"{name}={buckets!r}: expected increasing powers of two >= 1")
    return tuple(ints)


def pad_tokens(n: int, buckets: Sequence[int]) -> int:
    """The padded T of a step of n tokens: the smallest bucket >= n, or a power of two past the
    largest bucket."""
    for b in buckets:
        if n <= b:
            return b
    return bucket(n)
