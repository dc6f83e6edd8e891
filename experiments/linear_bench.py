r"""The CPU weight layouts in the model step: `inference_layout` ([in, out]) against `cpu_layout`.

    python -m experiments.linear_bench --workdir=runs/linear_bench            # SmolLM2
    python -m experiments.linear_bench --model=target --rows=1,2,4,8,16,32

Times one jitted paged `forward` step (cache donated, as the engine and the loops run it) of the
model at each --rows: T decode rows of T sequences at context --context (a batch-T decode step,
or one sequence verifying T - 1 drafts: the weights see the same T rows), and one --prompt-token
prefill. The two layouts alternate call by call, so both see the same background load; each
cell is the median of --reps calls, and the table gives each layout's step over its own T = 1
step (what speculation and batching pay per extra row) and cpu_layout's step over
inference_layout's. The GEMMs are what changes: `[T, in] @ [in, out]` against the transposed
weight's multiply-and-sum (`jaxinfer.transposed`).
"""

from __future__ import annotations

import json
import os
import platform

import jax
import jax.numpy as jnp
from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer.cache.metadata import SeqChunk, bucket, build_metadata
from jaxinfer.model.params import cpu_layout, inference_layout

_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json and results.json go.")
_CONFIG = common.config_flag()
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "A ji.models name or path.")
_ROWS = flags.DEFINE_list("rows", ["1", "2", "3", "5", "8", "16", "32"], "Decode rows T.")
_PROMPT = flags.DEFINE_integer(
    "prompt", 200, "Prefill row: prompt tokens (0: none).", lower_bound=0
)
_CONTEXT = flags.DEFINE_integer("context", 256, "Context of each decoding row.", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 9, "Timed calls per layout and row (median).", lower_bound=1)
flag_checks.int_list(_ROWS, min_value=1)
BLOCK = 16
LAYOUTS = ("inference_layout", "cpu_layout")


def _batch(t: int, prompt: int | None):
    """T decode rows at --context (each its own sequence), or one prompt: (meta, num_blocks)."""
    if prompt:
        spec = [(0, prompt)]
    else:
        spec = [(_CONTEXT.value, 1)] * t
    need = [-(-(start + q) // BLOCK) for start, q in spec]
    chunks, used = [], 1  # block 0 is the null block
    for (start, q), n in zip(spec, need):
        chunks.append(SeqChunk([5] * q, start, list(range(used, used + n))))
        used += n
    tokens = sum(q for _, q in spec)
    meta, _ = build_metadata(
        chunks, BLOCK, num_tokens=bucket(tokens), num_seqs=len(spec), max_blocks=max(need),
        num_logits=len(spec),
    )  # fmt: skip
    return ji.BatchMetadata(*(jnp.asarray(x) for x in meta.__dict__.values())), used


def _time_row(cfg, laid: dict, meta, num_blocks: int) -> dict:
    """Median step ms of each layout (name -> params), the layouts alternating call by call."""
    runs = {k: (p, "xla", ji.init_cache(cfg, num_blocks, BLOCK)) for k, p in laid.items()}
    return common.interleaved_step_ms(cfg, meta, runs, _REPS.value)


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    path = common.resolve_model(_MODEL.value)
    if _WORKDIR.value:
        common.save_config(_WORKDIR.value, resolved={"model": path})
    cfg, params = ji.load_checkpoint(path)
    laid = {"inference_layout": inference_layout(params), "cpu_layout": cpu_layout(params)}
    del params
    load0 = common.load_average()
    rows = []
    cases = [(int(t), None) for t in _ROWS.value] + ([(1, _PROMPT.value)] if _PROMPT.value else [])
    for t, prompt in cases:
        meta, nb = _batch(t, prompt)
        ms = _time_row(cfg, laid, meta, nb)
        row = {"rows": prompt or t, "kind": "prefill" if prompt else "decode", "ms": ms}
        row["ratio"] = ms["cpu_layout"] / ms["inference_layout"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    one = next((r["ms"] for r in rows if r["kind"] == "decode" and r["rows"] == 1), None)
    print(f"\n{_MODEL.value}: load average {load0} -> {common.load_average()}, {_REPS.value} reps")
    print(
        "\n| kind | T | inference_layout ms | cpu_layout ms | cpu / inference |"
        " inference / its T=1 | cpu / its T=1 |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rel = [common.fmt(r["ms"][k] / one[k], 2) + "x" if one else "—" for k in LAYOUTS]
        print(
            f"| {r['kind']} | {r['rows']} | {r['ms']['inference_layout']:.1f} | "
            f"{r['ms']['cpu_layout']:.1f} | {r['ratio']:.2f}x | {rel[0]} | {rel[1]} |"
        )
    if _WORKDIR.value:
        common.write_results(_WORKDIR.value, {
            "model": _MODEL.value,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}",
            "load_average": [load0, common.load_average()],
            "rows": rows,
        })  # fmt: skip


if __name__ == "__main__":
    app.run(main)
