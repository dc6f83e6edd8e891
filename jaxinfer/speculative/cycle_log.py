"""Cycle logs: the host-driven speculative loop and its per-cycle records.

`generate_with_log` drives the SAME phase functions as the fused `loop.generate` from a Python
loop — a jitted draft phase and a jitted verify+accept phase, each timed to `block_until_ready` —
and records one `CycleRecord` per cycle (batch size, proposed / accepted / committed tokens per
sequence, draft ms, verify ms), written as JSONL. `autotune.py` reads such logs into the speedup
model. Host-side: numpy and wall clocks, no device code of its own.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model.params import loop_layout
from jaxinfer.sampling import SamplingParams
from jaxinfer.speculative.loop import (
    SpeculativeOutput,
    collect_outputs,
    draft_phase,
    prefill_run,
    prepare_run,
    verify_phase,
)


@dataclasses.dataclass(frozen=True)
class CycleRecord:
    """One cycle of a logged run (per-sequence lists cover the real requests, in order)."""

    cycle: int
    gamma: int
    batch_size: int  # sequences still live at the start of the cycle
    proposed: list[int]  # drafted tokens per sequence (γ if live, else 0)
    accepted: list[int]  # drafts accepted per sequence, before stop / max_tokens truncation
    committed: list[int]  # tokens committed per sequence
    draft_ms: float  # the draft phase, compiled, to block_until_ready
    verify_ms: float  # verify + accept + commit


def generate_with_log(
    target: tuple[ModelConfig, dict],
    draft: tuple[ModelConfig, dict] | str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    gamma: int = 4,
    acceptance: str = "rejection",
    block_size: int = 16,
    backend: str = "auto",
    ngram_max: int = 3,
    log_path: str | None = None,
) -> tuple[list[SpeculativeOutput], list[CycleRecord]]:
    """`generate` driven from the host, one cycle per call, with a record of every cycle.

    The draft phase and the verify+accept phase are jitted separately (the same functions the
    fused loop composes) and each is timed to `block_until_ready`. Both phases are compiled by
    one discarded warm-up cycle before timing starts. Tokens equal those of `generate`.

    Args:
      target, draft, prompts, sampling, gamma (an int), acceptance, block_size, backend,
        ngram_max: as in `generate`.
      log_path: if given, the records are written there as JSONL (`write_cycle_log`).

    Returns:
      (outputs as `generate`, one CycleRecord per cycle).
    """
    prep = prepare_run(
        target, draft, prompts, sampling, gamma, acceptance, block_size, backend, ngram_max
    )
    plan, tp, dp, inputs = prep.plan, prep.tparams, prep.dparams, prep.inputs
    tp = loop_layout(tp, plan.platform)  # once, as the fused loop does: the same layout is timed
    dp = loop_layout(dp, plan.platform) if plan.dcfg is not None else dp  # a head: as given
    state = prefill_run(prep)
    warm, t, q = draft_phase(tp, dp, state, inputs, plan=plan)
    jax.block_until_ready(verify_phase(tp, dp, t, q, warm, inputs, plan=plan))
    records = []
    limit = int(np.max(prep.inputs.max_tokens))
    while not bool(np.all(jax.device_get(state.done))) and len(records) < limit:
        t0 = time.perf_counter()
        state, tokens, q = jax.block_until_ready(draft_phase(tp, dp, state, inputs, plan=plan))
        t1 = time.perf_counter()
        state, stats = jax.block_until_ready(
            verify_phase(tp, dp, tokens, q, state, inputs, plan=plan)
        )
        t2 = time.perf_counter()
        live, acc, com = (
            np.asarray(x)[: prep.n] for x in (stats.live, stats.accepted, stats.committed)
        )
        records.append(
            CycleRecord(
                cycle=len(records),
                gamma=plan.gamma,
                batch_size=int(live.sum()),
                proposed=(live * plan.gamma).astype(int).tolist(),
                accepted=acc.astype(int).tolist(),
                committed=com.astype(int).tolist(),
                draft_ms=1000 * (t1 - t0),
                verify_ms=1000 * (t2 - t1),
            )
        )
    if log_path is not None:
        write_cycle_log(log_path, records)
    return collect_outputs(prep, state), records


# ---------------------------------------------------------------------------------------------
# Reading and writing cycle logs (host-side numpy).
# ---------------------------------------------------------------------------------------------


def write_cycle_log(path: str, records: Sequence[CycleRecord]) -> None:
    """Writes records as JSONL, one cycle per line."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")


def read_cycle_log(path: str) -> list[CycleRecord]:
    """Reads a JSONL cycle log written by `write_cycle_log`."""
    with open(path) as f:
        return [CycleRecord(**json.loads(line)) for line in f if line.strip()]


def log_gamma(records: Sequence[CycleRecord]) -> int:
    if not records:
        raise ValueError("the cycle log is empty: no cycle ran")
    gammas = {r.gamma for r in records}
    if len(gammas) != 1:
        raise ValueError(f"a cycle log must hold one gamma, got {sorted(gammas)}")
    return gammas.pop()


def accepted_counts(records: Sequence[CycleRecord]) -> np.ndarray:
    """Accepted drafts of every (cycle, live sequence) of a log: `[n]` int64."""
    return np.array(
        [a for r in records for a, p in zip(r.accepted, r.proposed) if p > 0], dtype=np.int64
    )
