"""Serving metrics: per-request latencies (TTFT, TPOT, ITL, end to end), run throughput, goodput
under an SLO, percentiles, KV-cache utilisation and waste, prefix-cache hit rate, preemptions.

The engine reports events to a `MetricsCollector` as they happen. Every event takes an optional
timestamp; without one the collector reads its clock, which is injectable, so tests (and replays
of recorded traces) are exact. Times are seconds in whatever clock the caller uses.

Definitions (per request, over completed requests only):

- TTFT: first token time - arrival time.
- TPOT: (last token time - first token time) / (output tokens - 1): mean time per output token
  after the first; undefined (None) for a single output token. With n > 1 parallel samples the
  tokens of all samples count, so it is the request's time per generated token.
- ITL: times between consecutive token events of a request (one event may carry several tokens).
- E2E: finish time - arrival time.
- goodput: completed requests that met the SLO (TTFT <= a and TPOT <= b; a request with one output
  token has no TPOT and is judged on TTFT) per second of run time.
- run time: from the first arrival to the last event recorded.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Hashable

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class SLO:
    """A latency service-level objective."""

    ttft_s: float  # a: a request's time to first token must be <= this
    tpot_s: float  # b: its mean time per output token after the first must be <= this

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"SLO.{name} must be a positive number of seconds, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Percentiles:
    """Mean and percentiles of a latency, in seconds; NaN when there is no sample."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> Percentiles:
        """Mean and linear-interpolation percentiles (numpy's default) of `values`."""
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan, 0)
        arr = np.asarray(values, np.float64)  # [N]
        p50, p90, p99 = (float(x) for x in np.percentile(arr, PERCENTILES))
        return cls(float(arr.mean()), p50, p90, p99, len(values))


