"""Token padding buckets of the engine's step, chosen by a cost table measured at construction.

A step's T (tokens) is padded to a bucket so a run compiles a bounded number of times. A fixed
minimum (the old `min_token_bucket=16`) makes every decode step of a few requests pay for 16 rows:
on a CPU a 16-row float32 GEMM costs ~2-3x the GEMV of one row, and a memory-bound GPU step
costs about the same at 1 and 16 rows. So the engine measures instead of assuming:

    buckets = measure_token_buckets(cfg, params, lo=1, hi=16)  # e.g. (1, 4, 8, 16) on a CPU
    t = pad_tokens(n, buckets)  # the smallest kept bucket >= n; past the largest, 2^k

The cost table times one product of the step's size class, the output projection `[T, E] @
[E, V]` (memory-bound as the whole step is: a smaller product stays in cache and its dispatch
hides the cost of its rows), at each power of two T in lo..hi: a few ms of compilation, not a
model step's. It times the params' own head, as the step holds it (dense, transposed, quantized,
on its devices, or a tied embedding transposed inside the probe), so it allocates no weight of
its own: a `[V, E]` copy is 2 GB for a 128 k vocabulary in float32, taken from the memory the KV
pool was sized to.
Going down from hi, a bucket is kept when it costs at most `1 - margin` of the smallest bucket
kept above it: padding a step to the next kept bucket then costs less than `margin` more, and
each dropped bucket is one compilation fewer. Past hi, T is a power of two as before.

The margin is 5%, not more, because the two mistakes are not alike. A bucket kept in vain costs
one compilation; a bucket dropped in vain costs every step of its size. The head's product also
understates what few rows save in the whole step. On SmolLM2 (an Intel CPU, the CPU layout) the
1-row head product took 0.79-0.92 of the 4-row one from one fresh process to the next, and the
layers' products 0.80. At a 10% margin two processes of six dropped bucket 1, so their engines
ran every one-request decode step at 4 rows (BENCHMARKS.md, 2026-12-05).
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
from jaxinfer.ops.linear import linear

MARGIN = 0.05  # keep a bucket when it saves at least this fraction of the next kept one's cost
_REPEATS = 15  # timed calls per T; the table keeps the minimum (the least disturbed)


@functools.partial(jax.jit, static_argnames=("rows", "tied", "dtype"))
def _probe(w, rows: int, tied: bool, dtype) -> jax.Array:
    w = w.T if tied else w  # [E, V]; a tied embedding [V, E] is transposed here, not copied
    x = jnp.ones((rows, w.shape[0]), dtype)  # [T, E]
    return linear(x, w)  # [T, V]


def _head(params: dict) -> tuple[object, bool]:
    """(the head weight as `lm_head` reads it, tied): a tied model's is its embedding `[V, E]`."""
    return (params["lm_head"], False) if "lm_head" in params else (params["embed"], True)


def cost_table(cfg: ModelConfig, params: dict, sizes: Sequence[int]) -> dict[int, float]:
    """Seconds of the params' head product `[T, E] @ [E, V]` (activations in the model's dtype)
    for each T in `sizes`, the minimum of `_REPEATS` round-robin calls after a compiling one."""
    w, tied = _head(params)
    for t in sizes:
        _probe(w, t, tied, cfg.jnp_dtype).block_until_ready()  # compiles
    table = dict.fromkeys(sizes, np.inf)
    for _ in range(_REPEATS):  # round-robin: a busy spell of a shared machine hits every T
        for t in sizes:
            t0 = time.perf_counter()
            _probe(w, t, tied, cfg.jnp_dtype).block_until_ready()
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


# (cfg, lo, hi, the head's form) -> buckets: engines built alike in a process pad alike.
_MEASURED: dict[tuple, tuple[int, ...]] = {}


def _head_form(params: dict) -> tuple:
    """What the head's cost depends on: tied or not, its pytree (type, static fields) and each
    leaf's shape, dtype and placement; not its values."""
    w, tied = _head(params)
    leaves, tree = jax.tree_util.tree_flatten(w)
    return tied, tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


def measure_token_buckets(cfg: ModelConfig, params: dict, lo: int, hi: int = 16) -> tuple[int, ...]:
    """The token buckets for T up to `bucket(hi)`, from `lo` (a power of two is taken above it),
    chosen by a cost table of the params' head (see the module docstring). Measured once per
    config, range and head form in a process, so engines built alike (a benchmark's, a
    warm-up's) pad alike and share their compilations."""
    lo, hi = bucket(lo), bucket(max(lo, hi))
    sizes = [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]
    if len(sizes) == 1:
        return (lo,)
    key = (cfg, lo, hi, _head_form(params))
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
