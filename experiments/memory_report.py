r"""Memory table: weight bytes, KV bytes per token and sequences that fit, from shapes only.

    python -m experiments.memory_report --workdir=/tmp/jaxinfer_runs/memory
    python -m experiments.memory_report --models=llama3-8b --weight_formats=bf16,w4g128 \
        --kv_formats=bf16,fp8 --seq_len=8192 --gpu_gib=141 --workdir=/tmp/jaxinfer_runs/memory

Nothing is allocated: shapes come from `jax.eval_shape` (see `jaxinfer/memory.py`). Writes
`<workdir>/config.json` (the flags) and `<workdir>/results.json` (one row per model x weight
format x KV format), and prints the table.
"""

from __future__ import annotations

import os

from absl import app, flags

from experiments import common, flag_checks
from jaxinfer import memory, models
from jaxinfer.config import PRESETS

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
_CONFIG = common.config_flag()
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
    common.apply_config(_CONFIG.value)
    workdir = _WORKDIR.value
    configs = {name: common.model_config(name) for name in _MODELS.value}  # before any write
    common.save_config(workdir)
    gpu = f"{_GPU_GIB.value:g} GiB"
    rows = memory.memory_table(
        configs, tuple(_WEIGHTS.value), tuple(_KV.value), seq_lens=(_SEQ_LEN.value,),
        gpus={gpu: _GPU_GIB.value}, reserve_gib=_RESERVE_GIB.value, block_size=_BLOCK_SIZE.value,
    )  # fmt: skip
    table = memory.markdown_table(rows)
    note = (
        f"Sequences of {_SEQ_LEN.value} tokens whose KV fits in a {gpu} GPU beside the weights "
        f"and a {_RESERVE_GIB.value:g} GiB reserve (block size {_BLOCK_SIZE.value}); "
        "GB = 1e9 B, GiB = 2^30 B; scales and zeros counted."
    )
    print(table + "\n" + note)
    with open(os.path.join(workdir, "memory.md"), "w") as f:
        f.write(note + "\n\n" + table)
    common.write_results(workdir, {"rows": rows})


if __name__ == "__main__":
    app.run(main)
