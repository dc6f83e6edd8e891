"""A serving simulator: the engine's own `Scheduler` and `BlockAllocator` on a virtual clock.

    model = TableStepTime.fit(measured)     # or LinearStepTime.fit, RooflineStepTime(preset(..))
    sim = Simulator(engine_config, model, token_buckets=engine.token_buckets)
    summary = sim.run([SimRequest(arrival_s, prompt, max_tokens), ...]).summary(SLO(0.5, 0.05))

Where the engine runs a jitted step, the simulator advances a clock by the time a step-time model
predicts for that step's shape; everything else is the engine's code: the same `Scheduler`
(continuous batching, chunked prefill, prefix caching, preemption), the same `BlockAllocator`,
the same `MetricsCollector` giving TTFT, TPOT and goodput. A request runs to its `max_tokens`
(the sampled ids are placeholders, not a model's, so no stop token ends it early: replay engine
runs with `ignore_eos` or a trace's output lengths). Prefix-cache hits on prompts are exact;
hits on generated tokens (recompute after preemption) see placeholders. So an engine whose
metrics clock advances by the same model's price of each step it runs gives exactly the
simulator's timestamps (tests/engine/test_sim.py); against wall-clock time the simulator is as
good as its step-time model (experiments/sim_check.py).

The engine pads each step (`step_shape`, the engine's own `step.padded_shape`): T to its token
buckets, which with `token_buckets="measured"` a cost table timed at the engine's construction
chose, so the simulator takes the engine's `Engine.token_buckets` (a "pow2" config fixes them
alone: `config_token_buckets`); B and M to powers of two. A step's cost follows the padded
shape, so the step-time models take it: `LinearStepTime` (t = c0 + c1 T + c2 B M, least
squares), `TableStepTime` (a base time per T bucket plus per-sequence and context terms: a CPU's
step time is not linear in T across buckets) and `RooflineStepTime` (max of FLOPs over peak and
bytes over bandwidth, per TP shard, for machines not here, e.g. an H200). A prefill pool and a
decode pool joined by a KV link: `sim_disagg.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from jaxinfer.cache.allocator import BlockAllocator
from jaxinfer.cache.metadata import bucket
from jaxinfer.config import ModelConfig
from jaxinfer.engine.buckets import check_buckets
from jaxinfer.engine.engine import EngineConfig
from jaxinfer.engine.metrics import SLO, MetricsCollector, MetricsSummary
from jaxinfer.engine.request import Request
from jaxinfer.engine.scheduler import Schedule, Scheduler
from jaxinfer.engine.step import padded_shape


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one engine step computes, as padded by the engine (`Engine._run`)."""

    num_tokens: int  # real tokens (sum of q_len)
    num_seqs: int  # real sequences
    context_tokens: int  # sum over sequences of the context read (start_pos + q_len)
    padded_tokens: int  # T bucket
    padded_seqs: int  # B bucket
    padded_blocks: int  # M bucket (blocks per sequence)


def step_shape(schedule: Schedule, config: EngineConfig, token_buckets: Sequence[int]) -> StepShape:
    """The padded (T, B, M) the engine runs `schedule` at (`step.padded_shape`, the engine's own
    padding), with the real counts beside them. `token_buckets`: the engine's
    `Engine.token_buckets`."""
    seqs = schedule.seqs
    t, b, m = padded_shape(schedule, config, token_buckets)
    return StepShape(
        num_tokens=schedule.num_batched_tokens,
        num_seqs=len(seqs),
        context_tokens=sum(s.start_pos + len(s.token_ids) for s in seqs),
        padded_tokens=t,
        padded_seqs=b,
        padded_blocks=m,
    )