@dataclasses.dataclass
class RequestRecord:
    """Timestamps of one request."""

    request_id: Hashable
    arrival_time: float
    num_prompt_tokens: int
    token_events: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (t, tokens)
    finish_time: float | None = None
    aborted: bool = False

    @property
    def completed(self) -> bool:
        return self.finish_time is not None and not self.aborted

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.token_events)

    @property
    def ttft(self) -> float | None:
        return self.token_events[0][0] - self.arrival_time if self.token_events else None

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        if n < 2:
            return None
        return (self.token_events[-1][0] - self.token_events[0][0]) / (n - 1)

    @property
    def itls(self) -> list[float]:
        times = [t for t, _ in self.token_events]
        return [b - a for a, b in zip(times[:-1], times[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    def meets(self, slo: SLO) -> bool:
        """Whether the request completed within the SLO (boundaries inclusive)."""
        if not self.completed or self.ttft is None or self.ttft > slo.ttft_s:
            return False
        return self.tpot is None or self.tpot <= slo.tpot_s


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Scheduler and KV-cache state sampled once per engine step."""

    time: float
    num_running: int  # sequences holding KV blocks
    num_waiting: int
    num_batched_tokens: int  # tokens computed in the step
    num_preempted: int  # preemptions in the step
    kv_used_blocks: int  # blocks with refcount > 0
    kv_total_blocks: int  # usable blocks of the pool
    kv_filled_slots: int  # slots of used blocks holding a token
    block_size: int  # S

    @property
    def kv_utilization(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks

    @property
    def kv_wasted_slots(self) -> int:
        return self.kv_used_blocks * self.block_size - self.kv_filled_slots

    @property
    def kv_waste(self) -> float:
        """Fraction of allocated slots that hold no token (0 when nothing is allocated)."""
        allocated = self.kv_used_blocks * self.block_size
        return self.kv_wasted_slots / allocated if allocated else 0.0


@dataclasses.dataclass(frozen=True)
class MetricsSummary:
    """Run-level figures; `to_dict()` gives a JSON-ready dict for results.json."""

    num_requests: int
    num_completed: int
    num_aborted: int
    duration_s: float
    total_prompt_tokens: int  # of completed requests
    total_output_tokens: int  # every streamed token, aborted requests included
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt tokens of completed requests + output tokens) / s
    request_throughput: float  # completed requests / s
    goodput: float | None  # completed requests within the SLO / s; None without an SLO
    slo: SLO | None
    ttft: Percentiles
    tpot: Percentiles
    itl: Percentiles
    e2e: Percentiles
    num_steps: int
    kv_utilization_mean: float  # mean over steps of used / usable blocks
    kv_utilization_peak: float
    kv_waste_mean: float  # mean over steps of the unused fraction of allocated slots
    kv_wasted_slots_mean: float
    prefix_cache_hit_rate: float | None  # hit tokens / looked-up tokens; None if never reported
    num_preemptions: int
    peak_running: int  # most sequences running at once

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class MetricsCollector:
    """Collects request and step events; `summary()` turns them into a `MetricsSummary`.

    Args:
      clock: returns the current time in seconds; used for events reported without a timestamp.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.requests: dict[Hashable, RequestRecord] = {}
        self.steps: list[StepRecord] = []
        self._prefix_cache: tuple[int, int] | None = None  # (hits, queries), cumulative
        self._last_time = -math.inf

    def _now(self, now: float | None) -> float:
        t = float(self._clock() if now is None else now)
        self._last_time = max(self._last_time, t)
        return t

    def _record(self, request_id: Hashable) -> RequestRecord:
        try:
            return self.requests[request_id]
        except KeyError:
            raise ValueError(f"unknown request {request_id!r}: call on_arrival first") from None

    def on_arrival(
        self, request_id: Hashable, num_prompt_tokens: int, now: float | None = None
    ) -> None:
        """A request arrived with a prompt of `num_prompt_tokens` tokens."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already arrived")
        if num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
        self.requests[request_id] = RequestRecord(request_id, self._now(now), num_prompt_tokens)

    def on_tokens(self, request_id: Hashable, num_tokens: int, now: float | None = None) -> None:
        """`num_tokens` output tokens of the request were streamed (the first call: first token)."""
        rec = self._record(request_id)
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        t = self._now(now)
        last = rec.token_events[-1][0] if rec.token_events else rec.arrival_time
        if t < last or rec.finish_time is not None:
            raise ValueError(
                f"request {request_id!r}: tokens at t={t} after its last event at t={last} "
                f"(finished: {rec.finish_time is not None}); timestamps must not go back"
            )
        rec.token_events.append((t, int(num_tokens)))

    def on_finish(
        self, request_id: Hashable, now: float | None = None, *, aborted: bool = False
    ) -> None:
        """The request finished (all its sequences), or was aborted."""
        rec = self._record(request_id)
        if rec.finish_time is not None:
            raise ValueError(f"request {request_id!r} already finished")
        t = self._now(now)
        last = rec.token_events[-1][0] if rec.token_events else rec.arrival_time
        if t < last:
            raise ValueError(
                f"request {request_id!r}: finish at t={t} before its last event {last}"
            )
        rec.finish_time, rec.aborted = t, aborted

    def on_engine_step(self, schedule, scheduler, allocator, now: float | None = None) -> None:
        """`on_step` from an engine step's schedule, its `Scheduler` and its `BlockAllocator`
        (the engine and the simulator sample the same state after every step)."""
        usage = allocator.usage()
        self.on_step(
            now,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_batched_tokens=schedule.num_batched_tokens,
            num_preempted=len(schedule.preempted_seq_ids),
            kv_used_blocks=usage.num_used_blocks,
            kv_total_blocks=usage.num_total_blocks,
            kv_filled_slots=usage.num_filled_slots,
            block_size=usage.block_size,
            prefix_cache_hits=allocator.prefix_cache_hits,
            prefix_cache_queries=allocator.prefix_cache_queries,
        )

    def on_step(
        self,
        now: float | None = None,
        *,
        num_running: int,
        kv_used_blocks: int,
        kv_total_blocks: int,
        kv_filled_slots: int,
        block_size: int,
        num_waiting: int = 0,
        num_batched_tokens: int = 0,
        num_preempted: int = 0,
        prefix_cache_hits: int | None = None,
        prefix_cache_queries: int | None = None,
    ) -> None:
        """Samples scheduler and KV state after a step.

        Args:
          now: the step's time; None reads the clock.
          num_running, num_waiting: queue lengths.
          kv_used_blocks, kv_total_blocks, kv_filled_slots, block_size: pool occupancy
            (`BlockAllocator.usage()`).
          num_batched_tokens: tokens computed in the step.
          num_preempted: preemptions in the step.
          prefix_cache_hits, prefix_cache_queries: the allocator's cumulative counters.
        """
        if kv_total_blocks < 1 or not 0 <= kv_used_blocks <= kv_total_blocks:
            raise ValueError(
                f"need 0 <= kv_used_blocks <= kv_total_blocks and kv_total_blocks >= 1, got "
                f"{kv_used_blocks} used of {kv_total_blocks}"
            )
        if not 0 <= kv_filled_slots <= kv_used_blocks * block_size:
            raise ValueError(
                f"kv_filled_slots must be in [0, {kv_used_blocks} * {block_size}], got "
                f"{kv_filled_slots}"
            )
        self.steps.append(
            StepRecord(
                time=self._now(now),
                num_running=num_running,
                num_waiting=num_waiting,
                num_batched_tokens=num_batched_tokens,
                num_preempted=num_preempted,
                kv_used_blocks=kv_used_blocks,
                kv_total_blocks=kv_total_blocks,
                kv_filled_slots=kv_filled_slots,
                block_size=block_size,
            )
        )
        if prefix_cache_hits is not None and prefix_cache_queries is not None:
            self._prefix_cache = (prefix_cache_hits, prefix_cache_queries)

    def summary(self, slo: SLO | None = None) -> MetricsSummary:
        """Run-level figures over everything recorded so far.

        Args:
          slo: the objective goodput is measured against; None leaves goodput None.
        """
        recs = list(self.requests.values())
        done = [r for r in recs if r.completed]
        start = min((r.arrival_time for r in recs), default=math.nan)
        duration = self._last_time - start if recs else math.nan

        def per_s(x: float) -> float:
            return x / duration if duration > 0 else math.nan

        out_tokens = sum(r.num_output_tokens for r in recs)
        prompt_tokens = sum(r.num_prompt_tokens for r in done)
        steps = self.steps
        hit_rate = None
        if self._prefix_cache is not None:
            hits, queries = self._prefix_cache
            hit_rate = hits / queries if queries else 0.0
        return MetricsSummary(
            num_requests=len(recs),
            num_completed=len(done),
            num_aborted=sum(r.aborted for r in recs),
            duration_s=duration,
            total_prompt_tokens=prompt_tokens,
            total_output_tokens=out_tokens,
            output_throughput=per_s(out_tokens),
            total_throughput=per_s(out_tokens + prompt_tokens),
            request_throughput=per_s(len(done)),
            goodput=None if slo is None else per_s(sum(r.meets(slo) for r in done)),
            slo=slo,
            ttft=Percentiles.of([r.ttft for r in done if r.ttft is not None]),
            tpot=Percentiles.of([r.tpot for r in done if r.tpot is not None]),
            itl=Percentiles.of([x for r in done for x in r.itls]),
            e2e=Percentiles.of([r.e2e for r in done]),
            num_steps=len(steps),
            kv_utilization_mean=_mean([s.kv_utilization for s in steps]),
            kv_utilization_peak=max((s.kv_utilization for s in steps), default=math.nan),
            kv_waste_mean=_mean([s.kv_waste for s in steps]),
            kv_wasted_slots_mean=_mean([float(s.kv_wasted_slots) for s in steps]),
            prefix_cache_hit_rate=hit_rate,
            num_preemptions=sum(s.num_preempted for s in steps),
            peak_running=max((s.num_running for s in steps), default=0),
        )


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan
