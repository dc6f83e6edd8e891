"""The simulator against the real engine on a tiny model, on one virtual clock.

The simulator runs the engine's own scheduler and allocator and pads steps as the engine does,
so on the same workload every step's shape (the padded (T, B, M) the engine ran, read from its
batch), the step count, preemptions and each request's output length match exactly. For the
times, the engine runs with a metrics clock that advances by a step-time model's price of each
step it runs (and jumps to the next arrival when idle, as the simulator does): its TTFT, TPOT,
end-to-end and goodput must then equal the simulator's exactly, request by request. No test
here reads wall-clock time; the simulator against measured time is experiments/sim_check.py.
"""

import dataclasses
import math

import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.config import preset
from jaxinfer.engine import engine as engine_module
from jaxinfer.engine.sim import (
    LinearStepTime,
    RooflineStepTime,
    SimRequest,
    Simulator,
    StepShape,
    TableStepTime,
    config_token_buckets,
    poisson_workload,
    step_shape,
)
from tests.helpers import random_params

CONFIG = ji.EngineConfig(
    block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32, backend="xla",
    min_block_bucket=1,
)  # fmt: skip
# A pool too small for the workload at once: preemption (recompute) happens.
TIGHT = ji.EngineConfig(
    block_size=4, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16, backend="xla",
    min_block_bucket=1,
)  # fmt: skip
MODEL = LinearStepTime(c0=2e-3, c1=1e-4, c2=3e-5)  # an arbitrary price list, not a fit


def _workload(seed, rate=math.inf, outputs=(12, 5, 9, 16, 7, 10, 4, 13)):
    shared = [7, 3, 9, 12, 40, 41, 42, 43]  # two full blocks: prefix-cache hits
    reqs = poisson_workload(
        rate, [6, 30, 11, 19, 3, 25, 14, 8], list(outputs), vocab_size=128, seed=seed
    )  # fmt: skip
    return [
        SimRequest(r.arrival_s, shared + list(r.prompt_token_ids) if i % 2 else r.prompt_token_ids,
                   r.max_tokens, request_id=i)
        for i, r in enumerate(reqs)
    ]  # fmt: skip


def _engine_on_model_clock(cfg, params, config, workload, step_time):
    """The real engine serving `workload`, its metrics clock advanced by `step_time`'s price of
    each step it runs; requests are added once the clock passes their arrival, and an idle
    engine's clock jumps to the next arrival (the simulator's loop, with the engine's step).

    Returns (engine, [(simulated StepShape of the step, the (T, B, M) the engine ran)]).
    """
    clock = [0.0]
    engine = ji.Engine(cfg, params, config, clock=lambda: clock[0])
    shapes = []
    run = engine._run

    def priced(batch):
        shape = step_shape(engine.last_schedule, config, engine.token_buckets)
        shapes.append((shape, batch.shape))
        clock[0] += step_time(shape)
        return run(batch)

    engine._run = priced
    pending = sorted(workload, key=lambda r: r.arrival_s)  # stable: ties by index, as the sim
    i = 0
    while i < len(pending) or engine.has_unfinished():
        while i < len(pending) and pending[i].arrival_s <= clock[0]:
            r = pending[i]
            sp = ji.SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
            engine.add_request(r.prompt_token_ids, sp, r.request_id, arrival_time=r.arrival_s)
            i += 1
        engine.step()
        s = engine.last_schedule
        if s.is_empty and not s.preempted_seq_ids:
            assert i < len(pending), "the engine made no progress"
            clock[0] = max(clock[0], pending[i].arrival_s)
    return engine, shapes


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny-llama").replace(eos_token_id=None)
    return cfg, random_params(cfg, seed=1)


def _same_structure(sim, engine, shapes, workload):
    assert len(shapes) == engine.num_steps
    # The engine's own padded (T, B, M), step by step, equal the simulator's.
    assert [s for s, _ in sim.steps] == [s for s, _ in shapes]
    assert [(s.padded_tokens, s.padded_seqs, s.padded_blocks) for s, _ in sim.steps] == [
        ran for _, ran in shapes
    ]
    assert sim.num_preemptions == engine.num_preemptions
    got, want = sim.summary(), engine.metrics()
    assert got.num_steps == want.num_steps == engine.num_steps
    total = sum(r.max_tokens for r in workload)
    assert got.total_output_tokens == want.total_output_tokens == total
    assert got.prefix_cache_hit_rate == want.prefix_cache_hit_rate > 0


