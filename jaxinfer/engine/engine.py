"""The serving engine: the host scheduler's `Schedule` applied by one jitted step per iteration.

    engine = ji.Engine(cfg, params, ji.EngineConfig(block_size=16, num_blocks=1024))
    outs = engine.generate(prompts, ji.SamplingParams(temperature=0, max_tokens=64))

or, streaming, with requests arriving over time:

    engine.add_request(prompt, sampling, request_id="a")
    while engine.has_unfinished():
        for out in engine.step():          # StreamOutput(request_id, sample_index, new tokens, ...)
            ...

Each `step()` asks the `Scheduler` (host only) for a `Schedule`, applies its copy-on-write block
copies with one jitted call, turns its sequences into a ragged `BatchMetadata` and runs one jitted
step: the model forward over the paged cache, then sampling on the device. Only the sampled token
ids (`[B]` int32, -1 where a row of logits is not finite) come back to the host. The cache is
donated to both calls, so it is updated in place. B (sequences = logits rows = sample rows) and M
(blocks per sequence) are padded to powers of two, T (tokens) to the buckets a cost table measured
at construction keeps (`buckets.py`), so a run compiles at most once per distinct (T, B, M);
tests count compilations with `_step._cache_size()`. On a CPU the step runs on the params'
`inference_layout` (`EngineConfig.layout`).

Sampling is `jaxinfer.sampling.sample` with each row's `sample_index`: sample 0 of a request draws
the noise of `ji.generate`, `fold_in(key(seed), position)`, so an n = 1 request gives exactly
`ji.generate`'s output; the forks 1..n-1 of an n > 1 request use
`fold_in(fold_in(key(seed), sample_index), position)` so the samples differ.

With `EngineConfig.speculative` a step drafts, verifies every request's γ + 1 positions in the one
ragged forward and commits 1..γ+1 tokens per request (`speculation.py`, `cycles.py`).

A step is a transaction (see `Engine.step`): if it fails after `schedule()`, the scheduler and
allocator roll back, the step's requests end with finish reason "error" and the exception's
message in `StreamOutput.error` / `RequestOutput.error`, K/V the step may have overwritten are
recomputed, and every other request continues exactly as without the failure.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from jaxinfer.cache.allocator import BlockAllocator
from jaxinfer.cache.metadata import bucket
from jaxinfer.checks import as_float
from jaxinfer.config import ModelConfig
from jaxinfer.distributed.engine_mesh import place_engine
from jaxinfer.engine import compiled, recovery, speculation
from jaxinfer.engine.buckets import measure_token_buckets
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.cycles import account, init_speculation
from jaxinfer.engine.metrics import SLO, MetricsCollector, MetricsSummary
from jaxinfer.engine.outputs import RequestOutput, StreamOutput
from jaxinfer.engine.request import Request
from jaxinfer.engine.scheduler import Schedule, Scheduler
from jaxinfer.engine.step import (  # noqa: F401  (_step, _copy, _copy_groups: re-exported)
    _Batch,
    _copy,
    _copy_groups,
    _host_logprobs,
    _step,
    _step_logprobs,
    apply_copies,
    build_batch,
)
from jaxinfer.model.params import check_params, remembered_loop_layout
from jaxinfer.ops.backend import resolve_platform
from jaxinfer.requests import (
    GenerationOutput,
    per_prompt_sampling,
    stop_ids,
    token_list,
    validate_requests,
)
from jaxinfer.sampling import SamplingParams


@dataclasses.dataclass
class _Live:
    """Host bookkeeping of a live request."""

    sampling: SamplingParams  # as submitted
    seq_ids: tuple[int, ...]  # [n]
    tokens: list[list[int]]  # [n] streamed so far
    reasons: list[str | None]  # [n]


# ------------------------------------------------------------------------------------ engine


class Engine:
    """Continuous-batching serving engine over a paged KV cache.

    Args:
      cfg: the model config.
      params: the params pytree (dense or quantized; passed to `forward` as is).
      config: pool, scheduling and device settings.
      clock: the metrics clock (seconds); arrival and token times are read from it.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        detokenize: Callable[[list[int]], str] | None = None,
    ):
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        check_params(cfg, params)
        self.cfg, self.params, self.config = cfg, params, config
        self.clock = clock
        S, nb = config.block_size, config.num_blocks
        self.platform = resolve_platform()  # once: every cache of this engine is for it
        self.mesh = place_engine(self)  # the cache; with EngineConfig.mesh, all on the TP mesh
        # On a CPU the step runs on `cpu_layout` (config.layout): a scan over stacked weights
        # copies them every step (experiments/engine_step_profile.py), and transposed weights
        # cost less at a few rows (jaxinfer.transposed). Not measured on a TP mesh: the params
        # stay as placed there.
        if config.layout == "auto" and self.mesh is None:
            self.params = remembered_loop_layout(self.params, self.platform)  # as ji.generate
        # T buckets up to 16 by a measured cost table (config.token_buckets, buckets.py), timed
        # on the head the step runs on.
        lo = config.min_token_bucket
        if config.token_buckets == "measured":
            self.token_buckets = measure_token_buckets(cfg, self.params, lo)
        elif config.token_buckets == "pow2":
            self.token_buckets = (bucket(lo),)
        else:  # explicit, validated by EngineConfig
            self.token_buckets = config.token_buckets
        self.allocator = BlockAllocator(nb, S, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.allocator)
        self.metrics_collector = MetricsCollector(clock)
        # A scratch scheduler: admission checks of whole batches before anything is queued.
        self._probe = Scheduler(config.scheduler_config(), BlockAllocator(nb, S, False))
        self._live: dict[Hashable, _Live] = {}
        self._sample_index: dict[int, int] = {}  # live seq id -> its sample index
        self._rid_of: dict[int, Hashable] = {}  # live seq id -> its request
        self._touched_device = False  # the current step made a device call
        self._keep: set[Hashable] = set()  # requests whose final output generate() collects
        self._done: dict[Hashable, RequestOutput] = {}
        self._ids = itertools.count()
        self.step_shapes: collections.Counter = collections.Counter()  # (T, B, M) -> steps
        self.num_steps = 0  # steps that ran on the device
        self.num_failed_steps = 0  # steps undone after an exception (their requests failed)
        self.last_schedule: Schedule | None = None
        self._step_logprobs: dict[int, tuple] = {}  # seq id -> its logprobs of the last step
        init_speculation(self, detokenize)

    def _lookahead(self, seq) -> int:
        return self._gamma

    # ------------------------------------------------------------------------ requests

    def _check(
        self, prompt, sp: SamplingParams, request_id: Hashable, index: int, num_generated: int = 0
    ) -> None:
        """Raises ValueError if the request is malformed or could never be scheduled."""
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling[{index}] is {type(sp).__name__}, expected SamplingParams")
        if request_id in self.metrics_collector.requests:
            raise ValueError(f"request id {request_id!r} was used already")
        if self.config.speculative is not None and sp.logprobs is not None:
            raise ValueError(
                f"request {index} ({request_id!r}): logprobs={sp.logprobs} is not supported with "
                "EngineConfig.speculative; expected logprobs=None"
            )
        probe_id = ("probe", index)
        try:
            # Model limits (vocabulary, positions) as ji.generate checks them; n is ours.
            validate_requests(self.cfg, [prompt], [dataclasses.replace(sp, n=1)])
            # Pool, rows and budget, by the scheduler's own admission checks.
            self._probe.add_request(
                Request(probe_id, token_list(prompt), sp, num_generated=num_generated)
            )
        except ValueError as e:
            raise ValueError(f"request {index} ({request_id!r}): {e}") from None
        finally:
            self._probe.abort(probe_id)

    def add_request(
        self,
        prompt: Sequence[int],
        sampling: SamplingParams | None = None,
        request_id: Hashable | None = None,
        arrival_time: float | None = None,
        *,
        num_generated: int = 0,
    ) -> Hashable:
        """Queues a request; it is scheduled by the coming `step()` calls.

        Args:
          prompt: token ids.
          sampling: its SamplingParams (n > 1: n samples sharing the prompt's blocks).
          request_id: a hashable id never used before in this engine; None: a fresh one
            ("req-<k>"), never one used before, chosen or automatic.
          arrival_time: its arrival in the metrics clock; None: now.
          num_generated: how many of the prompt's last tokens this request generated before (a
            disaggregated decode side continues a request): penalties count them as output.

        Returns:
          The request id.

        Raises:
          ValueError: a malformed request, a reused id, or one that could never be scheduled
            (more KV blocks than the pool, n > max_num_seqs, a prefill beyond the token budget
            without chunked prefill); nothing is queued then.
        """
        sp = SamplingParams() if sampling is None else sampling
        rid = self._auto_id(lambda k: f"req-{k}") if request_id is None else request_id
        try:
            hash(rid)
        except TypeError:
            raise ValueError(
                f"request_id={rid!r} is invalid: expected a hashable id (str, int, tuple, ...)"
            ) from None
        if arrival_time is not None:
            t = as_float(arrival_time)
            if t is None or not math.isfinite(t):
                raise ValueError(
                    f"arrival_time={arrival_time!r} is invalid: expected None or a finite number "
                    "(seconds in the metrics clock)"
                )
            arrival_time = t
        self._check(prompt, sp, rid, 0, num_generated)
        self._enqueue(prompt, sp, rid, arrival_time, num_generated)
        return rid

    def _auto_id(self, make: Callable[[int], Hashable]) -> Hashable:
        """The next automatic id `make(k)` that no request of this engine has used."""
        while True:
            rid = make(next(self._ids))
            if rid not in self.metrics_collector.requests:
                return rid

    def _enqueue(
        self, prompt, sp: SamplingParams, rid: Hashable, arrival_time, num_generated: int = 0
    ) -> None:
        prompt = token_list(prompt)
        sched_sp = dataclasses.replace(sp, stop_token_ids=stop_ids(self.cfg, sp))
        self.metrics_collector.on_arrival(rid, len(prompt), arrival_time)
        arrival = self.metrics_collector.requests[rid].arrival_time
        seq_ids = self.scheduler.add_request(Request(rid, prompt, sched_sp, arrival, num_generated))
        for j, sid in enumerate(seq_ids):
            self._sample_index[sid] = j
            self._rid_of[sid] = rid
        self._live[rid] = _Live(sp, seq_ids, [[] for _ in seq_ids], [None] * len(seq_ids))

    def abort(self, request_id: Hashable) -> bool:
        """Stops a request in any state and frees its blocks; False if it is not live (an
        unhashable id never is)."""
        try:
            hash(request_id)
        except TypeError:
            return False
        if not self.scheduler.abort(request_id):
            return False
        self.metrics_collector.on_finish(request_id, aborted=True)
        live = self._live.pop(request_id)
        for sid in live.seq_ids:
            self._sample_index.pop(sid, None)
            self._rid_of.pop(sid, None)
        self._keep.discard(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------------------- step

    def step(self) -> list[StreamOutput]:
        """Runs one scheduling step on the device.

        The step is a transaction. If anything fails after `schedule()` (building the batch on
        the host, a device call, `update`), the scheduler and allocator return to their state
        before the step, every request of the step fails (its samples end with finish reason
        "error" and the exception's message; its blocks are freed), and the other requests go
        on as if the step had never been scheduled. The failed requests are not retried: the
        engine cannot tell a transient fault from one a request causes, and retrying the latter
        would fail again. K/V the failed step may have overwritten are recomputed (preemption by
        recompute), so the other requests' tokens are exactly those of a run without the
        failure. A request whose logits row is not finite (NaN / Inf) fails alone, its error
        naming the non-finite logits.

        Returns:
          One StreamOutput per sample that received tokens, or failed, this step, in schedule
          order (failed requests last).
        """
        compiled.GUARD.check()  # programs dropped if a compilation could cross the map limit
        t_start = time.perf_counter()  # the controller's step time: the whole step, host included
        self._observe = None
        if self.spec is None:
            schedule = self.scheduler.schedule()
        else:
            # The controller's batch: requests that will decode (and may draft) this step.
            self._decoding = sum(not s.in_prefill for s in self.scheduler.running)
            self._gamma, self._predicted = self.controller.choose(self._decoding)
            schedule = self.scheduler.schedule(self._lookahead)
        self.last_schedule = schedule
        if schedule.is_empty:
            self.scheduler.update(schedule, {})
            return []
        self._touched_device = False
        record = None
        try:
            if self.spec is None:
                batch = self._build(schedule)
                self._touched_device = True  # from here on the cache is donated
                self._apply_copies(schedule.block_copies)
                # seq id -> ([token] or [-1], position)
                sampled = {sid: ([t], p) for sid, (t, p) in self._run(batch).items()}
            else:
                self._touched_device = True
                self._apply_copies(schedule.block_copies)
                sampled, record = speculation.run(self, schedule)  # 1..γ+1 tokens per row
            # Rows with non-finite logits get a placeholder token for update(); their requests
            # fail right after it.
            bad = {sid: pos for sid, (toks, pos) in sampled.items() if toks[0] < 0}
            outs = self.scheduler.update(
                schedule, {sid: [max(t, 0) for t in toks] for sid, (toks, _) in sampled.items()}
            )
        except Exception as e:
            return self._recover(schedule, e)
        except BaseException:  # KeyboardInterrupt and the like: undo, fail nobody, re-raise
            recovery.undo(self, schedule)
            recovery.forget_written(self, schedule)
            raise
        now = self.clock()
        self.num_steps += 1
        if record is not None:
            account(self, schedule, record, outs)
        failed: dict[Hashable, str] = {}  # request -> error, for non-finite logits
        for sid, pos in bad.items():
            rid = self._rid_of[sid]
            failed.setdefault(
                rid, f"non-finite logits (NaN or Inf) sampling position {pos} of request {rid!r}"
            )

        stream: list[StreamOutput] = []
        per_request: dict[Hashable, int] = {}  # request -> tokens this step
        for o in outs:
            if o.request_id in failed:
                continue
            live = self._live[o.request_id]
            j = self._sample_index[o.seq_id]
            live.tokens[j].extend(o.new_token_ids)
            reason = o.finish_reason.value if o.finished else None
            live.reasons[j] = reason
            per_request[o.request_id] = per_request.get(o.request_id, 0) + len(o.new_token_ids)
            stream.append(
                StreamOutput(
                    o.request_id,
                    j,
                    list(o.new_token_ids),
                    o.finished,
                    reason,
                    o.request_finished,
                    logprobs=self._step_logprobs.get(o.seq_id) if o.new_token_ids else None,
                )
            )
        for rid, n in per_request.items():
            self.metrics_collector.on_tokens(rid, n, now)
        for o in outs:
            if o.request_finished and o.request_id in self._live and o.request_id not in failed:
                self._finish(o.request_id, now)
        for rid, error in failed.items():
            stream += self._fail(rid, error, now)
        self.metrics_collector.on_engine_step(schedule, self.scheduler, self.allocator, now)
        if self._observe is not None:  # a decode-only speculative step (cycles.account)
            self.controller.observe(*self._observe, time.perf_counter() - t_start)
        return stream

    # ------------------------------------------------------------------------ failures

    def _recover(self, schedule: Schedule, error: Exception) -> list[StreamOutput]:
        """Undoes a failed step and fails its requests (see `step`)."""
        self.num_failed_steps += 1
        recovery.undo(self, schedule)
        message = str(error) or type(error).__name__
        now = self.clock()
        stream: list[StreamOutput] = []
        for rid in dict.fromkeys(s.request_id for s in schedule.seqs):  # ordered, unique
            if rid in self._live:
                stream += self._fail(rid, message, now)
        recovery.forget_written(self, schedule)
        return stream

    def _fail(self, rid: Hashable, error: str, now: float) -> list[StreamOutput]:
        """Ends a live request with finish reason "error"; returns the outputs of its samples
        that had not finished."""
        self.scheduler.abort(rid)
        live = self._live[rid]
        stream = []
        for j, reason in enumerate(live.reasons):
            if reason is None:
                live.reasons[j] = "error"
                stream.append(StreamOutput(rid, j, [], True, "error", True, error))
        self._finish(rid, now, error=error)
        return stream

    def _finish(self, rid: Hashable, now: float, error: str | None = None) -> None:
        live = self._live.pop(rid)
        for sid in live.seq_ids:
            self._sample_index.pop(sid, None)
            self._rid_of.pop(sid, None)
        self.metrics_collector.on_finish(rid, now, aborted=error is not None)
        if rid in self._keep:
            samples = tuple(
                GenerationOutput(t, r, error=error if r == "error" else None)
                for t, r in zip(live.tokens, live.reasons)
            )
            self._done[rid] = RequestOutput(
                samples[0].token_ids, samples[0].finish_reason,
                error=error, request_id=rid, samples=samples,
            )  # fmt: skip

    def _apply_copies(self, copies: Sequence[tuple[int, int]]) -> None:
        apply_copies(self, copies)

    def _build(self, schedule: Schedule) -> _Batch:
        return build_batch(self, schedule)

    def _run(self, batch: _Batch) -> dict[int, tuple[int, int]]:
        """Runs the jitted step; returns seq id -> (sampled token, or -1 for non-finite logits;
        the position it takes). Sets `_step_logprobs` for rows that asked for logprobs."""
        self.step_shapes[batch.shape] += 1
        self._step_logprobs = {}
        k = max((sp.logprobs for sp in batch.sps if sp.logprobs is not None), default=None)
        args = (self.params, self.cache, batch.meta, batch.src, batch.sb, batch.pos, batch.index,
                batch.pen)  # fmt: skip
        if k is None:
            tokens, self.cache = _step(*args, cfg=self.cfg, backend=self.config.backend)
        else:  # top-k padded to a power of two: few compilations
            (tokens, lp), self.cache = _step_logprobs(
                *args, cfg=self.cfg, backend=self.config.backend, num_logprobs=bucket(max(k, 1))
            )
            self._step_logprobs = _host_logprobs(batch.ids, batch.sps, *(np.asarray(x) for x in lp))
        tokens = np.asarray(tokens).tolist()  # [B] the only device -> host transfer
        return {sid: (tok, p) for sid, tok, p in zip(batch.ids, tokens, batch.pos.tolist())}

    # ------------------------------------------------------------------------ batch API

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs a batch of requests to completion (with any requests already queued).

        Every request is validated before any is queued, so a bad one raises ValueError and
        nothing runs.

        Args:
          prompts: token-id lists.
          sampling: one SamplingParams for all, or one per prompt.

        Returns:
          One RequestOutput per prompt, in order; `.samples` holds all n samples.
        """
        sampling = per_prompt_sampling(prompts, sampling)
        rids = [self._auto_id(lambda k: ("generate", k)) for _ in prompts]
        for i, (p, sp) in enumerate(zip(prompts, sampling)):
            self._check(p, sp, rids[i], i)
        for p, sp, rid in zip(prompts, sampling, rids):
            self._keep.add(rid)
            self._enqueue(p, sp, rid, None)
        while any(rid in self._live for rid in rids):
            self.step()
            if self.last_schedule.is_empty and not self.last_schedule.preempted_seq_ids:
                # Nothing ran and nothing changed: the next schedule would be the same.
                raise RuntimeError("the scheduler cannot make progress on the waiting requests")
        return [self._done.pop(rid) for rid in rids]

    # --------------------------------------------------------------------------- metrics

    def metrics(self, slo: SLO | None = None) -> MetricsSummary:
        """Run-level metrics over every request so far (goodput against `slo` if given)."""
        return self.metrics_collector.summary(slo)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
