r"""The engine's token-bucket cost table, measured in several fresh processes: the buckets kept.

    python -m experiments.bucket_tables --workdir=runs/bucket_tables          # SmolLM2, 6 processes
    python -m experiments.bucket_tables --model=target --processes=3

An engine with `token_buckets="measured"` times its step's products (every layer's projections,
then the head) at T = 1, 2, 4, 8, 16 once per process (`jaxinfer/engine/buckets.py`) and keeps a
bucket when it saves at least the margin of the next kept one. A bucket whose saving sits near
the margin is kept in one process and dropped in another, and two engines in two processes (a
server and its in-process twin) then pad their steps differently; `EngineConfig(token_buckets=
...)` fixes them. Each process here loads the model, lays it out as an engine does (on a CPU:
`TransposedDense` weights), measures the table and prints the kept buckets and the table in ms.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

from absl import app, flags

from experiments import common

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "A ji.models name or a path.")
_PROCESSES = flags.DEFINE_integer("processes", 6, "Fresh processes, one table each.", lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json and results.json go.")
_CONFIG = common.config_flag()

_CHILD = """
import json, sys
import jaxinfer as ji
from jaxinfer.engine.buckets import choose_buckets, cost_table
from jaxinfer.model.params import remembered_loop_layout
from jaxinfer.ops.backend import resolve_platform
cfg, params = ji.load_checkpoint(sys.argv[1])
params = remembered_loop_layout(params, resolve_platform())  # the layout an engine steps on
table = cost_table(cfg, params, [1, 2, 4, 8, 16])
print(json.dumps({"kept": choose_buckets(table), "ms": {t: 1e3 * s for t, s in table.items()}}))
"""


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    path = common.resolve_model(_MODEL.value)
    if _WORKDIR.value:
        common.save_config(_WORKDIR.value, resolved={"model": path})
    load0, rows = common.load_average(), []
    for i in range(_PROCESSES.value):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, path], capture_output=True, text=True, check=True
        ).stdout
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        ms = ", ".join(f"{t}: {v:.2f}" for t, v in row["ms"].items())
        print(f"process {i}: kept {tuple(row['kept'])}, ms {{{ms}}}", flush=True)
    counts = Counter(tuple(r["kept"]) for r in rows)
    print(f"\n{_MODEL.value}: load average {load0} -> {common.load_average()}")
    for kept, n in counts.most_common():
        print(f"{kept}: {n} of {len(rows)} processes")
    if _WORKDIR.value:
        common.write_results(_WORKDIR.value, {
            "model": _MODEL.value, "load_average": [load0, common.load_average()], "rows": rows,
            "counts": {str(k): n for k, n in counts.items()},
        })  # fmt: skip


if __name__ == "__main__":
    app.run(main)
