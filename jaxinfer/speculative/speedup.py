"""The speedup model of speculative decoding: tokens per cycle, cycle time, and the best γ.

One cycle drafts γ tokens, verifies γ+1 positions in one target forward, and commits
num_emitted = (leading accepted drafts) + 1 tokens. If position i is accepted with probability
α_i given that the cycle reached it (the chain model of Leviathan et al. 2023, which
`estimate_alpha` fits from cycle logs), then

    P(num_emitted > j) = Π_{i<j} α_i,   E[num_emitted] = 1 + Σ_{j<γ} Π_{i≤j} α_i,

which for a constant α is (1 − α^{γ+1}) / (1 − α). Against plain decoding at t_plain seconds per
token, a cycle costs γ·t_draft + t_verify(γ+1) + overhead, so the wall-clock speedup is

    speedup(γ) = E[num_emitted] · t_plain / (γ·t_draft + t_verify(γ+1) + overhead).

The verify cost is a function of the number of scored positions, not a constant: on a CPU a
5-token forward costs about twice a 1-token step, and on an accelerator it stays nearly flat only
while the forward is memory-bound. Give it as a measured table (`TableCost`) or a line fitted
to measurements (`LinearCost.fit`). Everything here is host-side numpy: it reads timings and
cycle logs, never device arrays inside a jitted step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

# Largest γ `best_gamma` tries for a constant α when no candidates are given.
DEFAULT_MAX_GAMMA = 16


@dataclasses.dataclass(frozen=True)
class LinearCost:
    """Forward time as a line in the number of positions scored per sequence: t(n) = a + b·n."""

    a: float  # seconds; the fixed cost of a forward (reading the weights, dispatch)
    b: float  # seconds per extra position scored

    def __call__(self, n: int) -> float:
        return self.a + self.b * n

    @classmethod
    def fit(cls, ns: Sequence[int], times: Sequence[float]) -> LinearCost:
        """Least-squares fit of t(n) = a + b·n to measured `(n, time)` pairs.

        Args:
          ns: positions scored per sequence in each measurement (at least two distinct values).
          times: the measured forward times in seconds, one per entry of `ns`.

        Returns:
          The fitted `LinearCost`.
        """
        n = np.asarray(ns, dtype=np.float64)
        t = np.asarray(times, dtype=np.float64)
        if n.ndim != 1 or n.shape != t.shape:
            raise ValueError(
                f"ns and times must be 1-D of equal length, got shapes {n.shape} and {t.shape}"
            )
        if np.unique(n).size < 2:
            raise ValueError(f"need at least two distinct n to fit a line, got ns={list(ns)}")
        design = np.stack([np.ones_like(n), n], axis=1)  # [M, 2]
        (a, b), *_ = np.linalg.lstsq(design, t, rcond=None)
        return cls(a=float(a), b=float(b))


@dataclasses.dataclass(frozen=True)
class TableCost:
    """Forward time measured at each number of positions scored per sequence."""

    times: tuple[tuple[int, float], ...]  # ((n, seconds), ...), n distinct

    @classmethod
    def from_measurements(cls, times: Mapping[int, float]) -> TableCost:
        """Builds the table from `{n: seconds}`."""
        if not times:
            raise ValueError("times must hold at least one measurement, got an empty mapping")
        return cls(times=tuple(sorted((int(n), float(t)) for n, t in times.items())))

    def __call__(self, n: int) -> float:
        for m, t in self.times:
            if m == n:
                return t
        measured = [m for m, _ in self.times]
        raise ValueError(f"no verify time measured for n={n} positions; measured n: {measured}")

    def gammas(self) -> list[int]:
        """The γ values this table can price (those with n = γ+1 measured, γ >= 1)."""
        return [n - 1 for n, _ in self.times if n >= 2]


VerifyCost = LinearCost | TableCost | Callable[[int], float]


def _check_gamma(gamma: int) -> None:
    if not isinstance(gamma, (int, np.integer)) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")


def _alpha_prefix(alpha: float | Sequence[float] | np.ndarray, gamma: int) -> np.ndarray:
    """The per-position α_0..α_{γ-1} `[γ]` float64, from a constant or a per-position array."""
    _check_gamma(gamma)
    a = np.asarray(alpha, dtype=np.float64)
    if a.ndim == 0:
        a = np.full((gamma,), float(a))
    elif a.ndim != 1 or a.shape[0] < gamma:
        raise ValueError(
            f"alpha must be a scalar or a per-position array of length >= gamma={gamma}, "
            f"got shape {a.shape}"
        )
    a = a[:gamma]
    if not np.all((a >= 0.0) & (a <= 1.0)):  # also rejects NaN (unobserved positions)
        raise ValueError(f"alpha must lie in [0, 1] at every position, got {a.tolist()}")
    return a


def emitted_distribution(alpha: float | Sequence[float] | np.ndarray, gamma: int) -> np.ndarray:
    """The law of num_emitted under the chain model.

    Args:
      alpha: a constant acceptance rate or per-position rates `[>= γ]`.
      gamma: drafted tokens per cycle.

    Returns:
      `[γ+1]` float64: entry k is P(num_emitted = k + 1).
    """
    a = _alpha_prefix(alpha, gamma)
    reach = np.concatenate([[1.0], np.cumprod(a)])  # [γ+1]; P(num_emitted > j)
    return reach - np.concatenate([reach[1:], [0.0]])


def expected_tokens_per_cycle(alpha: float | Sequence[float] | np.ndarray, gamma: int) -> float:
    """E[num_emitted]: (1 − α^{γ+1}) / (1 − α) for a constant α, 1 + Σ_j Π_{i≤j} α_i otherwise.

    Args:
      alpha: a constant acceptance rate in [0, 1], or per-position rates `[>= γ]` (the first γ
        are used), e.g. from `estimate_alpha` or `acceptance.expected_acceptance`.
      gamma: drafted tokens per cycle, >= 1.

    Returns:
      The expected number of tokens committed per cycle, in [1, γ+1].
    """
    a = _alpha_prefix(alpha, gamma)
    if np.ndim(alpha) == 0:
        alpha_c = float(a[0])
        if alpha_c == 1.0:
            return float(gamma + 1)
        return (1.0 - alpha_c ** (gamma + 1)) / (1.0 - alpha_c)
    return float(1.0 + np.sum(np.cumprod(a)))


def cycle_time(gamma: int, t_draft: float, verify_cost: VerifyCost, overhead: float = 0.0) -> float:
    """Seconds per cycle: γ draft steps, one verify forward over γ+1 positions, and overhead."""
    _check_gamma(gamma)
    return gamma * t_draft + float(verify_cost(gamma + 1)) + overhead


def speedup(
    alpha: float | Sequence[float] | np.ndarray,
    gamma: int,
    t_plain: float,
    t_draft: float,
    verify_cost: VerifyCost,
    overhead: float = 0.0,
) -> float:
    """Predicted wall-clock speedup of speculative over plain decoding.

    Args:
      alpha: constant or per-position acceptance rates (see `expected_tokens_per_cycle`).
      gamma: drafted tokens per cycle.
      t_plain: seconds per token of plain decoding (one 1-position target step).
      t_draft: seconds per draft step (0 for a model-free drafter such as n-gram lookup).
      verify_cost: target forward time as a function of the positions scored (γ+1 here).
      overhead: seconds of per-cycle work outside the forwards (acceptance, bookkeeping).

    Returns:
      E[num_emitted] · t_plain / cycle_time; below 1 means speculation slows decoding down.
    """
    if t_plain <= 0 or t_draft < 0 or overhead < 0:
        raise ValueError(
            "need t_plain > 0, t_draft >= 0 and overhead >= 0, got "
            f"t_plain={t_plain}, t_draft={t_draft}, overhead={overhead}"
        )
    t_cycle = cycle_time(gamma, t_draft, verify_cost, overhead)
    if t_cycle <= 0:
        raise ValueError(f"cycle time must be positive, got {t_cycle} s at gamma={gamma}")
    return expected_tokens_per_cycle(alpha, gamma) * t_plain / t_cycle


def best_gamma(
    alpha: float | Sequence[float] | np.ndarray,
    t_plain: float,
    t_draft: float,
    verify_cost: VerifyCost,
    overhead: float = 0.0,
    gammas: Sequence[int] | None = None,
) -> tuple[int, float]:
    """The γ with the largest predicted speedup, and that speedup.

    Args:
      alpha: constant or per-position acceptance rates.
      t_plain, t_draft, verify_cost, overhead: as in `speedup`.
      gammas: candidate γ values. By default 1..len(alpha) for per-position α (the model knows
        nothing past the measured positions), the table's γ values for a `TableCost`, and
        1..DEFAULT_MAX_GAMMA otherwise.

    Returns:
      `(gamma, speedup)`; ties go to the smallest γ (less wasted draft work). A speedup below 1
      means plain decoding is faster at every candidate γ.
    """
    if gammas is None:
        if np.ndim(alpha) == 1:
            limit = len(alpha)
            if isinstance(verify_cost, TableCost):
                gammas = [g for g in verify_cost.gammas() if g <= limit]
            else:
                gammas = list(range(1, limit + 1))
        elif isinstance(verify_cost, TableCost):
            gammas = verify_cost.gammas()
        else:
            gammas = list(range(1, DEFAULT_MAX_GAMMA + 1))
    if len(gammas) == 0:
        raise ValueError("no candidate gamma to evaluate: gammas is empty")
    best = (0, -np.inf)
    for g in sorted(gammas):
        s = speedup(alpha, g, t_plain, t_draft, verify_cost, overhead)
        if s > best[1]:
            best = (int(g), s)
    return best


def _check_counts(accepted_counts: Sequence[int] | np.ndarray, gamma: int) -> np.ndarray:
    _check_gamma(gamma)
    c = np.asarray(accepted_counts)
    if c.ndim != 1 or c.size == 0 or not np.issubdtype(c.dtype, np.integer):
        raise ValueError(
            "accepted_counts must be a non-empty 1-D integer array (accepted drafts per cycle), "
            f"got dtype {c.dtype} and shape {c.shape}"
        )
    if c.min() < 0 or c.max() > gamma:
        raise ValueError(
            f"accepted_counts must lie in [0, gamma={gamma}], got range [{c.min()}, {c.max()}]"
        )
    return c


def estimate_alpha(accepted_counts: Sequence[int] | np.ndarray, gamma: int) -> np.ndarray:
    """Per-position acceptance rates from cycle logs (the chain model's maximum likelihood).

    Position i was reached in every cycle with count >= i and accepted in those with count > i,
    so α_i = #(count > i) / #(count >= i).

    Args:
      accepted_counts: `[cycles]` integer, accepted drafts per cycle (num_emitted − 1), in
        [0, γ], all cycles run with the same γ.
      gamma: drafted tokens per cycle.

    Returns:
      `[γ]` float64; NaN at positions no cycle reached (no data), which `speedup` rejects.
    """
    c = _check_counts(accepted_counts, gamma)
    i = np.arange(gamma)[:, None]  # [γ, 1]
    reached = np.sum(c[None, :] >= i, axis=1)  # [γ]
    accepted = np.sum(c[None, :] > i, axis=1)  # [γ]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan)


def pooled_alpha(accepted_counts: Sequence[int] | np.ndarray, gamma: int) -> float:
    """One acceptance rate for all positions (maximum likelihood under a constant α).

    A cycle with count c < γ made c + 1 Bernoulli trials (c successes then a failure); one with
    c = γ made γ trials, all successes. So α = Σ count / Σ min(count + 1, γ).

    Args:
      accepted_counts: `[cycles]` integer, accepted drafts per cycle, in [0, γ].
      gamma: drafted tokens per cycle.

    Returns:
      The pooled α in [0, 1].
    """
    c = _check_counts(accepted_counts, gamma)
    return float(np.sum(c) / np.sum(np.minimum(c + 1, gamma)))
