"""Synthetic serving workloads and a real-time driver that serves them with an `Engine`.

    reqs = make_requests("sharegpt", n=40, max_len=512, vocab=cfg.vocab_size, rate=2.0, seed=0)
    warm_engine(cfg, params, ecfg, max_len=512)      # compiles every token bucket T first
    out = run_engine(cfg, params, ecfg, reqs, slo)   # {"summary": ..., "ttft": [..], "tpot": [..]}

Workloads (seeded; token ids are random, only lengths matter, unless `text` gives the prompts'
content, see `make_requests`):
  sharegpt       ShareGPT-like lognormal prompt and output lengths, scaled to max_len;
  shared_prefix  every prompt starts with one system prompt of max_len/4 tokens;
  long_prompt    mostly short chats, one request in five a prompt of ~0.7 max_len.
Arrivals are Poisson at the given rate (inf: all at time 0). `run_engine` serves in real time:
the engine steps as fast as it can and a request is added once its arrival time has passed; the
metrics clock is `time.perf_counter`. `experiments/serve_bench.py` and notebooks/04_serving use
these.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from collections.abc import Callable

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine.buckets import pad_tokens
from jaxinfer.engine.compiled import engine_compiles  # noqa: F401  (re-exported)
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.metrics import SLO, MetricsCollector
from jaxinfer.sampling import SamplingParams

WORKLOADS = ("sharegpt", "shared_prefix", "long_prompt")


@dataclasses.dataclass(frozen=True)
class TimedRequest:
    arrival: float  # seconds after the start of the run
    prompt: list[int]
    max_tokens: int


def _lognormal(rng, median, sigma, lo, hi, n):
    return np.clip(rng.lognormal(math.log(median), sigma, n), lo, hi).astype(int)


def make_lengths(name: str, n: int, max_len: int, rng) -> list[tuple[int, int, int]]:
    """Per request (shared prefix length, prompt length, output length), P + O <= max_len.

    Raises:
      ValueError: an unknown workload name.
    """
    if name == "sharegpt":
        p = _lognormal(rng, max_len / 5, 0.9, 4, 3 * max_len // 4, n)
        o = _lognormal(rng, max_len / 8, 0.8, 2, max_len // 2, n)
        return [(0, pi, min(oi, max_len - pi)) for pi, oi in zip(p, o)]
    if name == "shared_prefix":
        sys_len = max_len // 4
        p = sys_len + _lognormal(rng, max_len / 20, 0.7, 2, max_len // 4, n)
        o = _lognormal(rng, max_len / 10, 0.6, 2, max_len // 3, n)
        return [(sys_len, pi, min(oi, max_len - pi)) for pi, oi in zip(p, o)]
    if name == "long_prompt":
        long = rng.random_sample(n) < 0.2
        p_short = _lognormal(rng, max_len / 20, 0.6, 2, max_len // 4, n)
        o_short = _lognormal(rng, max_len / 6, 0.5, 2, max_len // 3, n)
        p_long = _lognormal(rng, 0.7 * max_len, 0.1, max_len // 2, max_len - 16, n)
        return [
            (0, int(pl), 8) if lg else (0, int(ps), int(os_))
            for lg, ps, os_, pl in zip(long, p_short, o_short, p_long)
        ]
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


def make_requests(
    name: str,
    n: int,
    max_len: int,
    vocab: int,
    rate: float,
    seed: int,
    text: np.ndarray | None = None,
) -> list[TimedRequest]:
    """Seeded requests of workload `name` with Poisson arrivals at `rate` req/s (inf: all at 0).

    Prompt ids are random in [3, vocab), or, with `text` (a flat stream of token ids, e.g. a
    corpus split tokenized with the model's tokenizer), windows of it at seeded offsets: the
    same lengths and shared prefixes, but content a drafter can predict (random ids give the
    n-gram drafter nothing to match and a model drafter nothing to agree on).
    """
    rng = np.random.RandomState([seed, zlib.crc32(name.encode())])
    shared = rng.randint(3, vocab, max_len).tolist()  # the random system prompt (a prefix of it)
    lengths = make_lengths(name, n, max_len, rng)  # drawn after it in both modes: same lengths
    if text is None:
        prompts = [shared[:s] + rng.randint(3, vocab, p - s).tolist() for s, p, _ in lengths]
    else:
        text = _check_text(text, vocab, max_len)
        starts = [rng.randint(max_len, len(text) - (p - s) + 1) for s, p, _ in lengths]
        prompts = [
            text[:s].tolist() + text[b : b + p - s].tolist()
            for (s, p, _), b in zip(lengths, starts)
        ]  # the stream's first max_len ids are the shared system prompt
    arrival_rng = np.random.RandomState([seed, 7, int(rate * 1000) if math.isfinite(rate) else 0])
    gaps = arrival_rng.exponential(1.0 / rate, n) if math.isfinite(rate) else np.zeros(n)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [
        TimedRequest(float(t), prompt, int(o))
        for t, prompt, (_, _, o) in zip(arrivals, prompts, lengths)
    ]


def _check_text(text, vocab: int, max_len: int) -> np.ndarray:
    text = np.asarray(text)
    if text.ndim != 1 or len(text) < 2 * max_len or not np.issubdtype(text.dtype, np.integer):
        raise ValueError(
            f"text: expected a 1-D stream of >= 2 * max_len = {2 * max_len} token ids, got "
            f"{text.dtype} of shape {text.shape}"
        )
    if text.min() < 0 or text.max() >= vocab:
        raise ValueError(f"text: ids must be in [0, {vocab}), got [{text.min()}, {text.max()}]")
    return text


def greedy(max_tokens: int) -> SamplingParams:
    """The benchmarks' sampling: greedy, eos ignored (output lengths are the workload's)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def warm_engine(cfg: ModelConfig, params: dict, ecfg: EngineConfig, max_len: int) -> None:
    """Compiles every token bucket T an engine of `ecfg` can use, so timed runs compile nothing."""
    engine = Engine(cfg, params, ecfg)
    t, token = engine.token_buckets[0], 3
    while t <= pad_tokens(ecfg.max_num_batched_tokens, engine.token_buckets):
        # A prompt alone in a step is a T = pad(length) step; prompt + 1 <= budget keeps it
        # schedulable without chunked prefill, prompt + 2 <= max_len keeps M at its bucket.
        # Each prompt has its own token, so the prefix cache cannot shorten it.
        length = min(t, ecfg.max_num_batched_tokens - 1, max_len - 2)
        engine.generate([[token] * max(1, length)], greedy(2))
        t, token = pad_tokens(t + 1, engine.token_buckets), token + 1


