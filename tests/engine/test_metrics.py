"""Tests of the serving metrics against hand-computed values, with an injected clock."""

from __future__ import annotations

import math

import pytest

from jaxinfer.engine.metrics import SLO, MetricsCollector, Percentiles

approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-12)  # float64 arithmetic on exact inputs


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _trace() -> MetricsCollector:
    """Four requests; D streams 2 tokens in one event and is aborted.

    A: arrives 0.0, tokens at 1.0, 1.5, 2.5, finishes 2.5  -> TTFT 1.0, TPOT 0.75, ITL .5, 1
    B: arrives 1.0, tokens at 3.0, 4.0, finishes 4.0       -> TTFT 2.0, TPOT 1.0,  ITL 1
    C: arrives 2.0, token at 2.4, finishes 2.4             -> TTFT 0.4, no TPOT
    D: arrives 3.0, 2 tokens at 3.5, aborted at 5.0        -> not completed
    """
    clock = FakeClock()
    m = MetricsCollector(clock=clock)
    m.on_arrival("A", 10)  # from the clock, t = 0
    m.on_arrival("B", 4, now=1.0)
    m.on_tokens("A", 1, now=1.0)
    m.on_step(
        1.0, num_running=2, kv_used_blocks=3, kv_total_blocks=10, kv_filled_slots=9, block_size=4
    )
    m.on_tokens("A", 1, now=1.5)
    m.on_arrival("C", 6, now=2.0)
    clock.t = 2.0
    m.on_step(
        num_running=3,
        kv_used_blocks=5,
        kv_total_blocks=10,
        kv_filled_slots=20,
        block_size=4,
        num_preempted=2,
        prefix_cache_hits=8,
        prefix_cache_queries=32,
    )
    m.on_tokens("C", 1, now=2.4)
    m.on_finish("C", now=2.4)
    m.on_tokens("A", 1, now=2.5)
    m.on_finish("A", now=2.5)
    m.on_arrival("D", 5, now=3.0)
    m.on_tokens("B", 1, now=3.0)
    m.on_step(
        3.0,
        num_running=1,
        kv_used_blocks=0,
        kv_total_blocks=10,
        kv_filled_slots=0,
        block_size=4,
        num_preempted=1,
        prefix_cache_hits=12,
        prefix_cache_queries=40,
    )
    m.on_tokens("D", 2, now=3.5)
    clock.t = 4.0
    m.on_tokens("B", 1)
    m.on_finish("B")
    m.on_finish("D", now=5.0, aborted=True)
    return m


def test_per_request_latencies():
    r = _trace().requests
    assert (r["A"].ttft, r["A"].tpot, r["A"].itls, r["A"].e2e) == (1.0, 0.75, [0.5, 1.0], 2.5)
    assert (r["B"].ttft, r["B"].tpot, r["B"].itls, r["B"].e2e) == (2.0, 1.0, [1.0], 3.0)
    assert r["C"].ttft == approx(0.4) and r["C"].tpot is None and r["C"].itls == []
    assert r["D"].num_output_tokens == 2 and not r["D"].completed and r["A"].completed


def test_run_summary():
    s = _trace().summary(SLO(ttft_s=1.0, tpot_s=0.8))
    assert (s.num_requests, s.num_completed, s.num_aborted) == (4, 3, 1)
    assert s.duration_s == 5.0  # first arrival 0.0 to last event 5.0
    assert (s.total_output_tokens, s.total_prompt_tokens) == (8, 20)  # D's tokens count as output
    assert s.output_throughput == approx(8 / 5) and s.total_throughput == approx(28 / 5)
    assert s.request_throughput == approx(3 / 5)
    assert s.goodput == approx(2 / 5)  # A (TTFT at the bound, inclusive) and C (no TPOT) meet it
    # Percentiles interpolate linearly between order statistics: rank q/100 * (n - 1).
    assert s.ttft == Percentiles(approx(3.4 / 3), approx(1.0), approx(1.8), approx(1.98), 3)
    assert s.tpot == Percentiles(approx(0.875), approx(0.875), approx(0.975), approx(0.9975), 2)
    assert s.itl == Percentiles(approx(2.5 / 3), approx(1.0), approx(1.0), approx(1.0), 3)
    assert s.e2e == Percentiles(approx(5.9 / 3), approx(2.5), approx(2.9), approx(2.99), 3)


def test_goodput_follows_the_slo():
    m = _trace()
    assert m.summary(SLO(ttft_s=0.9, tpot_s=0.8)).goodput == approx(1 / 5)  # A now misses TTFT
    assert m.summary(SLO(ttft_s=1.0, tpot_s=0.7)).goodput == approx(1 / 5)  # A misses TPOT
    assert m.summary(SLO(ttft_s=10, tpot_s=10)).goodput == approx(3 / 5)  # aborted D never counts
    assert m.summary().goodput is None


def test_step_metrics():
    s = _trace().summary()
    assert s.num_steps == 3 and s.peak_running == 3 and s.num_preemptions == 3
    assert s.kv_utilization_mean == approx((0.3 + 0.5 + 0.0) / 3) and s.kv_utilization_peak == 0.5
    assert s.kv_waste_mean == approx((3 / 12) / 3) and s.kv_wasted_slots_mean == approx(1.0)
    assert s.prefix_cache_hit_rate == approx(12 / 40)  # the latest cumulative counters
    assert s.to_dict()["ttft"]["p50"] == approx(1.0)


def test_empty_summary_is_nan_not_an_error():
    s = MetricsCollector(clock=FakeClock()).summary(SLO(1.0, 1.0))
    assert s.num_requests == 0 and s.ttft.count == 0 and math.isnan(s.ttft.p99)
    assert math.isnan(s.output_throughput) and s.prefix_cache_hit_rate is None


def test_event_validation():
    m = MetricsCollector(clock=FakeClock())
    with pytest.raises(ValueError, match="unknown request 'x'"):
        m.on_tokens("x", 1, now=0.0)
    m.on_arrival("a", 3, now=1.0)
    with pytest.raises(ValueError, match="already arrived"):
        m.on_arrival("a", 3, now=1.0)
    with pytest.raises(ValueError, match="must not go back"):
        m.on_tokens("a", 1, now=0.5)
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        m.on_tokens("a", 0, now=2.0)
    m.on_finish("a", now=2.0)
    with pytest.raises(ValueError, match="already finished"):
        m.on_finish("a", now=3.0)
    with pytest.raises(ValueError, match="kv_used_blocks"):
        m.on_step(
            1.0, num_running=1, kv_used_blocks=5, kv_total_blocks=4, kv_filled_slots=0, block_size=4
        )
    with pytest.raises(ValueError, match="kv_filled_slots"):
        m.on_step(
            1.0, num_running=1, kv_used_blocks=1, kv_total_blocks=4, kv_filled_slots=5, block_size=4
        )
    with pytest.raises(ValueError, match="SLO.tpot_s"):
        SLO(1.0, 0.0)