def config_token_buckets(config: EngineConfig) -> tuple[int, ...]:
    """The token buckets an engine of `config` pads T to, where the config alone fixes them
    ("pow2": every power of two from min_token_bucket, as `Engine.__init__`; or explicit ones).

    Raises:
      ValueError: token_buckets="measured": the buckets come from a cost table timed on the
        engine's machine, so the simulator takes them from that engine (`Engine.token_buckets`).
    """
    if config.token_buckets == "pow2":
        return (bucket(config.min_token_bucket),)
    if not isinstance(config.token_buckets, str):  # explicit, validated by EngineConfig
        return config.token_buckets
    raise ValueError(
        f"EngineConfig.token_buckets={config.token_buckets!r}: the buckets are measured when an "
        "engine is built, so pass that engine's: Simulator(config, model, "
        "token_buckets=engine.token_buckets); or simulate token_buckets='pow2'"
    )


# --------------------------------------------------------------------------- step-time models


@dataclasses.dataclass(frozen=True)
class LinearStepTime:
    """t = c0 + c1 * T + c2 * B * M (seconds), T, B, M the padded step shape.

    c1 prices the token-proportional work (weights applied to T rows), c2 the attention's page
    reads (B rows over M blocks each). Fitted by least squares, coefficients clipped at 0.
    """

    c0: float
    c1: float
    c2: float

    @staticmethod
    def features(shape: StepShape) -> np.ndarray:
        return np.array([1.0, shape.padded_tokens, shape.padded_seqs * shape.padded_blocks])

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepShape, float]]) -> LinearStepTime:
        """Least squares on `(shape, measured seconds)` pairs (at least 3)."""
        if len(samples) < 3:
            raise ValueError(f"LinearStepTime.fit needs >= 3 measured steps, got {len(samples)}")
        x = np.stack([cls.features(s) for s, _ in samples])  # [N, 3]
        y = np.array([t for _, t in samples])  # [N]
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        coef = np.maximum(coef, 0.0)
        if coef[0] == 0.0:  # keep the intercept honest when the slopes were clipped
            coef[0] = max(float(np.mean(y - x[:, 1:] @ coef[1:])), 0.0)
        return cls(*map(float, coef))

    def __call__(self, shape: StepShape) -> float:
        return float(self.features(shape) @ np.array([self.c0, self.c1, self.c2]))


