"""Prometheus metrics of the server, with vLLM's names under the `jaxinfer:` prefix.

Each server owns a `CollectorRegistry`, so several servers in one process (tests) do not share
counters. Latencies are measured on the engine thread, when a step's tokens come out of the
engine (the HTTP layer adds its own, small, delay before a client sees them):

  jaxinfer:time_to_first_token_seconds    first token - arrival
  jaxinfer:inter_token_latency_seconds    between consecutive token steps of a request
  jaxinfer:time_per_output_token_seconds  a request's (last token - first token) / (tokens - 1)
  jaxinfer:e2e_request_latency_seconds    finish - arrival
  jaxinfer:request_queue_time_seconds     first scheduled - arrival
  jaxinfer:engine_step_seconds            one `Engine.step()` on the engine thread (device and
                                          host work, GIL waits included)

Gauges are sampled after every engine step: running / waiting requests, KV blocks used (and as a
fraction), blocks still held by requests whose client went away (0 once their abort applied),
prefix-cache hit rate. Counters: preemptions, prompt / generation tokens, finished requests by
reason, prefix-cache queries and hits (tokens).

With speculation (`EngineConfig.speculative`), the engine's acceptance counters
(`jaxinfer.engine.cycles.SpecCounters`) are mirrored after every step, vLLM's names again:

  jaxinfer:spec_decode_num_drafts                   drafting (request, step) pairs
  jaxinfer:spec_decode_num_draft_tokens             draft tokens proposed
  jaxinfer:spec_decode_num_accepted_tokens          draft tokens accepted
  jaxinfer:spec_decode_num_accepted_tokens_per_pos  {position=j}: drafts whose token j was accepted
  jaxinfer:spec_decode_num_reached_per_pos          {position=j}: drafts whose tokens 0..j-1 were
                                                    accepted, so accepted / reached is α_j
  jaxinfer:spec_decode_steps                        {gamma=g}: steps whose largest γ was g
  jaxinfer:spec_decode_gamma                        γ of the last step (gauge)
"""

from __future__ import annotations

import json
import threading

