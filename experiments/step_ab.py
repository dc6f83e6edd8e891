r"""A/B of one jitted paged `forward` step under switches of the CPU path, in one process.

    python -m experiments.step_ab --compare=changes --workdir=runs/step_ab      # SmolLM2
    python -m experiments.step_ab --compare=chunk_keys --contexts=256,1000,100 --rows=1,8
    python -m experiments.step_ab --compare=row_forms --rows=1,2,3,5,8,16
    python -m experiments.step_ab --compare=attention --rows=1,8 --verify=5 --prompts=8
    python -m experiments.step_ab --compare=row_forms --rows=1 --verify=1,2,3,4,5,8 --prompt=0
    python -m experiments.step_ab --compare=row_forms --rows=1 --prompt=0 --products=1,2,3,4,5,8,16
    python -m experiments.step_ab --compare=w8a16 --rows=1,2,5,8,16 --verify=5 --prompt=200

--compare picks the variants, each a layout of the same params and the module settings it is
traced under (a variant's program is compiled with its settings and keeps them):
  changes     before: `cpu_layout` with q/k/v and gate/up apart and the attention's 128-key
              chunk loop at every context; after: both as shipped (fused projections, one chunk
              for a table of <= 512 keys);
  chunk_keys  keys per attention chunk 64 / 128 / 256 / 512 (one chunk below 512 keys off), to
              see what a single chunk buys against the loop;
  row_forms   the weights' product at T rows: `cpu_layout` as shipped (the blocked product at
              2-16 rows, 5-7 padded to 8 and 9-15 to 16), the same without the padding, its
              multiply-and-sum, `x @ w` (`inference_layout`), and `cpu_layout`
              with the NT GEMM at every T;
  attention   the step as shipped against the same step with the attention op replaced by
              the identity (its output is its query): the second's time over the first's is
              the step without attention, so one minus it is attention's share;
  w8a16       float32 weights against narrow ones in two layouts: as stored, `[in, out]`,
  w4a16       which XLA dequantizes whole before each dot (the layout before 2026-12-06),
  gguf        and `cpu_layout` as shipped (a scan over blocks of output rows up to 16 rows;
              `jaxinfer.transposed`). W8A16: RTN int8, one scale per output channel; W4A16:
              RTN int4, groups of 32; gguf: the model's GGUF tensors as stored (Q4_1, Q8_0).
Each case is T decode rows (--rows, padded to a power of two as the decode loops' batches are)
at each of --contexts (T sequences, one row each); with --verify, one sequence at each of
--contexts appending T rows with the logits of every row (a speculative verification of T - 1
drafts: T = 1 is a plain decode step, so "x its T = 1" is the verification's cost in steps);
with --prompt, --prompts prefills of that many tokens each in one ragged step (padded as
`ji.generate` pads its prefill); and, with --products, the layers' products alone at T rows
(`products`: no attention, no head; what a row form changes). The variants alternate call by
call (each traced under its own settings), median of --reps calls (15); the table gives every
variant's time over the first's.
"""

from __future__ import annotations

import contextlib
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
from experiments import linear_bench as lb  # its flags and block size
from jaxinfer import quant, transposed
from jaxinfer.cache.metadata import SeqChunk, bucket, build_metadata
from jaxinfer.engine.buckets import layer_products
from jaxinfer.model import attention as model_attention
from jaxinfer.model import params as params_mod
from jaxinfer.model.decoder import forward
from jaxinfer.ops import attention
from jaxinfer.requests import prompt_bucket

# linear_bench's flags are ours: --workdir, --config, --model, --rows, --context (unused: see
# --contexts), --prompt, --reps; its batches are ours too (`case_batch`, with two more kinds).
_CONTEXTS = flags.DEFINE_list("contexts", ["256"], "Contexts of the decode rows.")
_VARIANTS = ["changes", "chunk_keys", "row_forms", "attention", "w8a16", "w4a16", "gguf"]
_COMPARE = flags.DEFINE_enum("compare", "changes", _VARIANTS, "Which variants.")
_VERIFY = flags.DEFINE_list("verify", [], "Rows T of one verifying sequence per context.")
_PRODUCTS = flags.DEFINE_list("products", [], "Rows T of the layers' products alone.")
_PROMPTS = flags.DEFINE_integer(
    "prompts", 1, "Prompts of --prompt tokens per prefill.", lower_bound=1
)
flag_checks.int_list(_CONTEXTS, min_value=1)
flag_checks.int_list(_VERIFY, min_value=1, allow_empty=True)
flag_checks.int_list(_PRODUCTS, min_value=1, allow_empty=True)
flags.FLAGS.set_default("rows", ["1", "5", "8"])
flags.FLAGS.set_default("reps", 15)


