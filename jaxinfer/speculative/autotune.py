"""γ tuning: cycle logs read into the speedup model, γ chosen from a short calibration run.

`summarize_log` gives one log's α per draft position (`estimate_alpha`), predicted tokens per
cycle and wall-clock speedup; `fit_costs` the draft step time and the verify cost as a function
of the positions scored, from logs at several γ; `choose_gamma` runs `generate_with_log` at two
γ and picks the best by `speedup.best_gamma`. `generate` is the public entry of the package:
the fused `loop.generate`, with γ chosen this way first when `gamma="auto"`.
Host-side: numpy and wall clocks, no device code of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.requests import validate_requests
from jaxinfer.sampling import SamplingParams
from jaxinfer.speculative import loop
from jaxinfer.speculative.cycle_log import (
    CycleRecord,
    accepted_counts,
    generate_with_log,
    log_gamma,
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
    gamma = log_gamma(records)
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
    per_gamma = {log_gamma(r): r for r in logs}
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


def generate(
    target: tuple[ModelConfig, dict],
    draft: tuple[ModelConfig, dict] | str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    gamma: int | str = 4,
    acceptance: str = "rejection",
    block_size: int = 16,
    backend: str = "auto",
    ngram_max: int = 3,
) -> list[loop.SpeculativeOutput]:
    """Speculative generation (`loop.generate`), with γ chosen by `choose_gamma` when "auto".

    Args:
      target, draft, prompts, sampling, acceptance, block_size, backend, ngram_max: as in
        `loop.generate`.
      gamma: tokens drafted per cycle, or "auto": a short calibration run measures α and the
        draft and verify costs and picks γ by the speedup model (`choose_gamma`).

    Returns:
      One SpeculativeOutput per prompt, in order (see `loop.generate`).
    """
    kw = dict(acceptance=acceptance, block_size=block_size, backend=backend, ngram_max=ngram_max)
    if isinstance(gamma, str) and gamma == "auto":
        gamma = choose_gamma(target, draft, prompts, sampling, **kw).gamma
    return loop.generate(target, draft, prompts, sampling, gamma=gamma, **kw)