@pytest.mark.parametrize("buckets", [(1, 4, 16), "measured"])
def test_simulated_shapes_equal_the_engines_with_its_token_buckets(model, monkeypatch, buckets):
    """With measured token buckets (the engine's cost table, or a fixed table standing in for
    one that dropped T = 2 and 8), the simulator given `engine.token_buckets` pads every step
    as the engine did."""
    cfg, params = model
    if buckets != "measured":
        monkeypatch.setattr(
            engine_module, "measure_token_buckets", lambda cfg, params, lo, **kw: buckets
        )
    workload = _workload(2)
    engine, shapes = _engine_on_model_clock(cfg, params, CONFIG, workload, MODEL)
    if buckets != "measured":
        assert engine.token_buckets == buckets
        # A step of 5..8 tokens ran at T = 16: powers-of-two padding would have said 8.
        assert any(5 <= s.num_tokens <= 8 and ran[0] == 16 for s, ran in shapes)
    sim = Simulator(CONFIG, MODEL, token_buckets=engine.token_buckets).run(workload)
    _same_structure(sim, engine, shapes, workload)


@pytest.mark.parametrize(
    "config,rate,step_time,preempts",
    [
        (CONFIG, math.inf, MODEL, False),
        (CONFIG, 40.0, MODEL, False),  # arrivals over time: idle spells, the clock jumps
        (TIGHT, 80.0, TableStepTime(((1, 1e-3), (16, 4e-3)), c_seq=2e-4, c_ctx=1e-5), True),
    ],
    ids=["burst", "poisson", "preempting"],
)
def test_engine_on_the_models_clock_gives_the_simulators_metrics(
    model, config, rate, step_time, preempts
):
    cfg, params = model
    config = dataclasses.replace(config, token_buckets="pow2")
    workload = _workload(3, rate)
    engine, shapes = _engine_on_model_clock(cfg, params, config, workload, step_time)
    sim = Simulator(config, step_time).run(workload)
    _same_structure(sim, engine, shapes, workload)
    assert (engine.num_preemptions > 0) == preempts
    # Exact, request by request: every token event, arrival and finish at the same time.
    for rid, rec in engine.metrics_collector.requests.items():
        srec = sim.metrics.requests[rid]
        assert (srec.arrival_time, srec.finish_time) == (rec.arrival_time, rec.finish_time)
        assert srec.token_events == rec.token_events, rid
    got, want = sim.summary(), engine.metrics()
    for name in ("ttft", "tpot", "e2e"):
        assert getattr(got, name) == getattr(want, name), name
    # Goodput under an SLO between the fastest and slowest requests: some meet it, some not.
    ttfts = sorted(r.ttft for r in engine.metrics_collector.requests.values())
    slo = ji.engine.SLO(ttft_s=ttfts[len(ttfts) // 2], tpot_s=1.0)
    g_sim, g_eng = sim.summary(slo).goodput, engine.metrics(slo).goodput
    assert 0 < g_sim == g_eng < want.request_throughput
    if math.isfinite(rate):
        assert sim.metrics.requests[7].arrival_time > 0  # the clock did follow the arrivals


def test_token_buckets_come_from_the_engine_when_measured():
    with pytest.raises(ValueError, match="token_buckets='measured'.*engine.token_buckets"):
        Simulator(ji.EngineConfig(), MODEL)
    assert config_token_buckets(ji.EngineConfig(token_buckets="pow2", min_token_bucket=3)) == (4,)
    assert config_token_buckets(ji.EngineConfig(token_buckets=(2, 8))) == (2, 8)  # explicit
    for bad in [(), (4, 2), (3,), (1, 1), (0,)]:
        with pytest.raises(ValueError, match="token_buckets="):
            Simulator(CONFIG, MODEL, token_buckets=bad)


def _shape(t, seqs=1, ctx=10, b=4, m=8):
    return StepShape(min(t, 8), seqs, ctx, t, b, m)


def test_fits_recover_the_models_that_made_the_times():
    linear = LinearStepTime(1e-3, 2e-5, 4e-6)
    shapes = [_shape(t, b=b, m=m) for t in (1, 2, 4, 16, 64) for b, m in ((1, 8), (4, 16))]
    got = LinearStepTime.fit([(s, linear(s)) for s in shapes])
    assert dataclasses.astuple(got) == pytest.approx(dataclasses.astuple(linear), rel=1e-9)
    table = TableStepTime(((1, 1e-3), (4, 1.1e-3), (16, 3e-3)), c_seq=1e-4, c_ctx=2e-6)
    shapes = [_shape(t, seqs=n, ctx=c) for t in (1, 4, 16) for n in (1, 3) for c in (5, 90, 400)]
    fitted = TableStepTime.fit([(s, table(s)) for s in shapes])
    assert [t for t, _ in fitted.base] == [1, 4, 16]
    for (_, a), (_, b) in zip(fitted.base, table.base):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    assert math.isclose(fitted.c_seq, 1e-4, rel_tol=1e-6)
    assert math.isclose(fitted.c_ctx, 2e-6, rel_tol=1e-6)
    # Buckets calibration never saw: linear between neighbours, proportional above the top.
    assert math.isclose(table.base_time(8), 1.1e-3 + (3e-3 - 1.1e-3) * 4 / 12)
    assert math.isclose(table.base_time(64), 4 * 3e-3)
    # A spike in one step (20 median absolute errors off) is dropped: the bases stay exact.
    noisy = [(s, table(s) * (10 if i == 0 else 1)) for i, s in enumerate(shapes)]
    assert math.isclose(TableStepTime.fit(noisy).base[0][1], 1e-3, rel_tol=1e-6)
    # Skewed noise: each base is the mean of its steps (a run is their sum), not the median.
    rng = np.random.default_rng(0)
    skew = [(s, table(s) * (1 + 0.3 * rng.exponential())) for s in shapes for _ in range(40)]
    got = TableStepTime.fit(skew)
    ratio = sum(got(s) for s, _ in skew) / sum(t for _, t in skew)
    assert math.isclose(ratio, 1.0, rel_tol=1e-3), ratio
    with pytest.raises(ValueError, match=">= 3 measured steps"):
        TableStepTime.fit(noisy[:2])
    with pytest.raises(ValueError, match="finite and >= 0"):
        TableStepTime.fit([(s, -1.0) for s in shapes])


def test_arrivals_idle_time_and_roofline():
    cfg = preset("llama2-7b")
    roof = RooflineStepTime(cfg)
    reqs = [SimRequest(0.0, list(range(1, 513)), 16), SimRequest(5.0, list(range(1, 129)), 8)]
    config = ji.EngineConfig(
        block_size=16, num_blocks=256, max_num_batched_tokens=2048, token_buckets="pow2"
    )
    sim = Simulator(config, roof).run(reqs)
    recs = sim.metrics.requests
    # The second request arrives long after the first finished: no queueing, the clock jumped.
    assert recs[0].finish_time < 5.0 <= recs[1].token_events[0][0]
    # A 7B decode step in bf16 reads ~13.5 GB of weights: ~2.8 ms at 4.8 TB/s, plus overhead.
    decode = [dt for s, dt in sim.steps if s.num_tokens == 1]
    assert all(2.5e-3 < dt < 4.5e-3 for dt in decode), decode
    # Two-way TP halves the roofline part of the step.
    tp2 = Simulator(config, RooflineStepTime(cfg, tp=2)).run(reqs)
    assert tp2.summary().tpot.p50 < sim.summary().tpot.p50


def test_an_idle_driver_wakes_late_by_idle_wake_s():
    reqs = [SimRequest(0.0, [1, 2, 3], 4), SimRequest(5.0, [4, 5, 6], 4)]
    config = dataclasses.replace(CONFIG, token_buckets="pow2")
    base = Simulator(config, MODEL).run(reqs).metrics.requests
    late = Simulator(config, MODEL, idle_wake_s=0.01).run(reqs).metrics.requests
    # The first arrives as the driver starts (no sleep); the second finds it asleep and starts
    # 10 ms later. Nothing else changes.
    assert late[0].token_events == base[0].token_events
    assert late[1].ttft == pytest.approx(base[1].ttft + 0.01)
    assert late[1].tpot == pytest.approx(base[1].tpot)
    with pytest.raises(ValueError, match="idle_wake_s=-1"):
        Simulator(config, MODEL, idle_wake_s=-1)
    # idle_step_s: the first step after the sleep (the second request's first) costs that more;
    # the first request's steps (no sleep before them) and every later step do not.
    cold = Simulator(config, MODEL, idle_step_s=0.003).run(reqs).metrics.requests
    assert cold[0].token_events == base[0].token_events
    assert cold[1].ttft == pytest.approx(base[1].ttft + 0.003)
    assert cold[1].tpot == pytest.approx(base[1].tpot)
    with pytest.raises(ValueError, match="idle_step_s=inf"):
        Simulator(config, MODEL, idle_step_s=math.inf)