import numpy as np
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class ServerMetrics:
    """The server's Prometheus collectors and the optional JSONL request log.

    Args:
      model_name: the `model_name` label of every metric.
      request_log: a path to append one JSON line per finished request to; None: off.
    """

    def __init__(self, model_name: str, request_log: str | None = None):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist(
            "jaxinfer:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = hist(
            "jaxinfer:inter_token_latency_seconds", "Inter-token latency.", _TOKEN_BUCKETS
        )
        self.tpot = hist(
            "jaxinfer:time_per_output_token_seconds", "Time per output token.", _TOKEN_BUCKETS
        )
        self.e2e = hist(
            "jaxinfer:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        )
        self.queue_time = hist(
            "jaxinfer:request_queue_time_seconds",
            "Time waiting before scheduled.",
            _LATENCY_BUCKETS,
        )
        self.step_time = hist(
            "jaxinfer:engine_step_seconds", "Wall time of one engine step.", _TOKEN_BUCKETS
        )
        self.running = gauge("jaxinfer:num_requests_running", "Requests holding KV blocks.")
        self.waiting = gauge("jaxinfer:num_requests_waiting", "Requests not yet producing tokens.")
        self.kv_used = gauge("jaxinfer:kv_cache_used_blocks", "KV blocks with refcount > 0.")
        self.kv_total = gauge("jaxinfer:kv_cache_total_blocks", "KV blocks of the pool.")
        self.kv_usage = gauge("jaxinfer:kv_cache_usage_perc", "Fraction of KV blocks used.")
        self.kv_aborted = gauge(
            "jaxinfer:kv_cache_blocks_held_by_aborted",
            "KV blocks still held by requests whose client disconnected.",
        )
        self.prefix_hit_rate = gauge(
            "jaxinfer:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache, fraction."
        )
        self.prefix_queries = counter(
            "jaxinfer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("jaxinfer:prefix_cache_hits", "Prompt tokens found.")
        self.preemptions = counter("jaxinfer:num_preemptions", "Sequences preempted.")
        self.prompt_tokens = counter(
            "jaxinfer:prompt_tokens", "Prompt tokens of admitted requests."
        )
        self.generation_tokens = counter("jaxinfer:generation_tokens", "Tokens generated.")
        self._success = Counter(
            "jaxinfer:request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        )
        self._failed_steps = counter("jaxinfer:failed_steps", "Engine steps that raised.")
        self.max_gamma: int | None = None  # set by enable_speculation
        self._log_lock = threading.Lock()
        self._log = open(request_log, "a", buffering=1) if request_log else None  # noqa: SIM115

    def on_finish(self, record: dict) -> None:
        """A finished request: histograms, counters and the JSONL line."""
        arrival, first, finish = record["arrival"], record["first_token"], record["finish"]
        if first is not None:
            self.ttft.observe(first - arrival)
            n = record["completion_tokens"]
            if n > 1 and record["last_token"] is not None:
                self.tpot.observe((record["last_token"] - first) / (n - 1))
        if record["scheduled"] is not None:
            self.queue_time.observe(record["scheduled"] - arrival)
        self.e2e.observe(finish - arrival)
        self._success.labels(self.model_name, record["finish_reason"]).inc()
        if self._log is not None:
            with self._log_lock:
                self._log.write(json.dumps(record) + "\n")

    def enable_speculation(self, max_gamma: int) -> None:
        """Registers the speculative metrics (positions 0..max_gamma-1, γ 0..max_gamma)."""
        r, name, labels = self.registry, self.model_name, ["model_name"]

        def counter(metric, doc):
            return Counter(metric, doc, labels, registry=r).labels(name)

        self.max_gamma = max_gamma
        self.spec_drafts = counter(
            "jaxinfer:spec_decode_num_drafts", "Drafting (request, step) pairs."
        )
        self.spec_draft_tokens = counter(
            "jaxinfer:spec_decode_num_draft_tokens", "Draft tokens proposed."
        )
        self.spec_accepted = counter(
            "jaxinfer:spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        per_pos = {
            "accepted": ("jaxinfer:spec_decode_num_accepted_tokens_per_pos",
                         "Drafts whose token at this position was accepted."),
            "reached": ("jaxinfer:spec_decode_num_reached_per_pos",
                        "Drafts whose tokens before this position were all accepted."),
        }  # fmt: skip
        self._spec_pos = {}
        for key, (metric, doc) in per_pos.items():
            c = Counter(metric, doc, labels + ["position"], registry=r)
            self._spec_pos[key] = [c.labels(name, str(j)) for j in range(max_gamma)]
        steps = Counter(
            "jaxinfer:spec_decode_steps", "Steps by their largest γ.", labels + ["gamma"],
            registry=r,
        )  # fmt: skip
        self._spec_steps = [steps.labels(name, str(g)) for g in range(max_gamma + 1)]
        self.spec_gamma = Gauge(
            "jaxinfer:spec_decode_gamma", "γ of the last step.", labels, registry=r
        ).labels(name)
        self._seen = {"cycles": 0, "proposed": 0, "accepted": 0}
        self._seen_pos = {k: np.zeros(max_gamma, np.int64) for k in per_pos}

    def on_spec_step(self, counters, gamma: int) -> None:
        """After a speculative step: the engine's `SpecCounters` so far, the step's γ."""
        for attr, metric in (
            ("cycles", self.spec_drafts),
            ("proposed", self.spec_draft_tokens),
            ("accepted", self.spec_accepted),
        ):
            now = int(getattr(counters, attr))
            metric.inc(now - self._seen[attr])
            self._seen[attr] = now
        for key, now in (("accepted", counters.accepted_at), ("reached", counters.reached)):
            delta = now - self._seen_pos[key]
            for j in np.flatnonzero(delta):
                self._spec_pos[key][j].inc(int(delta[j]))
            self._seen_pos[key] = now.copy()
        self._spec_steps[gamma].inc()
        self.spec_gamma.set(gamma)

    def on_failed_step(self) -> None:
        self._failed_steps.inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        if self._log is not None:
            with self._log_lock:
                self._log.close()
                self._log = None
