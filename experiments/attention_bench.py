r"""Attention backends inside the model step, on engine-shaped batches: XLA path against oracle.

    python -m experiments.attention_bench --workdir=runs/attention_bench
    python -m experiments.attention_bench --backends=xla,reference,pallas   # on a GPU
    python -m experiments.attention_bench --backends=xla --kv_formats=float,int8,fp8

Times one jitted `forward` step (cache donated, as the engine runs it) of the shipped target on
batches shaped like the engine's: B = --num_seqs sequence rows and M = --max_blocks blocks per
sequence fixed, with

  decode      every row a decode (q_len 1) at context --context;
  decode_low  a quarter of the rows live (a lightly loaded server; the rest are padding);
  mixed       one prefill chunk of --chunk tokens plus decodes in the other rows;
  prefill     a single prompt of --prompt tokens (`ji.generate`'s prefill shape);

each at every --cache_blocks (the size of the KV pool: a backend that copies a layer's pages per
step gets slower as the pool grows, one that reads in place does not). Medians of --reps steps
after a warm-up; the systems of one row (each backend with each --kv_formats cache) alternate
step by step, so each one's ratio to the first is measured under the same load. Prints a table
and writes results.json.
"""

from __future__ import annotations

import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer.cache.metadata import SeqChunk, bucket, build_metadata
from jaxinfer.cache.paged import KV_FORMATS

_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json and results.json go.")
_CONFIG = common.config_flag()
_MODEL = flags.DEFINE_string("model", "target", "Shipped model name or HF dir.")
_BACKENDS = flags.DEFINE_list("backends", ["xla", "reference"], "Backends; the first is timed "
                              "against the second.")  # fmt: skip
_KV_FORMATS = flags.DEFINE_list(
    "kv_formats", ["float"], "Cache formats (float, int8, fp8); every backend runs each."
)
_CACHE_BLOCKS = flags.DEFINE_list(
    "cache_blocks", ["1025", "8193"], "KV pool sizes in blocks (raised to what a batch needs)."
)
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 32, "B: sequence rows of a step.", lower_bound=1)
_MAX_BLOCKS = flags.DEFINE_integer("max_blocks", 32, "M: blocks per sequence row.", lower_bound=1)
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "S: tokens per block.", lower_bound=1)
_CONTEXT = flags.DEFINE_integer("context", 300, "Context of each decoding sequence.", lower_bound=1)
_CHUNK = flags.DEFINE_integer("chunk", 128, "Prefill chunk of the mixed batch.", lower_bound=1)
_PROMPT = flags.DEFINE_integer("prompt", 256, "Prompt of the prefill batch.", lower_bound=1)
_REPS = flags.DEFINE_integer(
    "reps", 30, "Timed steps per backend (median reported).", lower_bound=1
)
flag_checks.choice_list(_BACKENDS, ji.ops.BACKENDS)
flag_checks.choice_list(_KV_FORMATS, KV_FORMATS)
flag_checks.int_list(_CACHE_BLOCKS, min_value=1)


def _batches(b: int, m: int, s: int) -> dict:
    """name -> (chunks, T): sequence chunks over disjoint random blocks of the first pool."""
    ctx, chunk, prompt = _CONTEXT.value, _CHUNK.value, _PROMPT.value
    specs = {
        "decode": [(ctx, 1)] * b,
        "decode_low": [(ctx, 1)] * max(1, b // 4),
        "mixed": [(0, chunk)] + [(ctx, 1)] * (b - 1),
        "prefill": [(0, prompt)],
    }
    rng = np.random.RandomState(0)
    out = {}
    for name, spec in specs.items():
        need = [-(-(start + q) // s) for start, q in spec]
        if max(need) > m:
            raise ValueError(f"{name}: a sequence needs {max(need)} blocks > --max_blocks={m}")
        blocks = 1 + rng.permutation(sum(need))  # block 0 is the null block
        chunks, used = [], 0
        for (start, q), n in zip(spec, need):
            chunks.append(SeqChunk([5] * q, start, blocks[used : used + n].tolist()))
            used += n
        tokens = sum(q for _, q in spec)
        out[name] = (chunks, bucket(tokens, 16), 1 + sum(need))
    return out


def _time_row(cfg, params, chunks, t, b, m, num_blocks, systems) -> dict:
    """Median step ms of each system: name -> (backend, kv_format)."""
    s = _BLOCK_SIZE.value
    meta, _ = build_metadata(chunks, s, num_tokens=t, num_seqs=b, max_blocks=m, num_logits=b)
    meta = ji.BatchMetadata(*(jnp.asarray(x) for x in meta.__dict__.values()))
    runs = {
        be: (params, backend, ji.init_cache(cfg, num_blocks, s, kv_format=kv_format))
        for be, (backend, kv_format) in systems.items()
    }
    return common.interleaved_step_ms(cfg, meta, runs, _REPS.value)


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    formats = _KV_FORMATS.value
    systems = {
        be if len(formats) == 1 else f"{be}/{fmt}": (be, fmt)
        for be in (ji.ops.resolve_backend(b) for b in _BACKENDS.value)
        for fmt in formats
    }  # name -> (backend, kv_format); the first is the baseline of the ratio
    backends = list(systems)
    model = _MODEL.value
    path = common.resolve_model(model)
    if _WORKDIR.value:
        common.save_config(_WORKDIR.value, resolved={"model": path, "systems": systems})
    cfg, params = ji.load_checkpoint(path)
    b, m, s = _NUM_SEQS.value, _MAX_BLOCKS.value, _BLOCK_SIZE.value
    rows = []
    for name, (chunks, t, min_blocks) in _batches(b, m, s).items():
        for pool in map(int, _CACHE_BLOCKS.value):
            pool = max(pool, min_blocks)
            ms = _time_row(cfg, params, chunks, t, b, m, pool, systems)
            row = {"batch": name, "T": t, "B": b, "M": m, "cache_blocks": pool, "ms": ms}
            # Each other system's step time over the first's (the baseline).
            row["ratio"] = {be: ms[be] / ms[backends[0]] for be in backends[1:]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    head = " | ".join(f"{be} ms" for be in backends)
    ratio_head = "".join(f" {be} / {backends[0]} |" for be in backends[1:])
    print(f"\n| batch | T | cache blocks | {head} |{ratio_head}")
    print("|---|---|---|" + "---|" * (2 * len(backends) - 1))
    for r in rows:
        cells = " | ".join(f"{r['ms'][be]:.2f}" for be in backends)
        ratios = "".join(f" {v:.2f}x |" for v in r["ratio"].values())
        print(f"| {r['batch']} | {r['T']} | {r['cache_blocks']} | {cells} |{ratios}")
    if _WORKDIR.value:
        result = {
            "model": model,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} "
            f"({jax.default_backend()})",
            "flags": {
                k: flags.FLAGS[k].value
                for k in (
                    "backends",
                    "kv_formats",
                    "cache_blocks",
                    "num_seqs",
                    "max_blocks",
                    "block_size",
                    "context",
                    "chunk",
                    "prompt",
                    "reps",
                )
            },  # fmt: skip
            "rows": rows,
        }
        common.write_results(_WORKDIR.value, result)


if __name__ == "__main__":
    app.run(main)
