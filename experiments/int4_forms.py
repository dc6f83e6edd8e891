r"""XLA formulations of a W4A16 product on a CPU, on SmolLM2's own Q4_1 tensors (issue 13).

    python -m experiments.int4_forms --workdir=runs/int4_forms
    python -m experiments.int4_forms --rows=1,5 --forms=float32,blocked,int8_codes

Issue 13 asks for a W4A16 step faster than float32 and for the fastest XLA formulation of it.
This times the layers' products alone (q, k, v, o, gate, up, down of all 30 layers chained in
one jit, no attention, no head: the head is Q8_0 in the file) at T rows, each form over the
same weights, the forms alternating call by call (median of --reps calls). The forms:

  float32     the dequantized weights as the CPU layout holds them (`TransposedDense`)
  blocked     the Q4_1 weights as `ops.linear` applies them (`qtensor.ColumnBlocks`: a scan
              over blocks of output columns, each unpacked, scaled and multiplied), as shipped
  factored    the same blocks, the group scale and offset applied after each group's partial
              sums: y = sum_g s_g * (x_g . q_g) + m_g * sum(x_g); no per-weight multiply
  nibbles_i8  two codes per int8 byte (rows r and r + in/2), unpacked by arithmetic shifts of
              the byte, each half scaled and multiplied: the cheapest unpack XLA offers
  nt_rows     the NT layout `[out, in]` (the float32 form's), eight output rows' codes packed in
              each u32 word: an in-contiguous run of words unpacks with one shift per row, so
              the unpack vectorizes along `in` as the blocked form's does along `out`; each
              block of `[ob, in]` is unpacked, scaled and dotted NT as float32 is at one row
  bytes_nt    the NT layout with one signed code per int8 byte (q - 8): the same product
              without the unpack; a byte a weight, twice the packed forms' half byte
  int8_codes  a bound, not a product: one int8 code per weight, converted and multiplied with
              no unpack and no scales (one byte a weight, what any convert-and-dot form costs
              at least)
  int8_dot    a bound, not a product: int8 activations against the int8 codes, accumulated in
              int32 by XLA's integer dot (llama.cpp's Q4_1 x Q8_1 arithmetic, without its
              per-group scales)

The three correct forms are checked against the float32 product first (each layer's products
within 1e-4 relative); a form that disagrees stops the run. The bounds' outputs are not
compared. The table gives each form's time over float32's.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer import qtensor, transposed
from jaxinfer.ops.linear import linear
from pallas_kernels.int4_matmul.reference import unpack_int4

FORMS = (
    "float32", "blocked", "factored", "nibbles_i8", "nt_rows", "bytes_nt", "int8_codes", "int8_dot"
)  # fmt: skip
BOUNDS = ("int8_codes", "int8_dot")  # timed, not products of the weights
PROJ = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

_FLAGS: dict[str, flags.FlagHolder] = {}


def define_flags() -> None:
    """The script's flags, defined when it runs: the tests import this module for its forms,
    beside other experiments whose flags (--workdir, --rows, ...) share absl's registry."""
    _FLAGS["workdir"] = flags.DEFINE_string("workdir", None, "Where config.json and results go.")
    _FLAGS["config"] = common.config_flag()
    _FLAGS["model"] = flags.DEFINE_string(
        "model", "smollm2-135m", "A GGUF model name or path (Q4_0 / Q4_1 layers)."
    )
    _FLAGS["rows"] = flags.DEFINE_list("rows", ["1", "5"], "Rows T of the products.")
    _FLAGS["forms"] = flags.DEFINE_list("forms", list(FORMS), "Forms (float32 is always timed).")
    _FLAGS["reps"] = flags.DEFINE_integer(
        "reps", 15, "Timed calls per form and T (median).", lower_bound=1
    )
    flag_checks.int_list(_FLAGS["rows"], min_value=1)
    flag_checks.choice_list(_FLAGS["forms"], FORMS)


# ---------------------------------------------------------------------------- the forms' weights


def _cut(a: np.ndarray, ob: int) -> jax.Array:
    """`[r, out]` -> `[out / ob, r, ob]`, each block of output columns contiguous."""
    return jnp.asarray(np.ascontiguousarray(a.reshape(a.shape[0], -1, ob).transpose(1, 0, 2)))


def _codes(w: qtensor.Int4Weight) -> np.ndarray:
    """`[in, out]` int32 codes of a weight in stored row order."""
    return np.asarray(unpack_int4(w.packed)).astype(np.int32)


def _offsets(w: qtensor.Int4Weight) -> tuple[np.ndarray, np.ndarray]:
    """(scales, offsets) `[in/G, out]` with w = s * q + m (zero points folded into m)."""
    s = np.asarray(w.scales, np.float32)
    m = -np.asarray(w.zeros, np.float32) * s
    if w.mins is not None:
        m = m + np.asarray(w.mins, np.float32)
    return s, m


