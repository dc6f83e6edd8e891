"""The engine thread: the one place that calls the engine, and every device call with it.

HTTP handlers never touch the `Engine`. They `submit` requests, `abort` them and `call` functions
(a scoring pass for `echo` + `logprobs`); each becomes a command in a queue that the engine thread
applies between steps, so an abort frees its blocks before the next step runs. After each step
the thread hands every request's new `StreamOutput`s to that request's sink, samples the gauges,
mirrors the speculative counters, and times the request for the metrics. A sink submitted with
its event loop (the HTTP handlers' `queue.put_nowait`) runs on that loop: the deliveries of one
step to one loop are one `call_soon_threadsafe`, so a step with B streaming requests wakes the
loop once, not B times, and the loop runs them together while the engine computes the next step.
A sink without a loop is called on the engine thread.

A failed step fails only its own requests. With the hardened engine (`StreamOutput.error`,
`finish_reason="error"`) the error arrives in the outputs; an engine whose `step()` raises
instead is handled here the same way: the requests of that step's schedule are aborted and get
an `EngineFailure`, and the thread goes on serving.

Admission control: `try_admit` counts requests that have not produced a token yet (queued here,
or waiting / prefilling in the scheduler) and refuses once `max_waiting` would be exceeded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from jaxinfer.engine import Engine, StreamOutput
from jaxinfer.sampling import SamplingParams
from jaxinfer.server.metrics import ServerMetrics

log = logging.getLogger("jaxinfer.server")
_KEEP_STEPS = 10_000  # step records of the engine's collector kept (see _finish)


@dataclasses.dataclass(frozen=True)
class EngineFailure:
    """Delivered to a request's sink when the step it was in failed."""

    request_id: Hashable
    message: str


@dataclasses.dataclass
class _Track:
    """Timing of a live request, on the engine clock."""

    sink: Callable[[list], None]
    loop: Any  # the asyncio loop the sink runs on; None: the engine thread
    arrival: float
    prompt_tokens: int
    scheduled: float | None = None
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    reason: str | None = None  # set by an abort that is a normal finish (a stop string)


def _run_sinks(batch: list) -> None:
    for sink, items in batch:
        sink(items)


