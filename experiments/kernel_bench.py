r"""Pallas kernel benchmark: correctness first, then timings (GPU only).

    python -m experiments.kernel_bench --workdir=/tmp/kernel_bench
    python -m experiments.kernel_bench --workdir=/tmp/kb --int4_m=1,16 --contexts=4096 --batches=1

1. Correctness on a small grid: int4 / int8 / W8A8 matmuls and NaN-poisoned ragged paged
   attention (also reading one layer of a stacked cache, `layer=`) against their pure-jnp
   references, and on a GPU also compiled against interpret mode. On CPU only this part runs
   (in interpret mode): timings need a GPU.
2. Bandwidth ceiling: a device-to-device stream (y = x + 1 over --copy_mib MiB; read + write).
3. int4 matmul (group 128) at M in --int4_m on the Llama-2-7B shapes 4096x4096, 4096x11008,
   11008x4096, against a bf16 `jnp.dot` on the dense weight in the same run: time, achieved GB/s
   (bytes the op must move / time) and speedup.
4. Paged attention, decode (q_len 1), Llama-3-8B heads (32 q, 8 kv, head_dim 128, bf16, 16-token
   pages, shuffled block tables) at context --contexts x batch --batches, against an XLA
   attention over contiguous KV `[B, C, K, D]` in the same run: achieved GB/s and overhead.

Timing: every op is jitted and warmed up; each figure is the median over --reps of
(--inner back-to-back calls / --inner), synchronised with `block_until_ready`; inputs rotate over
enough copies (>= --rotate_mib MiB in all) that the 50 MB L2 of an H100/H200 cannot serve them.
Writes config.json and results.json to --workdir, and prints a short table last.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import common, flag_checks
from pallas_kernels.int4_matmul import int4_matmul, int4_matmul_reference
from pallas_kernels.int8_matmul import (
    int8_int8_matmul,
    int8_int8_matmul_reference,
    int8_matmul,
    int8_matmul_reference,
)
from pallas_kernels.paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.testing import (
    ragged_attention_batch,
    relative_error,
    stack_layers,
)

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/kernel_bench", "Where results are written.")
_INT4_M = flags.DEFINE_list("int4_m", ["1", "4", "16", "64", "256"], "Rows of x.")
_CONTEXTS = flags.DEFINE_list("contexts", ["512", "4096", "32768"], "Attention context lengths.")
_BATCHES = flags.DEFINE_list("batches", ["1", "16", "64"], "Attention decode batch sizes.")
_REPS = flags.DEFINE_integer(
    "reps", 20, "Timed repetitions (the median is reported).", lower_bound=1
)
_INNER = flags.DEFINE_integer("inner", 10, "Back-to-back calls per repetition.", lower_bound=1)
_ROTATE_MIB = flags.DEFINE_integer(
    "rotate_mib", 512, "Minimum bytes of rotated inputs.", lower_bound=1
)
_COPY_MIB = flags.DEFINE_integer(
    "copy_mib", 1024, "Size of the bandwidth-ceiling stream.", lower_bound=1
)
_SKIP_TIMING = flags.DEFINE_bool("skip_timing", False, "Run only the correctness part.")
_CONFIG = common.config_flag()
for _flag in (_INT4_M, _CONTEXTS, _BATCHES):
    flag_checks.int_list(_flag, min_value=1)

LLAMA2_7B_SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096))  # (K, N): qkv/o, up/gate, down
GROUP = 128
ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_BLOCK = 32, 8, 128, 16  # Llama-3-8B, 16-token pages


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    workdir: str
    int4_m: tuple[int, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    reps: int
    inner: int
    rotate_mib: int  # rotated inputs total at least this much, so L2 cannot hold them
    copy_mib: int
    skip_timing: bool
    platform: str
    device_kind: str
    jax_version: str


# ----------------------------------------------------------------------------- correctness


def _int4_problem(rng, m, k, n, g, dtype):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    packed = jnp.asarray(rng.integers(0, 2**32, (k // 8, n), dtype=np.uint64).astype(np.uint32))
    scales = jnp.asarray(rng.uniform(0.5, 1.5, (k // g, n)) / 8, dtype)
    zeros = jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.int32)
    return x, packed, scales, zeros


def _rel_err(y, ref) -> float:
    """`relative_error`, with any non-finite output counted as infinitely wrong."""
    return relative_error(y, ref) if np.isfinite(np.asarray(y, np.float32)).all() else float("inf")


def _run_int4(args, group, perm, interpret):
    return int4_matmul(*args, group_size=group, perm=perm, interpret=interpret)


def _run_attention(args, kw, window, interpret, layer=None):
    return ragged_paged_attention(
        *args, **kw, sliding_window=window, layer=layer, interpret=interpret
    )


def check_correctness(on_gpu: bool) -> list[dict]:
    """Kernel vs reference (and compiled vs interpret on a GPU) on a small grid."""
    rng = np.random.default_rng(0)
    tol = {"float32": 1e-5, "bfloat16": 2e-2}
    cases = []
    for m, k, n, g, dtype in ((1, 256, 128, 64, "float32"), (33, 384, 256, 128, "bfloat16")):
        x, packed, scales, zeros = _int4_problem(rng, m, k, n, g, dtype)
        perm = jnp.asarray(rng.permutation(k).astype(np.int32))
        run = functools.partial(_run_int4, (x, packed, scales, zeros), g, perm)
        ref = int4_matmul_reference(x, packed, scales, zeros, group_size=g, perm=perm)
        cases.append((f"int4 M={m} K={k} N={n} G={g} {dtype}", run, ref, tol[dtype]))
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.integers(-127, 128, (256, 128)), jnp.int8)
    ws = jnp.asarray(rng.uniform(0.5, 1.5, 128) / 127, jnp.float32)
    cases.append(
        (
            "int8 W8A16 M=4 K=256 N=128 bfloat16",
            lambda interp: int8_matmul(x, w, ws, interpret=interp),
            int8_matmul_reference(x, w, ws),
            tol["bfloat16"],
        )
    )
    xq = jnp.asarray(rng.integers(-127, 128, (4, 256)), jnp.int8)
    xs = jnp.asarray(rng.uniform(0.5, 1.5, 4) / 127, jnp.float32)
    cases.append(
        (
            "int8 W8A8 M=4 K=256 N=128",
            lambda interp: int8_int8_matmul(xq, xs, w, ws, interpret=interp),
            int8_int8_matmul_reference(xq, xs, w, ws),
            1e-6,
        )
    )
    for kv_dtype, q_dtype, window in (
        ("float32", "float32", None),
        ("float32", "bfloat16", 20),
        ("int8", "float32", 5),
        ("float8_e4m3fn", "bfloat16", None),
    ):
        args, kw = ragged_attention_batch(16, (8, 2), 64, kv_dtype, q_dtype, seed=len(cases))
        run = functools.partial(_run_attention, args, kw, window)
        ref = ragged_paged_attention_reference(*args, **kw, sliding_window=window)
        name = f"attention kv={kv_dtype} q={q_dtype} window={window}"
        cases.append((name, run, ref, tol[q_dtype]))
    # The model's layer scan: layer 1 of a stacked 3-layer cache, read in place.
    args, kw = ragged_attention_batch(16, (8, 2), 64, "int8", seed=len(cases))
    stacked_args, stacked_kw = stack_layers(args, kw, layer=1)
    run = functools.partial(_run_attention, stacked_args, stacked_kw, 20, layer=jnp.int32(1))
    ref = ragged_paged_attention_reference(*args, **kw, sliding_window=20)
    cases.append(("attention kv=int8 q=float32 window=20 layer=1 of 3", run, ref, tol["float32"]))

    rows = []
    for name, run, ref, tolerance in cases:
        interp = run(True)
        row = {"case": name, "tolerance": tolerance, "interpret_vs_ref": _rel_err(interp, ref)}
        if on_gpu:
            try:
                compiled = run(False)
                row["compiled_vs_ref"] = _rel_err(compiled, ref)
                row["compiled_vs_interpret"] = _rel_err(compiled, interp)
            except Exception as e:  # noqa: BLE001 (a case that does not compile is a failure)
                row["error"] = f"{type(e).__name__}: {e}"[:4000]
        row["ok"] = "error" not in row and all(
            v <= tolerance for key, v in row.items() if key.endswith(("_ref", "_interpret"))
        )
        print(("ok   " if row["ok"] else "FAIL ") + json.dumps(row))
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- timing


def _median_seconds(fn, inputs: list[tuple], reps: int, inner: int) -> float:
    """Median over reps of the mean time of `inner` back-to-back calls, rotating inputs."""
    for args in inputs:  # compile + warm up every input set
        jax.block_until_ready(fn(*args))
    times = []
    i = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*inputs[i % len(inputs)])
            i += 1
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _copies(nbytes: int, rotate_mib: int) -> int:
    """How many distinct input sets to rotate so that together they exceed `rotate_mib`."""
    return int(min(256, max(1, math.ceil(rotate_mib * 2**20 / max(nbytes, 1)))))


def bench_copy(cfg: BenchConfig) -> dict:
    n = cfg.copy_mib * 2**20 // 2
    x = jnp.ones((n,), jnp.bfloat16)
    stream = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = _median_seconds(stream, [(x,)], cfg.reps, cfg.inner)
    row = {"bytes": 2 * x.nbytes, "ms": 1e3 * t, "gb_s": 2 * x.nbytes / t / 1e9}
    print("copy " + json.dumps(row))
    return row


def bench_int4(cfg: BenchConfig) -> list[dict]:
    key = jax.random.key(1)
    dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    q4 = jax.jit(lambda x, p, s, z: int4_matmul(x, p, s, z, group_size=GROUP))
    rows = []
    for k, n in LLAMA2_7B_SHAPES:
        w_bytes = k * n // 2 + (k // GROUP) * n * (2 + 4)  # nibbles + bf16 scales + int32 zeros
        weights = []  # random bits on the device: every nibble and zero point is valid
        for i in range(_copies(w_bytes, cfg.rotate_mib)):
            kp, ks, kz = jax.random.split(jax.random.fold_in(key, i), 3)
            packed = jax.random.bits(kp, (k // 8, n), jnp.uint32)
            scales = jax.random.uniform(ks, (k // GROUP, n), jnp.bfloat16, 0.01, 0.02)
            zeros = jax.random.randint(kz, (k // GROUP, n), 0, 16, jnp.int32)
            weights.append((packed, scales, zeros))
        dense = [
            jax.random.normal(jax.random.fold_in(key, 1000 + i), (k, n), jnp.bfloat16)
            for i in range(_copies(2 * k * n, cfg.rotate_mib))
        ]
        for m in cfg.int4_m:
            x = jax.random.normal(jax.random.fold_in(key, 10_000 + m), (m, k), jnp.bfloat16)
            io_bytes = 2 * m * (k + n)
            t4 = _median_seconds(q4, [(x, *w) for w in weights], cfg.reps, cfg.inner)
            t16 = _median_seconds(dot, [(x, w) for w in dense], cfg.reps, cfg.inner)
            row = {
                "K": k,
                "N": n,
                "M": m,
                "int4_us": 1e6 * t4,
                "bf16_us": 1e6 * t16,
                "int4_gb_s": (w_bytes + io_bytes) / t4 / 1e9,
                "bf16_gb_s": (2 * k * n + io_bytes) / t16 / 1e9,
                "speedup": t16 / t4,
            }
            print("int4 " + json.dumps(row))
            rows.append(row)
        del weights, dense
    return rows


def _decode_problem(rng, batch, context, copies):
    """Paged pool with `copies` disjoint sets of shuffled block tables, plus contiguous KV."""
    s, kh, d = ATTN_BLOCK, ATTN_KV_HEADS, ATTN_HEAD_DIM
    per_seq = -(-context // s)
    num_blocks = copies * batch * per_seq
    key = jax.random.key(int(rng.integers(1 << 30)))
    k_pages = jax.random.normal(key, (num_blocks, kh, s, d), jnp.bfloat16)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), (num_blocks, kh, s, d), jnp.bfloat16)
    order = rng.permutation(num_blocks).astype(np.int32).reshape(copies, batch, per_seq)
    query_start = jnp.arange(batch + 1, dtype=jnp.int32)
    seq_lens = jnp.full((batch,), context, jnp.int32)
    paged, dense = [], []
    for c in range(copies):
        q = jax.random.normal(jax.random.fold_in(key, 2 + c), (batch, ATTN_HEADS, d), jnp.bfloat16)
        paged.append((q, k_pages, v_pages, query_start, seq_lens, jnp.asarray(order[c])))
        kd = jax.random.normal(
            jax.random.fold_in(key, 100 + c), (batch, context, kh, d), jnp.bfloat16
        )
        dense.append((q, kd, kd + 1))  # [B, C, K, D] each
    return paged, dense


@jax.jit
def _contiguous_decode_attention(q, k, v):
    """XLA attention of one query per sequence over contiguous KV `[B, C, K, D]`."""
    b, h, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, kh, h // kh, d)  # [B, K, G, D]
    s = jnp.einsum("bkgd,bckd->bkgc", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    p = jax.nn.softmax(s, axis=-1)  # [B, K, G, C] float32
    o = jnp.einsum("bkgc,bckd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, h, d).astype(q.dtype)


def bench_attention(cfg: BenchConfig) -> list[dict]:
    rng = np.random.default_rng(2)
    paged_op = jax.jit(ragged_paged_attention)
    rows = []
    for context in cfg.contexts:
        for batch in cfg.batches:
            kv_bytes = 2 * batch * context * ATTN_KV_HEADS * ATTN_HEAD_DIM * 2  # k + v, bf16
            paged, dense = _decode_problem(rng, batch, context, _copies(kv_bytes, cfg.rotate_mib))
            t_paged = _median_seconds(paged_op, paged, cfg.reps, cfg.inner)
            t_dense = _median_seconds(_contiguous_decode_attention, dense, cfg.reps, cfg.inner)
            row = {
                "context": context,
                "batch": batch,
                "paged_us": 1e6 * t_paged,
                "contiguous_us": 1e6 * t_dense,
                "paged_gb_s": kv_bytes / t_paged / 1e9,
                "contiguous_gb_s": kv_bytes / t_dense / 1e9,
                "overhead": t_paged / t_dense,
            }
            print("attention " + json.dumps(row))
            rows.append(row)
            del paged, dense
    return rows


# ----------------------------------------------------------------------------- main


def _table(results: dict) -> str:
    lines = []
    if "copy" in results:
        lines.append(f"bandwidth ceiling (read+write stream): {results['copy']['gb_s']:.0f} GB/s")
    if results.get("int4"):
        lines.append(
            f"{'K x N':>12} {'M':>4} {'int4 us':>9} {'GB/s':>7} {'bf16 us':>9} {'GB/s':>7} {'x':>6}"
        )
        for r in results["int4"]:
            lines.append(
                f"{r['K']:>5} x {r['N']:<5} {r['M']:>4} {r['int4_us']:>9.1f} {r['int4_gb_s']:>7.0f}"
                f" {r['bf16_us']:>9.1f} {r['bf16_gb_s']:>7.0f} {r['speedup']:>6.2f}"
            )
    if results.get("attention"):
        lines.append(
            f"{'context':>8} {'B':>4} {'paged us':>9} {'GB/s':>7} {'contig us':>10} {'GB/s':>7}"
            f" {'ovh':>6}"
        )
        for r in results["attention"]:
            lines.append(
                f"{r['context']:>8} {r['batch']:>4} {r['paged_us']:>9.1f} {r['paged_gb_s']:>7.0f}"
                f" {r['contiguous_us']:>10.1f} {r['contiguous_gb_s']:>7.0f} {r['overhead']:>6.2f}"
            )
    if "correctness" in results:
        ok = all(r["ok"] for r in results["correctness"])
        lines.append(
            f"correctness: {'all ok' if ok else 'FAILURES'} ({len(results['correctness'])} cases)"
        )
    for name, error in results.get("errors", {}).items():
        lines.append(f"{name}: FAILED ({error.splitlines()[0][:200] if error else ''})")
    return "\n".join(lines)


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    device = jax.devices()[0]
    cfg = BenchConfig(
        workdir=_WORKDIR.value,
        int4_m=tuple(int(v) for v in _INT4_M.value),
        contexts=tuple(int(v) for v in _CONTEXTS.value),
        batches=tuple(int(v) for v in _BATCHES.value),
        reps=_REPS.value,
        inner=_INNER.value,
        rotate_mib=_ROTATE_MIB.value,
        copy_mib=_COPY_MIB.value,
        skip_timing=_SKIP_TIMING.value,
        platform=device.platform,
        device_kind=device.device_kind,
        jax_version=jax.__version__,
    )
    common.save_config(cfg.workdir, resolved=dataclasses.asdict(cfg))
    on_gpu = cfg.platform == "gpu"
    print(f"device: {cfg.device_kind} ({cfg.platform}), jax {cfg.jax_version}")

    results: dict = {"config": dataclasses.asdict(cfg), "errors": {}}
    sections = [("correctness", lambda: check_correctness(on_gpu))]
    if not on_gpu:
        results["timing"] = "skipped: timings need a GPU (the kernels ran in interpret mode)"
        print("timings need a GPU: only the interpret-mode correctness check ran on", cfg.platform)
    elif not cfg.skip_timing:
        sections += [
            ("copy", lambda: bench_copy(cfg)),
            ("int4", lambda: bench_int4(cfg)),
            ("attention", lambda: bench_attention(cfg)),
        ]
    # One device run has to count: a section that fails is recorded and the others still run,
    # and results.json is rewritten (atomically: this run's, so far) after every section.
    for name, run in sections:
        try:
            results[name] = run()
        except Exception as e:  # noqa: BLE001 (recorded, reported, and the exit status says so)
            results["errors"][name] = f"{type(e).__name__}: {e}"[:4000]
            print(f"FAIL {name}: {results['errors'][name]}")
        common.write_results(cfg.workdir, results)
    print(_table(results))
    if results["errors"] or not all(r["ok"] for r in results.get("correctness", [])):
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
