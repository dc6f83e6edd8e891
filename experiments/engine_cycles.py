r"""Reads the engine's per-cycle log (`ji.EngineConfig(cycle_log=path)`) into acceptance-by-position
and cost tables.

    python -m experiments.engine_cycles --log=runs/serve/cycles.jsonl

Prints, from the log alone:
  * the acceptance counters (cycles, proposed, accepted; reached / accepted per draft position,
    α_j = accepted_j / reached_j), the same numbers as `Engine.spec_counters`;
  * per γ: the speculative package's `summarize_log` of the cycles at that γ (α, tokens per cycle
    measured and predicted, median draft / verify ms);
  * a cost table: median draft ms, verify ms and committed tokens/s per (γ, batch size).
"""

from __future__ import annotations

import collections
import json

import numpy as np
from absl import app, flags

from jaxinfer.speculative.autotune import summarize_log
from jaxinfer.speculative.cycle_log import CycleRecord

_LOG = flags.DEFINE_string("log", None, "the engine's cycle log (JSONL)")


def _key(x):
    return tuple(_key(y) for y in x) if isinstance(x, list) else x


def read_engine_log(path: str) -> list[dict]:
    """The log's records; request ids written as JSON lists come back as tuples."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    for r in records:
        r["request_id"] = _key(r["request_id"])
    return records


def _steps(records: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = collections.defaultdict(list)
    for r in records:
        steps[r["step"]].append(r)
    return steps


def cycle_records(records: list[dict]) -> dict[int, list[CycleRecord]]:
    """γ -> the speculative package's `CycleRecord`s: one per step, over its drafting rows."""
    out: dict[int, list[CycleRecord]] = collections.defaultdict(list)
    for step, rows in sorted(_steps(records).items()):
        rows = [r for r in rows if r["gamma"] > 0]
        for g in sorted({r["gamma"] for r in rows}):
            mine = [r for r in rows if r["gamma"] == g]
            out[g].append(
                CycleRecord(
                    cycle=step,
                    gamma=g,
                    batch_size=mine[0]["batch_size"],
                    proposed=[g] * len(mine),
                    accepted=[r["accepted"] for r in mine],
                    committed=[len(r["committed"]) for r in mine],
                    draft_ms=mine[0]["draft_ms"],
                    verify_ms=mine[0]["verify_ms"],
                )  # fmt: skip
            )
    return dict(out)


def summarize_engine_log(records: list[dict]) -> dict:
    """Counters (as `Engine.spec_counters`), per-γ summaries and the cost table of a log."""
    gmax = max((r["gamma"] for r in records), default=0)
    reached = np.zeros(gmax, np.int64)
    acc = np.zeros(gmax, np.int64)
    cycles = proposed = accepted = 0
    for r in records:
        g, a = r["gamma"], r["accepted"]
        if g == 0:
            continue
        cycles, proposed, accepted = cycles + 1, proposed + g, accepted + a
        j = np.arange(g)
        reached[:g] += j <= a
        acc[:g] += j < a
    cost = collections.defaultdict(list)
    for rows in _steps(records).values():
        r0 = rows[0]
        seconds = (r0["draft_ms"] + r0["verify_ms"]) / 1e3
        tokens = sum(len(r["committed"]) for r in rows)
        cost[(r0["gamma_chosen"], r0["batch_size"])].append(
            (r0["draft_ms"], r0["verify_ms"], tokens / seconds)
        )
    return {
        "cycles": cycles,
        "proposed": proposed,
        "accepted": accepted,
        "reached_by_position": reached.tolist(),
        "accepted_by_position": acc.tolist(),
        "alpha_by_position": [float(a / n) if n else None for a, n in zip(acc, reached)],
        "by_gamma": {g: summarize_log(recs) for g, recs in cycle_records(records).items()},
        "cost": {
            f"gamma={g} batch={b}": {
                "steps": len(v),
                "draft_ms": float(np.median([x[0] for x in v])),
                "verify_ms": float(np.median([x[1] for x in v])),
                "tokens_per_s": float(np.median([x[2] for x in v])),
            }
            for (g, b), v in sorted(cost.items())
        },
    }


def main(argv):
    del argv
    s = summarize_engine_log(read_engine_log(_LOG.value))
    print(f"cycles {s['cycles']}  proposed {s['proposed']}  accepted {s['accepted']}")
    print("| position | reached | accepted | alpha |\n|---|---|---|---|")
    for j, (n, a, al) in enumerate(
        zip(s["reached_by_position"], s["accepted_by_position"], s["alpha_by_position"])
    ):
        print(f"| {j} | {n} | {a} | {'-' if al is None else f'{al:.3f}'} |")
    print("\n| cell | steps | draft ms | verify ms | tokens/s |\n|---|---|---|---|---|")
    for cell, c in s["cost"].items():
        print(
            f"| {cell} | {c['steps']} | {c['draft_ms']:.2f} | {c['verify_ms']:.2f} | "
            f"{c['tokens_per_s']:.1f} |"
        )
    print(json.dumps(s["by_gamma"], indent=1, default=str))


if __name__ == "__main__":
    flags.mark_flag_as_required("log")
    app.run(main)