@dataclasses.dataclass(frozen=True)
class TableStepTime:
    """t = a[T] + c_seq * num_seqs + c_ctx * context_tokens (seconds); a[T] per padded T bucket.

    Why not `LinearStepTime` on a CPU: a step's time is not linear in its padded T across the
    engine's buckets. Small products run from cache and their dispatch hides the cost of their
    rows (the measured buckets exist because T = 1, 2 and 4 cost nearly alike: `buckets.py`),
    while from some T on a step's GEMMs leave the cache and grow with T, so one slope through all
    buckets overprices decode steps and underprices prefill steps or the reverse. Each bucket gets
    its own base time a[T] instead, measured at calibration (the engine compiles one program per
    bucket, so steps of a bucket share their device work), plus two terms that vary within a
    bucket: c_seq for per-sequence host work (metadata, sampling rows) and c_ctx for the context
    each step's attention reads. A bucket calibration never saw is interpolated linearly in T
    between its neighbours (above the largest: proportional to T).
    """

    base: tuple[tuple[int, float], ...]  # (padded T, seconds), increasing T
    c_seq: float
    c_ctx: float

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepShape, float]]) -> TableStepTime:
        """From `(shape, measured seconds)` pairs: c_seq and c_ctx by least squares beside one
        intercept per bucket (clipped at 0), each a[T] the mean residual of its steps (a run's
        time is the sum of its steps, and step times are right-skewed: a median base
        underpriced measured runs by 3-7% on the tiny target); steps off the fit (with median
        bases) by more than 20 median absolute errors (a compilation, a descheduled process) are
        dropped and the fit repeated, a few times at most. Leave compiling steps out first.

        Raises:
          ValueError: fewer than 3 samples, or a non-finite or negative time.
        """
        if len(samples) < 3:
            raise ValueError(f"TableStepTime.fit needs >= 3 measured steps, got {len(samples)}")
        y = np.array([t for _, t in samples], np.float64)  # [N]
        if not np.all(np.isfinite(y)) or np.any(y < 0):
            raise ValueError(f"TableStepTime.fit: step times must be finite and >= 0, got {y}")
        ts = sorted({s.padded_tokens for s, _ in samples})
        col = {t: i for i, t in enumerate(ts)}
        onehot = np.zeros((len(samples), len(ts)))  # [N, buckets]
        onehot[np.arange(len(samples)), [col[s.padded_tokens] for s, _ in samples]] = 1.0
        x = np.array([[s.num_seqs, s.context_tokens] for s, _ in samples], np.float64)  # [N, 2]
        keep = np.ones(len(samples), bool)  # steps not (yet) judged spikes

        def bases(resid, stat):  # [buckets]: stat of each bucket's kept residuals
            out = np.zeros(len(ts))
            for j in range(len(ts)):
                inb = onehot[:, j] == 1
                out[j] = stat(resid[inb & keep] if np.any(inb & keep) else resid[inb])
            return out

        for _ in range(4):  # fit, drop the steps far off it (spikes), refit
            a = np.concatenate([onehot, x], 1)[keep]
            coef, *_ = np.linalg.lstsq(a, y[keep], rcond=None)
            slopes = np.maximum(coef[len(ts) :], 0.0)
            resid = y - x @ slopes
            err = resid - onehot @ bases(resid, np.median)  # [N]; median bases: robust to spikes
            mad = np.median(np.abs(err[keep]))
            spikes = np.abs(err) > 20 * mad + 1e-9 * np.max(np.abs(y))
            if not np.any(spikes & keep) or np.sum(keep & ~spikes) < 3:
                break
            keep &= ~spikes
        base = tuple((t, max(float(b), 0.0)) for t, b in zip(ts, bases(resid, np.mean)))
        return cls(base, float(slopes[0]), float(slopes[1]))

    def base_time(self, padded_tokens: int) -> float:
        """a[T]; linear in T between calibrated buckets, proportional to T above the largest."""
        ts = [t for t, _ in self.base]
        a = [v for _, v in self.base]
        if padded_tokens > ts[-1]:
            return a[-1] * padded_tokens / ts[-1]
        return float(np.interp(padded_tokens, ts, a))

    def __call__(self, shape: StepShape) -> float:
        return (
            self.base_time(shape.padded_tokens)
            + self.c_seq * shape.num_seqs
            + self.c_ctx * shape.context_tokens
        )


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator's roofline."""

    name: str
    flops: float  # dense FLOP/s at the weight dtype
    bandwidth: float  # HBM bytes/s
    step_overhead_s: float = 0.0  # launch + host time per step


H200 = Hardware("H200", flops=989e12, bandwidth=4.8e12, step_overhead_s=0.5e-3)


@dataclasses.dataclass(frozen=True)
class RooflineStepTime:
    """max(FLOPs / peak, bytes / bandwidth) per step, on `tp` devices splitting the work evenly.

    FLOPs: 2 * parameters * real tokens + attention (4 * H * D * context per token, i.e. QK^T and
    PV). Bytes: every weight once per step (the decode regime) plus the K/V context read,
    2 * L * K * D * itemsize per context token. Collectives are not priced (an NVLink all-reduce
    of T * E activations is small beside the weights at these batch sizes; an assumption).
    """

    cfg: ModelConfig
    hw: Hardware = H200
    tp: int = 1
    weight_bytes: int | None = None  # None: cfg.num_params() * itemsize (dense weights)

    def __call__(self, shape: StepShape) -> float:
        cfg = self.cfg
        item = np.dtype(cfg.jnp_dtype).itemsize
        w = self.weight_bytes if self.weight_bytes is not None else cfg.num_params() * item
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item
        attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * shape.context_tokens
        flops = 2 * cfg.num_params() * shape.num_tokens + attn
        nbytes = w + kv_per_token * shape.context_tokens
        return max(flops / self.hw.flops, nbytes / self.hw.bandwidth) / self.tp + (
            self.hw.step_overhead_s
        )