@contextlib.contextmanager
def _settings(
    fused=None,
    one_chunk_keys=None,
    keys_per_chunk=None,
    reduce_max_rows=None,
    row_blocks=None,
    pad_rows=None,
    attention_op=None,
):
    """Module settings the variant is laid out and traced under, restored after."""
    names = {
        (params_mod, "FUSED"): fused,
        (attention, "_ONE_CHUNK_KEYS"): one_chunk_keys,
        (attention, "_KEYS_PER_CHUNK"): keys_per_chunk,
        (transposed, "REDUCE_MAX_ROWS"): reduce_max_rows,
        (transposed, "ROW_BLOCKS"): row_blocks,
        (transposed, "PAD_ROWS"): pad_rows,
        (model_attention, "paged_attention"): attention_op,
    }
    saved = {k: getattr(*k) for k, v in names.items() if v is not None}
    try:
        for (mod, name), v in names.items():
            if v is not None:
                setattr(mod, name, v)
        yield
    finally:
        for (mod, name), v in saved.items():
            setattr(mod, name, v)


class _NotQuantized:
    """Stands in for the quantized types in `cpu_layout`: their weights keep their own layout."""


def _narrow(params, cfg, path: str) -> tuple[str, dict]:
    """(format name, weights) of a --compare of narrow weights."""
    if _COMPARE.value == "gguf":
        return "GGUF as stored", ji.load_checkpoint(path, keep_quantized=True)[1]
    bits, group = {"w8a16": (8, None), "w4a16": (4, 32)}[_COMPARE.value]
    calib = np.zeros((1, 16), np.int32)  # RTN reads no calibration data
    name = "W8A16" if bits == 8 else f"W4A16 g{group}"
    return name, quant.quantize(cfg, params, quant.QuantConfig("rtn", bits, group), calib)


def variants(params, cfg, path: str) -> dict:
    """name -> (laid-out params, settings) for --compare."""
    if _COMPARE.value in ("w8a16", "w4a16", "gguf"):
        name, q = _narrow(params, cfg, path)
        saved = params_mod.Int8Weight, params_mod.Int4Weight
        params_mod.Int8Weight = params_mod.Int4Weight = _NotQuantized
        try:
            whole = params_mod.cpu_layout(q)
        finally:
            params_mod.Int8Weight, params_mod.Int4Weight = saved
        return {
            "float32": (params_mod.cpu_layout(params), {}),
            f"{name}, whole-matrix dequantize (before)": (whole, {}),
            f"{name}, blocked (ships)": (params_mod.cpu_layout(q), {}),
        }
    if _COMPARE.value == "changes":
        with _settings(fused={}):
            apart = params_mod.cpu_layout(params)
        return {
            "before": (apart, {"one_chunk_keys": 0}),
            "after": (params_mod.cpu_layout(params), {}),
        }
    if _COMPARE.value == "chunk_keys":
        laid = params_mod.cpu_layout(params)
        return {
            f"{k} keys": (laid, {"one_chunk_keys": 0, "keys_per_chunk": k})
            for k in (128, 64, 256, 512)
        }
    laid = params_mod.cpu_layout(params)
    if _COMPARE.value == "attention":
        return {
            "as shipped": (laid, {}),
            "attention = identity": (laid, {"attention_op": lambda q, *args, **kw: q}),
        }
    return {
        "blocked (as shipped)": (laid, {}),
        "blocked, rows not padded": (laid, {"pad_rows": 0}),
        "multiply-and-sum": (laid, {"row_blocks": 0}),
        "x @ w": (params_mod.inference_layout(params), {}),
        "NT GEMM": (laid, {"reduce_max_rows": 1}),
    }