def serve(engine: Engine, reqs: list[TimedRequest]) -> None:
    """Serves the requests in real time (ids 0..n-1; see the module docstring)."""
    t0 = time.perf_counter()
    i = 0
    while i < len(reqs) or engine.has_unfinished():
        now = time.perf_counter()
        while i < len(reqs) and t0 + reqs[i].arrival <= now:
            r = reqs[i]
            engine.add_request(r.prompt, greedy(r.max_tokens), i, t0 + r.arrival)
            i += 1
        if engine.has_unfinished():
            engine.step()
        elif i < len(reqs):
            time.sleep(max(0.0, t0 + reqs[i].arrival - time.perf_counter()))


def summarize(mc: MetricsCollector, slo: SLO | None) -> dict:
    """The run's summary (a dict) and the completed requests' TTFT and TPOT lists."""
    done = [r for r in mc.requests.values() if r.completed]
    return {
        "summary": mc.summary(slo).to_dict(),
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
    }


def run_engine(
    cfg: ModelConfig,
    params: dict,
    ecfg: EngineConfig,
    reqs: list[TimedRequest],
    slo: SLO | None,
    prepare: Callable[[Engine], None] | None = None,
) -> dict:
    """Serves the requests on a fresh engine in real time.

    `prepare(engine)`, when given, runs first (e.g. hands a γ controller the step-time table a
    warm-up measured, as a long-running server's would hold).

    Returns:
      `summarize`'s dict plus kv_waste, peak_concurrent, num_steps and, with speculation,
      the acceptance counters (proposed, accepted draft tokens).
    """
    engine = Engine(cfg, params, ecfg)
    if prepare is not None:
        prepare(engine)
    serve(engine, reqs)
    out = summarize(engine.metrics_collector, slo)
    m = out["summary"]
    out["kv_waste"] = m["kv_waste_mean"]
    out["peak_concurrent"] = m["peak_running"]
    out["num_steps"] = engine.num_steps
    if engine.spec_counters is not None:
        out["proposed"] = engine.spec_counters.proposed
        out["accepted"] = engine.spec_counters.accepted
    return out