# --------------------------------------------------------------------------- the simulator


@dataclasses.dataclass(frozen=True)
class SimRequest:
    """One request of a workload or trace."""

    arrival_s: float
    prompt_token_ids: Sequence[int]
    max_tokens: int  # output length: the simulated request runs to it
    request_id: Hashable | None = None
    n: int = 1


@dataclasses.dataclass(frozen=True)
class _SimSampling:  # what the scheduler reads of SamplingParams
    max_tokens: int
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class SimResult:
    """A simulated run: the engine's metrics, and each step's shape and predicted time."""

    metrics: MetricsCollector
    steps: list[tuple[StepShape, float]]
    num_preemptions: int
    first_scheduled: dict[Hashable, float] = dataclasses.field(default_factory=dict)  # step start

    def summary(self, slo: SLO | None = None) -> MetricsSummary:
        return self.metrics.summary(slo)


class _Pool:
    """One simulated engine: scheduler, allocator and metrics on a clock that a step-time
    model advances (`step`); the callers add requests and move the clock over idle spells."""

    def __init__(self, config: EngineConfig, step_time, token_buckets: tuple[int, ...]):
        self.config, self.step_time, self.token_buckets = config, step_time, token_buckets
        self.allocator = BlockAllocator(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler_config(), self.allocator)
        self.clock = 0.0
        self.metrics = MetricsCollector(lambda: self.clock)
        self.steps: list[tuple[StepShape, float]] = []
        self.first_scheduled: dict[Hashable, float] = {}  # request -> start of its first step
        self.carry: dict[Hashable, int] = {}  # tokens a request's first output also brings

    def add(self, rid, prompt, max_tokens: int, n: int, arrival: float, scheduled_at: float):
        """Queues a request; `arrival` is its metrics arrival, `scheduled_at` the scheduler's."""
        self.metrics.on_arrival(rid, len(prompt), arrival)
        sp = _SimSampling(int(max_tokens), int(n))
        self.scheduler.add_request(Request(rid, list(prompt), sp, scheduled_at))

    def step(self, max_steps: int, extra_s: float = 0.0) -> Schedule:
        """Schedules and, unless the schedule is empty, runs one priced step (`extra_s` more
        than its shape's price)."""
        schedule = self.scheduler.schedule()
        if schedule.is_empty:
            self.scheduler.update(schedule, {})
            return schedule
        shape = step_shape(schedule, self.config, self.token_buckets)
        dt = float(self.step_time(shape)) + extra_s
        for s in schedule.seqs:
            self.first_scheduled.setdefault(s.request_id, self.clock)
        self.clock += dt
        self.steps.append((shape, dt))
        if len(self.steps) > max_steps:
            raise RuntimeError(f"simulation passed max_steps={max_steps}")
        sampled = {sid: [0] for s in schedule.seqs for sid in s.sample_seq_ids}
        outs = self.scheduler.update(schedule, sampled)
        per_request: dict[Hashable, int] = {}
        for o in outs:
            per_request[o.request_id] = per_request.get(o.request_id, 0) + len(o.new_token_ids)
        metrics = self.metrics
        for rid, n in per_request.items():
            metrics.on_tokens(rid, n + self.carry.pop(rid, 0))
        for o in outs:
            if o.request_finished and metrics.requests[o.request_id].finish_time is None:
                metrics.on_finish(o.request_id)
        metrics.on_engine_step(schedule, self.scheduler, self.allocator)
        return schedule

    def result(self) -> SimResult:
        return SimResult(
            self.metrics, self.steps, self.scheduler.num_preemptions, self.first_scheduled
        )


def check_token_buckets(config: EngineConfig, token_buckets: Sequence[int] | None) -> tuple:
    """`token_buckets` validated (None: `config_token_buckets(config)`)."""
    if token_buckets is None:
        token_buckets = config_token_buckets(config)
    return check_buckets(token_buckets)