def case_batch(kind: str, context: int, t: int):
    """The step of one case: (metadata, blocks used). "decode": T sequences at `context`, one
    row each, T padded to a power of two (linear_bench's batch); "verify": one sequence at
    `context` appending T rows, every row's logits, T as it is (the speculative loop's); "prefill":
    --prompts prompts of T tokens from position 0, each last row's logits, the tokens and block
    tables padded as `ji.generate`'s prefill (`requests.prompt_batch`)."""
    spec = {
        "decode": [(context, 1, "last")] * t,
        "verify": [(context, t, "all")],
        "prefill": [(0, t, "last")] * _PROMPTS.value,
    }[kind]
    chunks, used = [], 1  # block 0 is the null block
    for start, q, logits in spec:
        n = -(-(start + q) // lb.BLOCK)
        chunks.append(SeqChunk([5] * q, start, list(range(used, used + n)), logits))
        used += n
    tokens = sum(q for _, q, _ in spec)
    if kind == "prefill":
        num_tokens = prompt_bucket(tokens)
        max_blocks = bucket(-(-num_tokens // lb.BLOCK))
    else:
        num_tokens = bucket(tokens) if kind == "decode" else tokens
        max_blocks = max(len(c.block_table) for c in chunks)
    meta, _ = build_metadata(
        chunks, lb.BLOCK, num_tokens=num_tokens, num_seqs=len(spec), max_blocks=max_blocks,
        num_logits=t if kind == "verify" else len(spec),
    )  # fmt: skip
    return ji.BatchMetadata(*(jnp.asarray(x) for x in meta.__dict__.values())), used


def _alternate(calls: dict) -> dict:
    """Median ms of each no-argument call (name -> call, each returning an array), after two
    warm-up calls each, the calls alternating for --reps rounds."""
    for call in calls.values():
        for _ in range(2):  # compile, warm up
            call().block_until_ready()
    seconds = {name: [] for name in calls}
    for _ in range(lb._REPS.value):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call().block_until_ready()
            seconds[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(v) for name, v in seconds.items()}


def time_case(cfg, runs: dict, meta, num_blocks: int) -> dict:
    """Median step ms of each variant, each traced under its settings, calls alternating."""
    calls = {}
    for name, (laid, settings) in runs.items():
        step = jax.jit(
            lambda p, batch, cache: forward(p, cfg, batch, cache, backend="xla"),
            donate_argnums=(2,),
        )  # a fresh function per variant: its own trace, under its own settings
        state = {"cache": ji.init_cache(cfg, num_blocks, lb.BLOCK)}

        def call(step=step, laid=laid, state=state):
            logits, state["cache"] = step(laid, meta, state["cache"])
            return logits

        with _settings(**settings):
            call()  # traced under the variant's settings; the program keeps them
        calls[name] = call
    return _alternate(calls)


def products(cfg, laid: dict, x: jax.Array) -> jax.Array:
    """The layers' products alone at `x [T, E]`: q/k/v, the output projection on q, the MLP
    (with its norm and the RoPE of q/k, which cost little), no attention, no LM head."""
    for lp in laid["layers"]:
        x = layer_products(lp, x, cfg)  # [T, E], as the engine's bucket cost table times it
    return x


def time_products(cfg, runs: dict, t: int) -> dict:
    """Median ms of `products` at T rows for each variant, calls alternating."""
    x = jnp.ones((t, cfg.hidden_size), jnp.float32) / cfg.hidden_size  # [T, E]
    calls = {}
    for name, (laid, settings) in runs.items():
        fn = jax.jit(lambda p, x: products(cfg, p, x))  # a fresh function per variant

        def call(fn=fn, laid=laid):
            return fn(laid, x)

        with _settings(**settings):
            call()
        calls[name] = call
    return _alternate(calls)


def main(argv):
    del argv
    common.apply_config(lb._CONFIG.value)
    path = common.resolve_model(lb._MODEL.value)
    if lb._WORKDIR.value:
        common.save_config(lb._WORKDIR.value, resolved={"model": path})
    cfg, params = ji.load_checkpoint(path)
    runs = variants(params, cfg, path)
    del params
    load0 = common.load_average()
    cases = [("decode", int(c), int(t)) for c in _CONTEXTS.value for t in lb._ROWS.value]
    cases += [("verify", int(c), int(t)) for c in _CONTEXTS.value for t in _VERIFY.value]
    if lb._PROMPT.value:
        cases.append(("prefill", 0, lb._PROMPT.value))
    cases += [("products", 0, int(t)) for t in _PRODUCTS.value]
    rows = []
    for kind, context, t in cases:
        if kind == "products":
            ms = time_products(cfg, runs, t)
        else:
            meta, nb = case_batch(kind, context, t)
            ms = time_case(cfg, runs, meta, nb)
        first = next(iter(ms.values()))
        row = {
            "kind": kind, "context": context, "rows": t,
            "seqs": {"prefill": _PROMPTS.value, "decode": t, "verify": 1}.get(kind),
            "ms": ms, "ratio": {k: v / first for k, v in ms.items()},
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    names = list(runs)
    one = {
        r["context"]: r["ms"][names[0]] for r in rows if r["kind"] == "verify" and r["rows"] == 1
    }  # a verification's cost in plain steps, where a T = 1 row was measured beside it
    print(f"\n{lb._MODEL.value}, --compare={_COMPARE.value}: load average {load0} -> "
          f"{common.load_average()}, {lb._REPS.value} calls per cell")  # fmt: skip
    print(
        f"\n| kind | context | T | sequences | {names[0]} ms | x its T = 1 | "
        + " | ".join(names[1:]) + " |"
    )  # fmt: skip
    print("|---|---|---|---|---|---|" + "---|" * (len(names) - 1))
    for r in rows:
        cells = " | ".join(f"{r['ms'][k]:.1f} ms ({r['ratio'][k]:.3f}x)" for k in names[1:])
        ctx = r["context"] or "—"
        steps = r["ms"][names[0]] / one[ctx] if r["kind"] == "verify" and ctx in one else None
        seqs = r["seqs"] or "—"
        print(f"| {r['kind']} | {ctx} | {r['rows']} | {seqs} | {r['ms'][names[0]]:.1f} | "
              f"{common.fmt(steps, 2)} | {cells} |")  # fmt: skip
    if lb._WORKDIR.value:
        common.write_results(lb._WORKDIR.value, {
            "model": lb._MODEL.value, "compare": _COMPARE.value,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}",
            "load_average": [load0, common.load_average()], "rows": rows,
        })  # fmt: skip


if __name__ == "__main__":
    app.run(main)
