r"""A/B of one jitted paged `forward` step under switches of the CPU path, in one process.

    python -m experiments.step_ab --compare=changes --workdir=runs/step_ab      # SmolLM2
    python -m experiments.step_ab --compare=chunk_keys --contexts=256,1000,100 --rows=1,8
    python -m experiments.step_ab --compare=row_forms --rows=1,2,3,5,8,16

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
              with the NT GEMM at every T.
Each case is T decode rows (--rows) at each of --contexts (T sequences, one row each) and, with
--prompt, one prefill of that many tokens. The variants alternate call by call (the loop of
`common.interleaved_step_ms`, each variant traced under its own settings), median of --reps
calls (15); the table gives every variant's step over the first's.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time

import jax
from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from experiments import linear_bench as lb  # its --rows / --context / --prompt batches
from jaxinfer import transposed
from jaxinfer.model import params as params_mod
from jaxinfer.model.decoder import forward
from jaxinfer.ops import attention

# linear_bench's flags are ours: --workdir, --config, --model, --rows, --context (unused: see
# --contexts), --prompt, --reps.
_CONTEXTS = flags.DEFINE_list("contexts", ["256"], "Contexts of the decode rows.")
_COMPARE = flags.DEFINE_enum(
    "compare", "changes", ["changes", "chunk_keys", "row_forms"], "Which variants."
)
flag_checks.int_list(_CONTEXTS, min_value=1)
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
):
    """Module settings the variant is laid out and traced under, restored after."""
    names = {
        (params_mod, "FUSED"): fused,
        (attention, "_ONE_CHUNK_KEYS"): one_chunk_keys,
        (attention, "_KEYS_PER_CHUNK"): keys_per_chunk,
        (transposed, "REDUCE_MAX_ROWS"): reduce_max_rows,
        (transposed, "ROW_BLOCKS"): row_blocks,
        (transposed, "PAD_ROWS"): pad_rows,
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


def variants(params) -> dict:
    """name -> (laid-out params, settings) for --compare."""
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
    return {
        "blocked (as shipped)": (laid, {}),
        "blocked, rows not padded": (laid, {"pad_rows": 0}),
        "multiply-and-sum": (laid, {"row_blocks": 0}),
        "x @ w": (params_mod.inference_layout(params), {}),
        "NT GEMM": (laid, {"reduce_max_rows": 1}),
    }


def time_case(cfg, runs: dict, meta, num_blocks: int) -> dict:
    """Median step ms of each variant, each traced under its settings, calls alternating."""
    steps, caches = {}, {}
    for name, (laid, settings) in runs.items():
        steps[name] = jax.jit(
            lambda p, batch, cache: forward(p, cfg, batch, cache, backend="xla"),
            donate_argnums=(2,),
        )  # a fresh function per variant: its own trace, under its own settings
        caches[name] = ji.init_cache(cfg, num_blocks, lb.BLOCK)
        with _settings(**settings):
            for _ in range(2):  # compile, warm up
                logits, caches[name] = steps[name](laid, meta, caches[name])
            logits.block_until_ready()
    seconds = {name: [] for name in runs}
    for _ in range(lb._REPS.value):
        for name, (laid, _) in runs.items():
            t0 = time.perf_counter()
            logits, caches[name] = steps[name](laid, meta, caches[name])
            logits.block_until_ready()
            seconds[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(v) for name, v in seconds.items()}


def main(argv):
    del argv
    common.apply_config(lb._CONFIG.value)
    path = common.resolve_model(lb._MODEL.value)
    if lb._WORKDIR.value:
        common.save_config(lb._WORKDIR.value, resolved={"model": path})
    cfg, params = ji.load_checkpoint(path)
    runs = variants(params)
    del params
    load0 = common.load_average()
    cases = [(int(c), int(t), None) for c in _CONTEXTS.value for t in lb._ROWS.value]
    if lb._PROMPT.value:
        cases.append((0, 1, lb._PROMPT.value))
    rows = []
    for context, t, prompt in cases:
        if not prompt:
            flags.FLAGS.context = context
        meta, nb = lb._batch(t, prompt)
        ms = time_case(cfg, runs, meta, nb)
        first = next(iter(ms.values()))
        row = {
            "kind": "prefill" if prompt else "decode", "context": context, "rows": prompt or t,
            "ms": ms, "ratio": {k: v / first for k, v in ms.items()},
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    names = list(runs)
    print(f"\n{lb._MODEL.value}, --compare={_COMPARE.value}: load average {load0} -> "
          f"{common.load_average()}, {lb._REPS.value} calls per cell")  # fmt: skip
    print(f"\n| kind | context | T | {names[0]} ms | " + " | ".join(names[1:]) + " |")
    print("|---|---|---|---|" + "---|" * (len(names) - 1))
    for r in rows:
        cells = " | ".join(f"{r['ms'][k]:.1f} ms ({r['ratio'][k]:.3f}x)" for k in names[1:])
        ctx = r["context"] or "—"
        print(f"| {r['kind']} | {ctx} | {r['rows']} | {r['ms'][names[0]]:.1f} | {cells} |")
    if lb._WORKDIR.value:
        common.write_results(lb._WORKDIR.value, {
            "model": lb._MODEL.value, "compare": _COMPARE.value,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}",
            "load_average": [load0, common.load_average()], "rows": rows,
        })  # fmt: skip


if __name__ == "__main__":
    app.run(main)