def request_ids(requests: Sequence[SimRequest]) -> list[tuple[Hashable, SimRequest]]:
    """(id, request) by arrival (ties: given order); a request without an id gets its index."""
    pending = sorted(enumerate(requests), key=lambda ir: (ir[1].arrival_s, ir[0]))
    return [(r.request_id if r.request_id is not None else i, r) for i, r in pending]


class Simulator:
    """Drives the engine's scheduler and allocator with a step-time model instead of a device.

    Args:
      config: the engine config simulated (pool, limits, buckets; backend and dtypes unused).
      step_time: StepShape -> seconds (`LinearStepTime`, `RooflineStepTime`, or any callable).
      token_buckets: the T buckets steps are padded to: the simulated engine's
        `Engine.token_buckets` (with token_buckets="measured" they come from a cost table timed
        on its machine); None: `config_token_buckets(config)` (a "pow2" config only).
      idle_wake_s: how late an idle driver wakes for the next arrival (a real-time driver that
        sleeps until it, as `workload.serve`, oversleeps); the clock jumps to arrival + this.
      idle_step_s: how much longer than its shape's price the first step after an idle sleep
        takes (on a CPU it starts on parked threads and cold caches: `sim_check.py` measures
        it).
    """

    def __init__(
        self,
        config: EngineConfig,
        step_time: Callable[[StepShape], float],
        token_buckets: Sequence[int] | None = None,
        idle_wake_s: float = 0.0,
        idle_step_s: float = 0.0,
    ):
        for name, v in (("idle_wake_s", idle_wake_s), ("idle_step_s", idle_step_s)):
            if not (isinstance(v, int | float) and 0 <= v < math.inf):
                raise ValueError(f"{name}={v!r}: expected finite seconds >= 0")
        self.config = config
        self.step_time = step_time
        self.token_buckets = check_token_buckets(config, token_buckets)
        self.idle_wake_s = float(idle_wake_s)
        self.idle_step_s = float(idle_step_s)

    def run(self, requests: Sequence[SimRequest], *, max_steps: int = 1_000_000) -> SimResult:
        """Replays `requests` (any order; by arrival) to completion on a virtual clock.

        Raises:
          ValueError: a request the engine would refuse at admission (the scheduler's checks).
          RuntimeError: no progress (nothing schedulable, no arrival left) or `max_steps` passed.
        """
        pool = _Pool(self.config, self.step_time, self.token_buckets)
        pending = request_ids(requests)
        head = 0
        woke = False  # the driver slept: its next step starts cold
        while head < len(pending) or pool.scheduler.has_unfinished():
            while head < len(pending) and pending[head][1].arrival_s <= pool.clock:
                rid, r = pending[head]
                t = r.arrival_s
                pool.add(rid, r.prompt_token_ids, r.max_tokens, r.n, t, t)
                head += 1
            schedule = pool.step(max_steps, self.idle_step_s if woke else 0.0)
            woke = woke and schedule.is_empty
            if schedule.is_empty:
                if head < len(pending) and not schedule.preempted_seq_ids:
                    wake = pending[head][1].arrival_s + self.idle_wake_s  # idle until then
                    pool.clock = max(pool.clock, wake)
                    woke = True
                    continue
                if not schedule.preempted_seq_ids:
                    raise RuntimeError("the scheduler cannot make progress on the waiting requests")
        return pool.result()


def poisson_workload(
    rate: float,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    *,
    vocab_size: int,
    seed: int = 0,
) -> list[SimRequest]:
    """Requests arriving as a Poisson process of `rate` per second, random prompts of the given
    lengths (zip of `prompt_lens`, `output_lens`); `rate = math.inf`: all at t = 0."""
    rng = np.random.default_rng(seed)
    n = len(prompt_lens)
    gaps = np.zeros(n) if math.isinf(rate) else rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - (0 if math.isinf(rate) else gaps[0])
    return [
        SimRequest(float(t), rng.integers(1, vocab_size, p).tolist(), int(o), request_id=i)
        for i, (t, p, o) in enumerate(zip(arrivals, prompt_lens, output_lens))
    ]
