"""Disaggregated serving simulated: a prefill pool and a decode pool joined by a KV link.

    sim = DisaggSimulator(prefill_cfg, decode_cfg, prefill_time, decode_time,
                          KVLink(bandwidth=50e9, latency_s=1e-4), kv_bytes_per_token(cfg))
    res = sim.run(requests)            # res.summary(slo), res.timings[rid].parts, res.bytes_moved

The simulated deployment is `jaxinfer.distributed.disagg.Disaggregated`'s, each side the
engine's own scheduler and allocator on its own clock (`sim._Pool`), each step priced by that
side's step-time model:
  prefill  every request runs with max_tokens = 1 (chunked, prefix-cached, preemptible as on an
           engine) and ends by sampling its first token t0 at `prefill_done`. A request with
           max_tokens = 1 is finished there. The prefill side never waits on the decode side
           (its blocks return to its pool after the copy), so it is simulated first, whole.
  transfer at its first step boundary at or after `prefill_done`, the decode side allocates
           the request's full prompt blocks + t0 (FCFS; when its pool is full, it retries at
           later boundaries); blocks its prefix cache already holds are not moved (`skip`).
           The other P // S - skip blocks cross the link: latency + bytes / bandwidth, bytes =
           2 · L · K · D · itemsize · S per block (`kv_bytes_per_token`, the connector's count).
           Transfers share one link in FIFO order (bandwidth serialized, latency overlapped).
  decode   once loaded (at a decode step boundary at or after the transfer's end), the blocks
           are registered in the decode prefix cache and the request is queued as prompt + [t0]
           with max_tokens - 1: its admission computes the partial last block and t0 only. t0
           reaches the client with the request's first decode output (as `DecodeSide.step`).
TTFT = first decode output - arrival, in the parts of `Timings` (queue, prefill, transfer,
first decode). Assumptions beyond the engine's code: the decode side's host acts only at its
step boundaries (a transfer starts and lands there), and the link is one shared FIFO pipe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from jaxinfer.cache.allocator import NoFreeBlocksError
from jaxinfer.config import ModelConfig
from jaxinfer.distributed.disagg import Timings
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.metrics import SLO, MetricsCollector, MetricsSummary
from jaxinfer.engine.sim import (
    SimRequest,
    SimResult,
    Simulator,
    StepShape,
    _Pool,
    check_token_buckets,
    request_ids,
)


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int | None = None) -> int:
    """2 · L · K · D · itemsize: the K and V bytes of one token over all layers (itemsize:
    the KV storage's bytes per element; None: the model's dtype)."""
    item = np.dtype(cfg.jnp_dtype).itemsize if itemsize is None else int(itemsize)
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item


def merged(*collectors: MetricsCollector) -> MetricsCollector:
    """One collector holding the requests of several (distinct ids): arrivals, token events and
    finishes at their recorded times (the view of a client of replicas or of two pools)."""
    out = MetricsCollector(lambda: float("nan"))  # every event carries its time
    for mc in collectors:
        for rid, rec in mc.requests.items():
            out.on_arrival(rid, rec.num_prompt_tokens, rec.arrival_time)
            for t, n in rec.token_events:
                out.on_tokens(rid, n, t)
            if rec.finish_time is not None:
                out.on_finish(rid, rec.finish_time, aborted=rec.aborted)
    return out


@dataclasses.dataclass(frozen=True)
class KVLink:
    """The prefill -> decode link: a transfer of n bytes takes latency_s + n / bandwidth."""

    bandwidth: float  # bytes / s
    latency_s: float = 0.0

    def __post_init__(self):
        if not self.bandwidth > 0:
            raise ValueError(f"KVLink.bandwidth={self.bandwidth!r}: expected bytes/s > 0")
        if not self.latency_s >= 0:
            raise ValueError(f"KVLink.latency_s={self.latency_s!r}: expected seconds >= 0")


@dataclasses.dataclass
class DisaggResult:
    """A simulated disaggregated run: the client's view (`metrics`), each side's steps."""

    metrics: MetricsCollector  # arrival, t0 with the first decode output, ..., finish
    prefill: SimResult
    decode: SimResult
    timings: dict[Hashable, Timings]
    bytes_moved: dict[Hashable, int]  # per request
    blocks_skipped: int  # full blocks the decode prefix cache held: not moved

    def summary(self, slo: SLO | None = None) -> MetricsSummary:
        return self.metrics.summary(slo)


@dataclasses.dataclass
class _Saved:
    rid: Hashable
    request: SimRequest
    at: float  # prefill_done


class DisaggSimulator:
    """A prefill pool and a decode pool (module docstring), each simulated like `Simulator`.

    Args:
      prefill, decode: each side's EngineConfig (equal block sizes; the decode side needs
        prefix caching: loaded blocks reach its requests through it).
      prefill_time, decode_time: each side's step-time model.
      link: the KV link.
      bytes_per_token: `kv_bytes_per_token(cfg)` (per decode-side device if the KV is sharded
        and each shard has its own link).
      prefill_buckets, decode_buckets: each side's token buckets (`Simulator`).
    """

    def __init__(
        self,
        prefill: EngineConfig,
        decode: EngineConfig,
        prefill_time: Callable[[StepShape], float],
        decode_time: Callable[[StepShape], float],
        link: KVLink,
        bytes_per_token: int,
        prefill_buckets: Sequence[int] | None = None,
        decode_buckets: Sequence[int] | None = None,
    ):
        if prefill.block_size != decode.block_size:
            raise ValueError(
                f"prefill block_size={prefill.block_size} != decode block_size="
                f"{decode.block_size}: blocks move whole"
            )
        if not decode.enable_prefix_caching:
            raise ValueError(
                "the decode config needs enable_prefix_caching=True: loaded blocks reach its "
                "requests through the prefix cache"
            )
        if not isinstance(link, KVLink):
            raise ValueError(f"link={link!r}: expected a KVLink")
        if not isinstance(bytes_per_token, int) or bytes_per_token < 1:
            raise ValueError(f"bytes_per_token={bytes_per_token!r}: expected an int >= 1")
        self.prefill = Simulator(prefill, prefill_time, prefill_buckets)
        self.decode_config, self.decode_time = decode, decode_time
        self.decode_buckets = check_token_buckets(decode, decode_buckets)
        self.link, self.bytes_per_token = link, bytes_per_token

    def run(self, requests: Sequence[SimRequest], *, max_steps: int = 1_000_000) -> DisaggResult:
        """Replays `requests` through both pools to completion.

        Raises:
          ValueError: n > 1 (disaggregated serving takes n = 1), or a request either side's
            scheduler refuses.
          RuntimeError: no progress, or `max_steps` passed on a side.
        """
        for r in requests:
            if r.n != 1:
                raise ValueError(f"request {r.request_id!r}: n={r.n}; disaggregation takes n=1")
        pending = request_ids(requests)
        firsts = [dataclasses.replace(r, max_tokens=1, request_id=rid) for rid, r in pending]
        pre = self.prefill.run(firsts, max_steps=max_steps)
        client = MetricsCollector(lambda: float("nan"))  # every event carries its time
        timings: dict[Hashable, Timings] = {}
        saved: list[_Saved] = []
        for rid, r in pending:
            rec = pre.metrics.requests[rid]
            done = rec.token_events[0][0]
            timings[rid] = Timings(r.arrival_s, pre.first_scheduled[rid], done)
            client.on_arrival(rid, len(r.prompt_token_ids), r.arrival_s)
            if r.max_tokens == 1:
                timings[rid].loaded = timings[rid].first_token = done
                client.on_tokens(rid, 1, done)
                client.on_finish(rid, done)
            else:
                saved.append(_Saved(rid, r, done))
        saved.sort(key=lambda s: s.at)  # stable: ties keep arrival order
        dec, bytes_moved, skipped = self._decode(saved, timings, max_steps)
        for rid, rec in dec.metrics.requests.items():
            for t, n in rec.token_events:
                client.on_tokens(rid, n, t)
            client.on_finish(rid, rec.finish_time, aborted=rec.aborted)
        for rid, tm in timings.items():
            if tm.first_token is None:
                tm.first_token = dec.metrics.requests[rid].token_events[0][0]
        return DisaggResult(client, pre, dec, timings, bytes_moved, skipped)

    def _decode(self, saved: list[_Saved], timings, max_steps: int):
        """The decode pool's run over the saved requests (module docstring)."""
        pool = _Pool(self.decode_config, self.decode_time, self.decode_buckets)
        S = self.decode_config.block_size
        link_free = 0.0
        head = 0
        loading: list[tuple[float, _Saved, int]] = []  # (loaded at, request, stage id)
        bytes_moved: dict[Hashable, int] = {}
        skipped = 0
        stage_ids = iter(range(-1, -(10**12), -1))  # negative: never a scheduler seq id
        while head < len(saved) or loading or pool.scheduler.has_unfinished():
            # Allocate and start the transfers of saved requests (FCFS; stop when full).
            while head < len(saved) and saved[head].at <= pool.clock:
                s = saved[head]
                nb = len(s.request.prompt_token_ids) // S
                stage = next(stage_ids)
                tokens = [*s.request.prompt_token_ids[: nb * S], 0]
                try:
                    skip = pool.allocator.allocate(stage, tokens) // S
                except NoFreeBlocksError:
                    break
                head += 1
                skipped += skip
                nbytes = (nb - skip) * S * self.bytes_per_token
                start = max(pool.clock, link_free)
                link_free = start + nbytes / self.link.bandwidth
                loading.append((link_free + self.link.latency_s, s, stage))
                bytes_moved[s.rid] = nbytes
            # Land the transfers that have arrived: cached blocks, then the request.
            for item in [x for x in loading if x[0] <= pool.clock]:
                loading.remove(item)
                _, s, stage = item
                nb = len(s.request.prompt_token_ids) // S
                pool.allocator.mark_computed(stage, nb * S)
                r = s.request
                pool.add(
                    s.rid, [*r.prompt_token_ids, 0], r.max_tokens - 1, 1, r.arrival_s, pool.clock
                )
                pool.allocator.free(stage)
                pool.carry[s.rid] = 1  # t0 goes out with the first decode output
                timings[s.rid].loaded = pool.clock
            schedule = pool.step(max_steps)
            if schedule.is_empty and not schedule.preempted_seq_ids:
                nxt = [t for t, _, _ in loading]
                if head < len(saved) and saved[head].at > pool.clock:
                    nxt.append(saved[head].at)
                if not nxt:
                    raise RuntimeError(
                        "the decode pool cannot make progress: its blocks cannot hold the "
                        "saved requests"
                    )
                pool.clock = max(pool.clock, min(nxt))  # idle until a transfer or a save
        return pool.result(), bytes_moved, skipped