def form_weights(form: str, w: qtensor.Int4Weight):
    """One layer's weight as `form` holds it."""
    ob = transposed.column_block(w.shape[1])
    if form == "float32":
        return transposed.transpose_dense(qtensor.dequantize(w, jnp.float32))  # as cpu_layout
    if form in ("blocked", "factored"):
        return qtensor.column_blocks(w, ob)
    q = _codes(w)
    if form in ("nt_rows", "bytes_nt"):
        return _nt_weights(form, q, *_offsets(w), ob)
    if form in BOUNDS:
        return _cut(q.astype(np.int8), ob)  # [nb, in, ob]
    s, m = _offsets(w)  # nibbles_i8: signed codes q - 8, so w = s * (q - 8) + (m + 8 s)
    half = q.shape[0] // 2
    hi, lo = q[:half] - 8, q[half:] - 8
    packed = ((hi << 4) | (lo & 15)).astype(np.int8)  # [in/2, out]
    return (_cut(packed, ob), _cut(s, ob), _cut(m + 8 * s, ob))


def _nt_weights(form: str, q: np.ndarray, s: np.ndarray, m: np.ndarray, ob: int):
    """The NT forms' blocks: codes `[nb, ob / 8, in]` u32 words (nt_rows: word (j, k) holds rows
    8j .. 8j + 7 of column k at bits 4r) or `[nb, ob, in]` int8 (bytes_nt: q - 8); scales and
    offsets `[nb, ob, in / G]` with w = s * code + m."""
    qt = q.T  # [out, in]
    if form == "nt_rows":
        rows = qt.astype(np.uint32).reshape(qt.shape[0] // 8, 8, qt.shape[1])  # [out/8, 8, in]
        codes = np.bitwise_or.reduce(rows << (4 * np.arange(8, dtype=np.uint32))[:, None], axis=1)
        per_block = ob // 8
    else:
        codes, m, per_block = (qt - 8).astype(np.int8), m + 8 * s, ob

    def cut(a, r):  # [rows, ...] -> [nb, r, ...]
        return jnp.asarray(np.ascontiguousarray(a.reshape(-1, r, *a.shape[1:])))

    return (cut(codes, per_block), cut(s.T, ob), cut(m.T, ob))


# ---------------------------------------------------------------------------- the forms' products


def _factored(x2: jax.Array, w: qtensor.ColumnBlocks) -> jax.Array:
    d_in, g = w.shape[0], w.blocks.group_size

    def block(b):  # [in, ob] -> [M, ob]
        q = unpack_int4(b.packed).astype(jnp.float32).reshape(d_in // g, g, -1)  # [ng, G, ob]
        xg = x2.reshape(x2.shape[0], d_in // g, g)  # [M, ng, G]
        part = jnp.einsum("mgk,gko->mgo", xg, q, preferred_element_type=jnp.float32)
        s = b.scales.astype(jnp.float32)
        m = -b.zeros.astype(jnp.float32) * s + (0.0 if b.mins is None else b.mins)
        return jnp.einsum("mgo,go->mo", part, s) + xg.sum(-1) @ m

    return transposed.scan_blocks(block, w.blocks)


def _nibbles(x2: jax.Array, w) -> jax.Array:
    packed, s, m = w
    half = packed.shape[1]
    g = 2 * half // s.shape[1]  # group size
    ng = half // g

    def block(b):
        pb, sb, mb = b  # [in/2, ob] int8, [in/G, ob] twice
        hi = (pb >> 4).astype(jnp.float32).reshape(ng, g, -1) * sb[:ng, None] + mb[:ng, None]
        lo = ((pb << 4) >> 4).astype(jnp.float32).reshape(ng, g, -1) * sb[ng:, None] + mb[ng:, None]
        y_hi = jnp.dot(x2[:, :half], hi.reshape(half, -1))  # [M, ob]
        return y_hi + jnp.dot(x2[:, half:], lo.reshape(half, -1))

    return transposed.scan_blocks(block, (packed, s, m))


def _nt(x2: jax.Array, w) -> jax.Array:
    codes, s, m = w
    nt = (((1,), (1,)), ((), ()))  # contract both `in` axes, as float32's one-row product

    def block(b):
        cb, sb, mb = b  # [ob / 8, in] u32 or [ob, in] int8; [ob, in / G] twice
        if cb.dtype == jnp.uint32:
            shifts = 4 * jnp.arange(8, dtype=jnp.uint32)
            cb = ((cb[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, cb.shape[-1])
        ob, ng = sb.shape
        wf = cb.astype(jnp.float32).reshape(ob, ng, -1) * sb[..., None] + mb[..., None]
        return jax.lax.dot_general(x2, wf.reshape(ob, -1), nt)  # [M, ob]

    return transposed.scan_blocks(block, w)


def _int8_codes(x2: jax.Array, w: jax.Array) -> jax.Array:
    return transposed.scan_blocks(lambda b: jnp.dot(x2, b.astype(jnp.float32)), w)


def _int8_dot(x2: jax.Array, w: jax.Array) -> jax.Array:
    xq = jnp.clip(jnp.round(x2 * 16.0), -127, 127).astype(jnp.int8)  # [M, in]
    nn = (((1,), (0,)), ((), ()))

    def block(b):
        return jax.lax.dot_general(xq, b, nn, preferred_element_type=jnp.int32).astype(jnp.float32)

    return transposed.scan_blocks(block, w)


def product(form: str, x: jax.Array, w) -> jax.Array:
    """`x [M, in] @ w` in `form` -> `[M, out]` float32."""
    if form in ("float32", "blocked"):
        return linear(x, w).astype(jnp.float32)
    return {"factored": _factored, "nibbles_i8": _nibbles, "nt_rows": _nt, "bytes_nt": _nt,
            "int8_codes": _int8_codes,
            "int8_dot": _int8_dot}[form](x, w)  # fmt: skip


def chain(form: str, layers: list[dict], x: jax.Array) -> jax.Array:
    """The layers' seven products at `x [T, E]`, chained (each layer's output feeds the next)."""
    for lp in layers:
        q = product(form, x, lp["wq"])
        k = product(form, x, lp["wk"])
        v = product(form, x, lp["wv"])
        x = x + 0.01 * product(form, q, lp["wo"]) + 1e-6 * (k.sum() + v.sum())
        g, u = product(form, x, lp["w_gate"]), product(form, x, lp["w_up"])
        x = x + 0.01 * product(form, jax.nn.silu(g) * u, lp["w_down"])
    return x


# ---------------------------------------------------------------------------- the run


def check(form: str, layer: dict, laid: dict, rows: int) -> float:
    """The largest error of `form`'s products over one layer against `x @ dequantize(w)`,
    relative to the largest output; raises if it exceeds 1e-4."""
    x = jax.random.normal(jax.random.key(rows), (rows, 1536), jnp.float32)
    worst = 0.0
    for name in PROJ:
        w = layer[name]
        xi = x[:, : w.shape[0]]
        want = np.asarray(xi @ qtensor.dequantize(w, jnp.float32))
        got = np.asarray(jax.jit(lambda a, b: product(form, a, b))(xi, laid[name]))
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        if not err <= 1e-4:
            raise AssertionError(f"{form}: {name} at {rows} rows differs by {err:.2e} (relative)")
        worst = max(worst, err)
    return worst


def time_forms(forms: dict, rows: int, reps: int) -> dict:
    """Median ms of each form's chain at T rows, the forms alternating call by call."""
    x = jax.random.normal(jax.random.key(0), (rows, 576), jnp.float32)
    fns = {}
    for form, layers in forms.items():
        fn = jax.jit(lambda ls, x, form=form: chain(form, ls, x))
        fn(layers, x).block_until_ready()  # compile
        fns[form] = (fn, layers)
    seconds = {form: [] for form in forms}
    for _ in range(reps):
        for form, (fn, layers) in fns.items():
            t0 = time.perf_counter()
            fn(layers, x).block_until_ready()
            seconds[form].append(time.perf_counter() - t0)
    return {form: 1e3 * statistics.median(v) for form, v in seconds.items()}


def main(argv):
    del argv
    common.apply_config(_FLAGS["config"].value)
    path = common.resolve_model(_FLAGS["model"].value)
    if _FLAGS["workdir"].value:
        common.save_config(_FLAGS["workdir"].value, resolved={"model": path})
    forms = list(dict.fromkeys(["float32", *_FLAGS["forms"].value]))
    cfg, params = ji.load_checkpoint(path, keep_quantized=True)
    stacked = {k: params["layers"][k] for k in PROJ}  # [L, ...] leaves
    quantized = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(cfg.num_layers)]
    for k, w in quantized[0].items():
        if not isinstance(w, qtensor.Int4Weight):
            raise ValueError(f"{path}: layer 0's {k} is {type(w).__name__}; expected Int4Weight")
    del params
    laid = {f: [{k: form_weights(f, w) for k, w in lp.items()} for lp in quantized] for f in forms}
    errors = {
        f: max(check(f, quantized[0], laid[f][0], int(t)) for t in _FLAGS["rows"].value)
        for f in forms
        if f not in BOUNDS
    }
    print(json.dumps({"relative_error": errors}), flush=True)
    load0 = common.load_average()
    cells = []
    for t in (int(t) for t in _FLAGS["rows"].value):
        ms = time_forms(laid, t, _FLAGS["reps"].value)
        cells.append({"rows": t, "ms": ms, "ratio": {f: ms[f] / ms["float32"] for f in ms}})
        print(json.dumps(cells[-1]), flush=True)
    res = {
        "model": path, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "load_average": [load0, common.load_average()],
        "relative_error": errors, "cells": cells,
    }  # fmt: skip
    if _FLAGS["workdir"].value:
        common.write_results(_FLAGS["workdir"].value, res)
    print(f"\n{_FLAGS['model'].value}: load average {load0} -> {common.load_average()}\n")
    print("| T | " + " | ".join(forms) + " |")
    print("|---|" + "---|" * len(forms))
    for c in cells:
        row = [f"{c['ms'][f]:.1f} ms ({c['ratio'][f]:.2f}x)" for f in forms]
        print(f"| {c['rows']} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    define_flags()
    app.run(main)