class AsyncEngine:
    """Owns an `Engine` on a thread of its own.

    Args:
      engine: the engine; nothing else may call it once `start()` ran.
      metrics: where to report latencies and gauges; None: a private `ServerMetrics`.
      max_waiting: requests without a first token admitted at once; more get 503.
    """

    def __init__(
        self, engine: Engine, metrics: ServerMetrics | None = None, max_waiting: int = 256
    ):
        self.engine = engine
        self.metrics = metrics or ServerMetrics("model")
        self.max_waiting = max_waiting
        self.clock = engine.clock
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._num_waiting = 0  # admitted, no token yet (guarded by _lock)
        self._tracks: dict[Hashable, _Track] = {}  # engine thread only
        self._gone: set[Hashable] = set()  # clients that went away (guarded by _lock)
        self._stopping = False
        self._deadline = float("inf")
        self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
        self.error: BaseException | None = None  # set if the thread itself died
        self._q = self._h = 0  # prefix-cache queries / hits already counted
        self._outbox: dict[Any, list] = {}  # loop -> [(sink, items)] of this step (engine thread)
        self.speculative = engine.config.speculative
        if self.speculative is not None:
            self.metrics.enable_speculation(self.speculative.max_gamma)

    # ----------------------------------------------------------------- handler side

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def try_admit(self, k: int) -> bool:
        """Reserves k waiting places; False (nothing reserved) if that exceeds max_waiting."""
        with self._lock:
            if self._stopping or self._num_waiting + k > self.max_waiting:
                return False
            self._num_waiting += k
            return True

    def release(self, k: int) -> None:
        """Returns waiting places reserved by `try_admit` that were never submitted."""
        with self._lock:
            self._num_waiting -= k

    def submit(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        request_id: Hashable,
        sink: Callable[[list], None],
        loop: Any = None,
    ) -> concurrent.futures.Future:
        """Queues a request (its waiting place reserved by `try_admit`).

        The future resolves to None once the engine accepted it, or to the engine's ValueError;
        the sink then receives lists of `StreamOutput` (or an `EngineFailure`) until the
        request finishes: on `loop` (an asyncio loop) if given, else on the engine thread.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        track = _Track(sink, loop, self.clock(), len(prompt))
        self._put(("add", prompt, sampling, request_id, track, fut))
        return fut

    def abort(self, request_id: Hashable, reason: str | None = None) -> None:
        """Aborts a request between steps; reason None: its client went away."""
        if reason is None:
            with self._lock:
                self._gone.add(request_id)
        self._put(("abort", request_id, reason))

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Runs `fn(engine)` on the engine thread between steps; a future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, fut))
        return fut

    def stop(self, timeout: float = 0.0) -> None:
        """Stops admitting, lets live requests run up to `timeout` s, aborts the rest, joins."""
        with self._lock:
            self._stopping = True
        self._deadline = time.monotonic() + timeout
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self.metrics.close()

    def _put(self, cmd: tuple) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    # ------------------------------------------------------------------ engine side

    def _loop(self) -> None:
        try:
            while True:
                self._wake.clear()
                self._drain()
                busy = self.engine.has_unfinished()
                if self._stopping and (not busy or time.monotonic() >= self._deadline):
                    break
                if busy:
                    self._step()
                    self._sample_gauges()
                else:
                    self._sample_gauges()
                    self._wake.wait(0.05)
        except BaseException as e:  # the thread must not die silently
            log.exception("engine thread died")
            self.error = e
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            self._stopping = True
        self._drain()
        for rid in list(self._tracks):
            self._abort_now(rid, None, "the server shut down before the request finished")
        # Commands queued after the last drain: refuse adds, run nothing.
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] in ("add", "call"):
                cmd[-1].set_exception(RuntimeError("the server is shutting down"))
                if cmd[0] == "add":
                    self.release(1)

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                _, prompt, sp, rid, track, fut = cmd
                try:
                    self.engine.add_request(prompt, sp, rid, arrival_time=track.arrival)
                except Exception as e:
                    self.release(1)
                    fut.set_exception(e)
                    continue
                self._tracks[rid] = track
                self.metrics.prompt_tokens.inc(len(prompt))
                fut.set_result(None)
            elif kind == "abort":
                self._abort_now(cmd[1], cmd[2])
            elif kind == "call":
                _, fn, fut = cmd
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:
                    fut.set_exception(e)

    def _abort_now(self, rid: Hashable, reason: str | None, notify: str | None = None) -> None:
        track = self._tracks.get(rid)
        if track is None:
            return
        self.engine.abort(rid)
        track.reason = reason or "abort"
        self._finish(rid, self.clock())
        if notify is not None:  # a handler still listening (shutdown): tell it why
            self._deliver(track, [EngineFailure(rid, notify)])
            self._flush()

    def _step(self) -> None:
        t0 = self.clock()
        try:
            outs = self.engine.step()
        except Exception as e:
            self._fail_step(e)
            return
        now = self.clock()
        self.metrics.step_time.observe(now - t0)
        schedule = self.engine.last_schedule
        for s in schedule.seqs if schedule is not None else ():
            track = self._tracks.get(s.request_id)
            if track is not None and track.scheduled is None:
                track.scheduled = t0
        by_request: dict[Hashable, list[StreamOutput]] = {}
        for out in outs:
            by_request.setdefault(out.request_id, []).append(out)
        for rid, group in by_request.items():
            track = self._tracks.get(rid)
            if track is None:
                continue
            n = sum(len(o.new_token_ids) for o in group)
            if n:
                if track.first is None:
                    track.first = now
                    self.release(1)
                else:
                    self.metrics.itl.observe(now - track.last)
                track.last = now
                track.tokens += n
                self.metrics.generation_tokens.inc(n)
            self._deliver(track, group)
            if any(o.request_finished for o in group):
                errors = [o for o in group if getattr(o, "error", None)]
                track.reason = "error" if errors else group[-1].finish_reason
                self._finish(rid, now)
        self._flush()
        self.metrics.preemptions.inc(len(schedule.preempted_seq_ids) if schedule else 0)
        if self.speculative is not None and schedule is not None and schedule.seqs:
            gamma = max(s.num_lookahead for s in schedule.seqs)
            self.metrics.on_spec_step(self.engine.spec_counters, gamma)

    def _fail_step(self, e: Exception) -> None:
        """A step that raised: fail the requests it scheduled, restore the scheduler."""
        log.exception("engine step failed")
        self.metrics.on_failed_step()
        schedule = self.engine.last_schedule
        failed = [s.request_id for s in schedule.seqs] if schedule is not None else []
        failed = list(dict.fromkeys(failed)) or list(self._tracks)
        for rid in failed:
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %r after a failed step", rid)
        try:  # the scheduler waits for this step's update; aborted sequences are ignored
            self.engine.scheduler.update(schedule, {})
        except Exception:
            pass
        message = f"engine step failed: {type(e).__name__}: {e}"
        now = self.clock()
        for rid in failed:
            track = self._tracks.get(rid)
            if track is not None:
                track.reason = "error"
                self._finish(rid, now)
                self._deliver(track, [EngineFailure(rid, message)])
        self._flush()

    def _deliver(self, track: _Track, items: list) -> None:
        if track.loop is None:
            track.sink(items)
        else:
            self._outbox.setdefault(track.loop, []).append((track.sink, items))

    def _flush(self) -> None:
        """Hands this step's deliveries to their loops, one callback per loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, batch in outbox.items():
            try:
                loop.call_soon_threadsafe(_run_sinks, batch)
            except RuntimeError:  # the loop closed (the server is gone): nobody listens
                pass

    def _finish(self, rid: Hashable, now: float) -> None:
        # A server runs for days: the engine's own records of finished requests and past steps
        # (its in-process summary) are dropped; Prometheus and the request log keep the figures.
        mc = self.engine.metrics_collector
        mc.requests.pop(rid, None)
        if len(mc.steps) > 2 * _KEEP_STEPS:
            del mc.steps[:-_KEEP_STEPS]
        track = self._tracks.pop(rid)
        if track.first is None:
            self.release(1)
        self.metrics.on_finish(
            {
                "request_id": str(rid),
                "arrival": track.arrival,
                "scheduled": track.scheduled,
                "first_token": track.first,
                "last_token": track.last,
                "finish": now,
                "prompt_tokens": track.prompt_tokens,
                "completion_tokens": track.tokens,
                "finish_reason": track.reason or "unknown",
            }
        )

    def _sample_gauges(self) -> None:
        eng, m = self.engine, self.metrics
        alloc, sched = eng.allocator, eng.scheduler
        m.running.set(len({s.request_id for s in sched.running}))
        m.waiting.set(self._num_waiting)
        used, total = alloc.num_used_blocks, alloc.num_blocks - 1
        m.kv_used.set(used)
        m.kv_total.set(total)
        m.kv_usage.set(used / total)
        m.prefix_hit_rate.set(alloc.prefix_cache_hit_rate)
        q, h = alloc.prefix_cache_queries, alloc.prefix_cache_hits
        m.prefix_queries.inc(q - self._q)
        m.prefix_hits.inc(h - self._h)
        self._q, self._h = q, h
        with self._lock:
            gone = list(self._gone)
        held = 0
        for rid in gone:
            seqs = [s for s in sched.sequences(rid) if alloc.has_seq(s.seq_id)]
            if not seqs:
                with self._lock:
                    self._gone.discard(rid)
            held += sum(len(alloc.block_table(s.seq_id)) for s in seqs)
        m.kv_aborted.set(held)
