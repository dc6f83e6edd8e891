r"""Memory table: weight bytes, KV bytes per token and sequences that fit, from shapes only.

    python experiments/memory_report.py --workdir=/tmp/jaxinfer_runs/memory
    python experiments/memory_report.py --models=llama3-8b --weight_formats=bf16,w4g128 \
        --kv_formats=bf16,fp8 --seq_len=8192 --gpu_gib=141 --workdir=/tmp/jaxinfer_runs/memory

Nothing is allocated: shapes come from `jax.eval_shape` (see `jaxinfer/memory.py`). Writes
`<workdir>/config.json` (the flags) and `<workdir>/results.json` (one row per model x weight
format x KV format), and prints the table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import app, flags

try:
    import jaxinfer  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxinfer import memory, models
from jaxinfer.config import PRESETS

try:
    from experiments import common, flag_checks
except ImportError:  # run as `python experiments/X.py`: experiments/ itself is on sys.path
    import common
    import flag_checks

_MODELS = flags.DEFINE_list(
    "models",
    ["llama2-7b", "llama3-8b", "mistral-7b", "qwen2.5-7b"],
    "Config presets, or names of ji.models (e.g. smollm2-135m: its config, no weights loaded).",
)
_WEIGHTS = flags.DEFINE_list(
    "weight_formats", ["bf16", "w8", "w4g128", "w3g128"], "Weight formats (see memory.py)."
)
_KV = flags.DEFINE_list("kv_formats", ["bf16", "int8", "fp8"], "KV-cache formats.")
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len", 4096, "Tokens per sequence (prompt + output).", lower_bound=1
)
_GPU_GIB = flags.DEFINE_float("gpu_gib", 80.0, "GPU memory in GiB (H100 80 GB: 80; H200: 141).")
_RESERVE_GIB = flags.DEFINE_float("reserve_gib", 2.0, "Workspace kept out of the KV budget.")
_BLOCK_SIZE = flags.DEFINE_integer(
    "block_size", 16, "KV block size (sequences hold whole blocks).", lower_bound=1
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json and results.json go.")
flags.mark_flag_as_required("workdir")
flag_checks.choice_list(_MODELS, sorted(PRESETS) + models.names())
flag_checks.each(_WEIGHTS, memory.parse_weight_format)
flag_checks.choice_list(_KV, memory.KV_FORMATS)
flag_checks.number(_GPU_GIB, above=0.0)
flag_checks.number(_RESERVE_GIB, min_value=0.0)
flags.register_multi_flags_validator(
    ["gpu_gib", "reserve_gib"],
    lambda f: f["reserve_gib"] < f["gpu_gib"],
    "--reserve_gib must be smaller than --gpu_gib",
)


def main(argv):
    del argv
    workdir = Path(_WORKDIR.value)
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "models": _MODELS.value,
        "weight_formats": _WEIGHTS.value,
        "kv_formats": _KV.value,
        "seq_len": _SEQ_LEN.value,
        "gpu_gib": _GPU_GIB.value,
        "reserve_gib": _RESERVE_GIB.value,
        "block_size": _BLOCK_SIZE.value,
    }
    (workdir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    rows = []
    header = (
        f"{'model':<12} {'weights':<8} {'kv':<5} {'params':>7} {'GB':>7} {'GiB':>7} "
        f"{'KV B/tok':>9} {'seqs':>6}"
    )
    print(header)
    print("-" * len(header))
    for name in _MODELS.value:
        cfg = common.model_config(name)
        for wf in _WEIGHTS.value:
            for kv in _KV.value:
                r = memory.memory_report(
                    cfg, wf, kv, seq_len=_SEQ_LEN.value, gpu_gib=_GPU_GIB.value,
                    reserve_gib=_RESERVE_GIB.value, block_size=_BLOCK_SIZE.value, model=name,
                )  # fmt: skip
                rows.append(r.to_dict())
                print(
                    f"{name:<12} {wf:<8} {kv:<5} {r.num_params / 1e9:>6.2f}B "
                    f"{r.weight_gb:>7.2f} {r.weight_gib:>7.2f} {r.kv_bytes_per_token:>9,} "
                    f"{r.max_sequences:>6}"
                )
    print(
        f"\nseqs: sequences of {_SEQ_LEN.value} tokens whose KV fits in {_GPU_GIB.value} GiB "
        f"beside the weights and a {_RESERVE_GIB.value} GiB reserve. GB = 1e9 B, GiB = 2^30 B."
    )
    (workdir / "results.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    md = [
        f"Sequences of {_SEQ_LEN.value} tokens whose KV fits in a {_GPU_GIB.value:g} GiB GPU "
        f"beside the weights and a {_RESERVE_GIB.value:g} GiB reserve (block size "
        f"{_BLOCK_SIZE.value}); GB = 1e9 B, GiB = 2^30 B; scales and zeros counted.",
        "",
        "| model | weights | KV | params | weights GB | weights GiB | KV bytes/token | seqs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r['model']} | {r['weight_format']} | {r['kv_format']} | {r['num_params'] / 1e9:.2f} B "
        f"| {r['weight_gb']:.2f} | {r['weight_gib']:.2f} | {r['kv_bytes_per_token']:,} "
        f"| {r['max_sequences']} |"
        for r in rows
    ]
    (workdir / "memory.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    app.run(main)
