"""Cycle logs: the host-driven speculative loop, its per-cycle records, and the speedup model.

`generate_with_log` drives the SAME phase functions as the fused `loop.generate` from a Python
loop — a jitted draft phase and a jitted verify+accept phase, each timed to `block_until_ready` —
and records one `CycleRecord` per cycle (batch size, proposed / accepted / committed tokens per
sequence, draft ms, verify ms), written as JSONL.

The rest reads such logs into the speedup model of `speedup.py`: α per draft position
(`estimate_alpha`), the draft step time and the verify cost as a function of the positions
scored (`fit_costs`), predicted tokens per cycle and wall-clock speedup (`summarize_log`), and
the choice of γ from a short calibration run (`choose_gamma`, what `gamma="auto"` runs).
Host-side: numpy and wall clocks, no device code of its own.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.generate import validate_requests
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
from jaxinfer.speculative.speedup import (
    LinearCost,
    TableCost,
    best_gamma,
    estimate_alpha,
    expected_tokens_per_cycle,
    pooled_alpha,
    speedup,
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
    tp = loop_layout(tp)  # once, as the fused loop does: the phases then time the same layout
    dp = None if dp is None else loop_layout(dp)
    state = prefill_run(prep)
    warm, t, q = draft_phase(tp, dp, state, inputs, plan=plan)
    jax.block_until_ready(verify_phase(tp, t, q, warm, inputs, plan=plan))
    records = []
    limit = int(np.max(prep.inputs.max_tokens))
    while not bool(np.all(jax.device_get(state.done))) and len(records) < limit:
        t0 = time.perf_counter()
        state, tokens, q = jax.block_until_ready(draft_phase(tp, dp, state, inputs, plan=plan))
        t1 = time.perf_counter()
        state, stats = jax.block_until_ready(verify_phase(tp, tokens, q, state, inputs, plan=plan))
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
# Cycle logs and the speedup model (host-side numpy).
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


def _log_gamma(records: Sequence[CycleRecord]) -> int:
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


def complete_alpha(alpha: np.ndarray, length: int) -> np.ndarray:
    """Per-position α made usable for prediction at γ up to `length`.

    Unreached positions (NaN) become 0: a position no cycle reached follows one with α = 0, so
    the chain products are 0 there anyway. Positions past the measured ones take the pooled
    (mean of measured) α, a constant-α extrapolation.
    """
    a = np.nan_to_num(np.asarray(alpha, np.float64), nan=0.0)
    if len(a) >= length:
        return a[:length]
    return np.concatenate([a, np.full(length - len(a), float(np.mean(a)))])


def summarize_log(records: Sequence[CycleRecord], t_plain: float | None = None) -> dict:
    """The speedup model's view of one cycle log (one γ).

    Args:
      records: the cycles of one logged run.
      t_plain: seconds per plain decode step (same batch), to predict the speedup; optional.

    Returns:
      A JSON-ready dict: gamma, cycles, alpha (per position, `estimate_alpha`), pooled_alpha,
      tokens_per_cycle (measured mean of accepted + 1 over live sequences), predicted
      tokens_per_cycle (`expected_tokens_per_cycle` of α; equal in-sample, by construction of the
      estimator), draft_ms and verify_ms (medians per cycle), draft_step_ms, and with t_plain
      the predicted speedup γ·t_draft + t_verify model vs plain decoding.
    """
    gamma = _log_gamma(records)
    counts = accepted_counts(records)
    alpha = estimate_alpha(counts, gamma)
    draft_ms = float(np.median([r.draft_ms for r in records]))
    verify_ms = float(np.median([r.verify_ms for r in records]))
    out = {
        "gamma": gamma,
        "cycles": len(records),
        "alpha": [None if np.isnan(x) else float(x) for x in alpha],
        "pooled_alpha": pooled_alpha(counts, gamma),
        "tokens_per_cycle": float(np.mean(counts + 1)),
        "predicted_tokens_per_cycle": expected_tokens_per_cycle(
            complete_alpha(alpha, gamma), gamma
        ),
        "draft_ms": draft_ms,
        "verify_ms": verify_ms,
        "draft_step_ms": draft_ms / gamma,
    }
    if t_plain is not None:
        out["predicted_speedup"] = speedup(
            complete_alpha(alpha, gamma), gamma, t_plain, draft_ms / gamma / 1000,
            TableCost.from_measurements({gamma + 1: verify_ms / 1000}),
        )  # fmt: skip
    return out


def fit_costs(logs: Sequence[Sequence[CycleRecord]]) -> tuple[float, LinearCost | TableCost]:
    """Draft step seconds and the verify cost vs positions scored, from logs at several γ.

    Args:
      logs: cycle logs of one setting (drafter, batch) at one or more γ.

    Returns:
      (t_draft: median seconds per draft step over all cycles, verify cost in seconds as a
      function of γ+1: a `LinearCost` fitted to the per-γ medians when two or more γ were
      logged, else the one measured point as a `TableCost`).
    """
    per_gamma = {_log_gamma(r): r for r in logs}
    t_draft = float(np.median([c.draft_ms / c.gamma for r in logs for c in r])) / 1000
    verify = {
        g + 1: float(np.median([c.verify_ms for c in r])) / 1000 for g, r in per_gamma.items()
    }
    if len(verify) >= 2:
        return t_draft, LinearCost.fit(list(verify), list(verify.values()))
    return t_draft, TableCost.from_measurements(verify)


@dataclasses.dataclass(frozen=True)
class GammaChoice:
    """The outcome of `choose_gamma`."""

    gamma: int
    predicted_speedup: float
    speedups: dict[int, float]  # candidate γ -> predicted speedup
    alpha: list[float]  # per-position α used (measured, completed to the largest candidate)
    t_plain: float  # seconds per plain decode step (the verify line at one position)
    t_draft: float  # seconds per draft step
    verify_cost: LinearCost  # seconds vs positions scored per sequence


def choose_gamma(
    target: tuple[ModelConfig, dict],
    draft: tuple[ModelConfig, dict] | str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    acceptance: str = "rejection",
    candidates: Sequence[int] = tuple(range(1, 9)),
    calibration_gammas: tuple[int, int] = (1, 4),
    calibration_tokens: int = 16,
    block_size: int = 16,
    backend: str = "auto",
    ngram_max: int = 3,
) -> GammaChoice:
    """Picks γ by the speedup model from a short calibration run (what `gamma="auto"` does).

    The calibration runs `generate_with_log` on the same prompts and sampling, with max_tokens
    capped at `calibration_tokens`, once at each of `calibration_gammas`. From those logs:
    α per position from the largest calibration γ (`estimate_alpha`; positions past it take the
    pooled α), the draft step time, and a line t_verify(n) = a + b·n through the median verify
    times at n = γ+1; a plain decode step is priced as t_verify(1). `best_gamma` then picks among
    `candidates`. The calibration costs two short runs plus their compilations, so it pays off
    for long generations or when the choice is cached by the caller.

    Returns:
      A GammaChoice with the chosen γ, its predicted speedup and the measured model inputs.
    """
    if len(set(calibration_gammas)) < 2:
        raise ValueError(f"calibration_gammas needs two distinct γ, got {calibration_gammas!r}")
    cfg = target[0] if isinstance(target, tuple | list) and len(target) == 2 else None
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"target must be (ModelConfig, params), got {type(target)}")
    sampling = validate_requests(cfg, prompts, sampling)
    short = [
        dataclasses.replace(sp, max_tokens=min(sp.max_tokens, calibration_tokens))
        for sp in sampling
    ]
    logs = {}
    for g in sorted(calibration_gammas):
        _, logs[g] = generate_with_log(
            target, draft, prompts, short, gamma=g, acceptance=acceptance,
            block_size=block_size, backend=backend, ngram_max=ngram_max,
        )  # fmt: skip
    logs = {g: r for g, r in logs.items() if r}
    if len(logs) < 2:
        raise ValueError("the calibration run ended before any cycle: raise calibration_tokens")
    t_draft, verify = fit_costs(list(logs.values()))
    g_max = max(logs)
    alpha = complete_alpha(estimate_alpha(accepted_counts(logs[g_max]), g_max), max(candidates))
    measured = min(verify(g + 1) for g in logs)
    t_plain = max(verify(1), 0.1 * measured)  # guard against a noisy line's intercept
    verify = LinearCost(verify.a, verify.b)
    speedups = {int(g): speedup(alpha, g, t_plain, t_draft, verify) for g in candidates}
    best, s = best_gamma(alpha, t_plain, t_draft, verify, gammas=list(candidates))
    return GammaChoice(best, s, speedups, alpha.tolist(), t_plain, t_draft, verify)
