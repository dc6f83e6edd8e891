r"""Serving benchmark: continuous batching against static batching, in the same KV memory.

    python -m experiments.serve_bench --workdir=runs/serve_bench            # ~5-10 min on 2 CPUs
    python -m experiments.serve_bench --workdir=runs/serve_bench_quick --quick   # ~1 min

Three synthetic workloads from a seeded generator (token ids are random; only lengths matter):
  sharegpt       ShareGPT-like lognormal prompt and output lengths, scaled to --max_len;
  shared_prefix  every prompt starts with one system prompt of max_len/4 tokens;
  long_prompt    mostly short chats, one request in five a prompt of ~0.7 max_len.
Arrivals are Poisson at each rate of the sweep. Each rate is served by four systems holding the
same number of KV token slots (--kv_slots):
  static         batches of up to B = kv_slots // max_len requests (each reserves max_len slots),
                 formed first come first served when the server is idle and run to completion
                 with `ji.generate`;
  no_chunking    ji.Engine without chunked prefill (its token budget must hold max_len);
  no_prefix      ji.Engine with chunked prefill, without prefix caching;
  engine         ji.Engine with both.
The engines run in real time: the engine steps as fast as it can and a request is added once its
arrival time has passed; the metrics clock is time.perf_counter. Static batching is simulated on a
virtual clock whose batch durations are measured `ji.generate` calls (compiled; a call that
compiled is timed again), and it is credited with streaming: token k of a batch whose longest
output is L arrives at start + k/L of the batch's duration (ji.generate itself returns all tokens
at the end, so this favours the baseline). Rates default to fractions of the full engine's
capacity, measured on a burst of the same requests. The SLO defaults to multiples of the full
engine's latencies for one request alone.

Writes into --workdir: config.json (the resolved flags), results.json, serve_bench.md (the
table), goodput_vs_rate.png and latency_cdf.png.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags, logging

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer import data
from jaxinfer.cache.metadata import bucket
from jaxinfer.engine import SLO, MetricsCollector, workload
from jaxinfer.engine.cycles import warm_up
from jaxinfer.generate import _generate_core
from jaxinfer.memory import tree_bytes

_WORKDIR = flags.DEFINE_string("workdir", "runs/serve_bench", "Output directory.")
_CONFIG = common.config_flag()
_MODEL = flags.DEFINE_string(
    "model", None, "A ji.models name or a checkpoint path; default: the shipped target model."
)
_QUICK = flags.DEFINE_boolean("quick", False, "A ~1 minute run: short requests, few of them.")
_WORKLOADS = flags.DEFINE_list(
    "workloads", ["sharegpt", "shared_prefix", "long_prompt"], "Workloads to run."
)
_NUM_REQUESTS = flags.DEFINE_integer(
    "num_requests", None, "Requests per rate (default 40/12).", lower_bound=1
)
_RATES = flags.DEFINE_list("rates", [], "Request rates (req/s); empty: --rate_fractions.")
_RATE_FRACTIONS = flags.DEFINE_list(
    "rate_fractions", ["0.5", "1.0", "2.0"], "Rates as fractions of the engine's capacity."
)
_MAX_LEN = flags.DEFINE_integer(
    "max_len", None, "Longest prompt + output (default 512/128).", lower_bound=1
)
_KV_SLOTS = flags.DEFINE_integer(
    "kv_slots", None, "KV token slots of every system (8 max_len).", lower_bound=1
)
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Engine KV block size.", lower_bound=1)
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "Engine batch rows.", lower_bound=1)
_CHUNK_BUDGET = flags.DEFINE_integer(
    "chunk_budget",
    None,
    "Token budget per step with chunked prefill (default max_len/4).",
    lower_bound=1,
)
_BACKEND = flags.DEFINE_enum("backend", "auto", ji.ops.BACKENDS, "Attention backend.")
_SLO_TTFT = flags.DEFINE_float("slo_ttft_s", None, "SLO on TTFT (s); default: 8x unloaded.")
_SLO_TPOT = flags.DEFINE_float("slo_tpot_s", None, "SLO on TPOT (s); default: 4x unloaded.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.", lower_bound=0)
_MIN_TOKEN_BUCKET = flags.DEFINE_integer(
    "min_token_bucket",
    ji.EngineConfig.min_token_bucket,
    "Engines' smallest padded T.",
    lower_bound=1,
)
_SYSTEMS = flags.DEFINE_list(
    "systems", ["static", "no_chunking", "no_prefix", "engine"], "Baseline systems to run."
)
_SPEC = flags.DEFINE_list(
    "spec", [], "Speculative engines beside 'engine' (= speculation off): gammas or 'auto'."
)
_DRAFTER = flags.DEFINE_enum(
    "drafter", "ngram", ["ngram", "model", "head"],
    "Drafter of --spec ('model': the shipped draft; 'head': --draft_head).",
)  # fmt: skip
_DRAFT_HEAD = flags.DEFINE_string(
    "draft_head", "smollm2-135m-eagle", "--drafter=head: a shipped head's name or a head folder."
)
_MAX_GAMMA = flags.DEFINE_integer("max_gamma", 4, "γ cap of --spec engines.", lower_bound=1)
_PROMPTS = flags.DEFINE_enum(
    "prompts", "random", ["random", "code"], "Prompt content: random ids, or windows of the "
    "shipped test split (Python source) in the model's tokenizer, which drafters can predict.",
)  # fmt: skip
_KEEP_QUANTIZED = flags.DEFINE_boolean(
    "keep_quantized", False, "A GGUF --model keeps its Q4_0 / Q4_1 / Q8_0 tensors as stored "
    "(`ji.load_checkpoint(keep_quantized=True)`), for every system.",
)  # fmt: skip
WORKLOADS = workload.WORKLOADS
flag_checks.choice_list(_WORKLOADS, WORKLOADS)
flag_checks.choice_list(_SYSTEMS, ("static", "no_chunking", "no_prefix", "engine"))
flag_checks.float_list(_RATES, above=0.0, allow_empty=True)
flag_checks.float_list(_RATE_FRACTIONS, above=0.0)
flag_checks.number(_SLO_TTFT, above=0.0)
flag_checks.number(_SLO_TPOT, above=0.0)

SYSTEMS = ("static", "no_chunking", "no_prefix", "engine")
_DRAFT_MODEL: list = []  # the model drafter's (cfg, params) or the head drafter, set by main
_TABLES: dict = {}  # system -> the GammaController that `warm_spec` calibrated


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """The resolved settings of a run (written to config.json)."""

    model: str  # HF dir, or a note that the model is random
    workloads: tuple[str, ...]
    num_requests: int  # per rate
    rates: tuple[float, ...]  # req/s; empty: fractions of the measured capacity
    rate_fractions: tuple[float, ...]
    max_len: int  # longest prompt + output; every static request reserves this many slots
    kv_slots: int  # KV token slots of every system
    block_size: int
    max_num_seqs: int
    chunk_budget: int  # step token budget of the chunked engines
    backend: str
    slo_ttft_s: float | None  # None: derived from the unloaded engine
    slo_tpot_s: float | None
    seed: int
    # Engines' smallest padded T (fewer compilations against padded decode steps).
    min_token_bucket: int = ji.EngineConfig.min_token_bucket
    systems: tuple[str, ...] = SYSTEMS  # baselines run ("engine" = speculation off)
    spec: tuple[str, ...] = ()  # speculative engines "spec_<γ | auto>"
    drafter: str = "ngram"
    draft_head: str | None = None  # with drafter "head": its name or folder
    max_gamma: int = 4
    prompts: str = "random"  # or "code": windows of the test split (`prompt_text`)
    keep_quantized: bool = False  # a GGUF model's quantized tensors as stored

    @property
    def all_systems(self) -> tuple[str, ...]:
        return self.systems + tuple(f"spec_{g}" for g in self.spec)


Req = workload.TimedRequest  # the workloads and the real-time driver live in the library
make_lengths, make_requests = workload.make_lengths, workload.make_requests
warm_engine, _summarize, _sampling = workload.warm_engine, workload.summarize, workload.greedy
engine_compiles = workload.engine_compiles


# ------------------------------------------------------------------------------ systems


def spec_config(bc: BenchConfig, system: str) -> ji.SpeculativeConfig | None:
    """The SpeculativeConfig of a "spec_<γ | auto>" system; None for the others."""
    if not system.startswith("spec_"):
        return None
    g = system.removeprefix("spec_")
    drafter = _DRAFT_MODEL[0] if bc.drafter in ("model", "head") else "ngram"
    return ji.SpeculativeConfig(
        drafter=drafter,
        num_speculative_tokens=g if g == "auto" else int(g),
        max_gamma=bc.max_gamma,
    )


def engine_config(bc: BenchConfig, system: str) -> ji.EngineConfig:
    S = bc.block_size
    chunked = system != "no_chunking"
    return ji.EngineConfig(
        block_size=S,
        num_blocks=bc.kv_slots // S + 1,
        max_num_seqs=bc.max_num_seqs,
        max_num_batched_tokens=bc.chunk_budget if chunked else bc.max_len,
        enable_prefix_caching=system != "no_prefix",
        enable_chunked_prefill=chunked,
        backend=bc.backend,
        min_block_bucket=bucket(-(-bc.max_len // S)),  # M fixed: one compilation per T bucket
        min_seq_bucket=bc.max_num_seqs,  # B fixed
        min_token_bucket=bc.min_token_bucket,
        speculative=spec_config(bc, system),
    )


def run_engine(cfg, params, ecfg, reqs: list[Req], slo: SLO | None, prepare=None) -> dict:
    """Serves the requests in real time (`jaxinfer.engine.workload.run_engine`); adds the
    achieved weight GB/s (weight bytes read per step x steps / duration)."""
    out = workload.run_engine(cfg, params, ecfg, reqs, slo, prepare)
    out["weight_gbs"] = tree_bytes(params) * out["num_steps"] / out["summary"]["duration_s"] / 1e9
    return out


def _timed_generate(cfg, params, prompts, sps, pad_to) -> float:
    """Seconds of one compiled `ji.generate` call (a call that compiled is run again)."""
    before = _generate_core._cache_size()
    t = time.perf_counter()
    ji.generate(cfg, params, prompts, sps, pad_to=pad_to)
    dt = time.perf_counter() - t
    if _generate_core._cache_size() != before:
        t = time.perf_counter()
        ji.generate(cfg, params, prompts, sps, pad_to=pad_to)
        dt = time.perf_counter() - t
    return dt


def run_static(cfg, params, bc: BenchConfig, reqs: list[Req], slo: SLO | None) -> dict:
    """Static batching on a virtual clock with measured batch durations (module docstring)."""
    b_max = bc.kv_slots // bc.max_len
    # Every batch has b_max slots of a max_len contiguous cache, as a static server allocates
    # them; fixing those shapes also bounds the compilations (only the prompt tokens vary).
    pad_to = {"seqs": b_max, "blocks": -(-bc.max_len // 16), "new_tokens": bc.max_len}
    mc = MetricsCollector(clock=lambda: math.nan)  # every event carries its own time
    clock, i = 0.0, 0
    waste_time, busy, peak, steps = 0.0, 0.0, 0, 0
    while i < len(reqs):
        start = max(clock, reqs[i].arrival)
        batch = [r for r in reqs[i : i + b_max] if r.arrival <= start]
        ids = range(i, i + len(batch))
        i += len(batch)
        for j, r in zip(ids, batch):
            mc.on_arrival(j, len(r.prompt), r.arrival)
        dt = _timed_generate(
            cfg,
            params,
            [r.prompt for r in batch],
            [_sampling(r.max_tokens) for r in batch],
            pad_to,
        )
        longest = max(r.max_tokens for r in batch)
        steps += longest  # forwards of the batch: its prefill and longest - 1 decodes
        for j, r in zip(ids, batch):
            for k in range(1, r.max_tokens + 1):
                mc.on_tokens(j, 1, start + dt * k / longest)
            mc.on_finish(j, start + dt * r.max_tokens / longest)
        # Each request reserves max_len slots for the whole batch; the filled ones grow by one
        # token per request per decode iteration, until the request's own last token.
        reserved = len(batch) * bc.max_len
        filled = [
            sum(len(r.prompt) + min(k, r.max_tokens) for r in batch) for k in range(1, longest + 1)
        ]
        waste_time += dt * float(np.mean([1 - f / reserved for f in filled]))
        busy += dt
        peak = max(peak, len(batch))
        clock = start + dt
    out = _summarize(mc, slo)
    out["kv_waste"] = waste_time / busy
    out["peak_concurrent"] = peak
    out["batch_size"] = b_max
    out["weight_gbs"] = tree_bytes(params) * steps / out["summary"]["duration_s"] / 1e9
    return out


# ------------------------------------------------------------------------------ driver


def load_model(path: str | None, keep_quantized: bool = False):
    """(cfg, params, description): --model, else the shipped target, else random bench-5m."""
    if path is None and "target" in ji.models.names():
        path = ji.models.path("target")
    if path is not None:
        path = common.resolve_model(path)
        cfg, params = ji.load_checkpoint(path, keep_quantized=keep_quantized)
        return cfg, params, path
    msg = "no shipped target model: benchmarking a RANDOMLY INITIALISED bench-5m preset"
    logging.warning(msg)
    print(f"WARNING: {msg}", file=sys.stderr)
    cfg = ji.preset("bench-5m")
    return cfg, ji.init_params(cfg, jax.random.key(0)), "random bench-5m (no shipped target)"


def resolve_config(description: str) -> BenchConfig:
    quick = _QUICK.value
    max_len = _MAX_LEN.value or (128 if quick else 512)
    return BenchConfig(
        model=description,
        workloads=tuple(_WORKLOADS.value),
        num_requests=_NUM_REQUESTS.value or (12 if quick else 40),
        rates=tuple(float(r) for r in _RATES.value),
        rate_fractions=tuple(float(f) for f in _RATE_FRACTIONS.value)
        if not quick or _RATE_FRACTIONS.present
        else (0.5, 2.0),
        max_len=max_len,
        kv_slots=_KV_SLOTS.value or 8 * max_len,
        block_size=_BLOCK_SIZE.value,
        max_num_seqs=_MAX_NUM_SEQS.value,
        chunk_budget=_CHUNK_BUDGET.value or max(16, max_len // 4),
        backend=_BACKEND.value,
        slo_ttft_s=_SLO_TTFT.value,
        slo_tpot_s=_SLO_TPOT.value,
        seed=_SEED.value,
        min_token_bucket=_MIN_TOKEN_BUCKET.value,
        systems=tuple(_SYSTEMS.value),
        spec=tuple(_SPEC.value),
        drafter=_DRAFTER.value,
        draft_head=_DRAFT_HEAD.value if _DRAFTER.value == "head" else None,
        max_gamma=_MAX_GAMMA.value,
        prompts=_PROMPTS.value,
        keep_quantized=_KEEP_QUANTIZED.value,
    )


def prompt_text(model_path: str | None, bc: BenchConfig) -> np.ndarray | None:
    """The token stream prompts are cut from: None for random ids; for "code", the shipped test
    split in the model's own tokenizer (documents joined, no special tokens)."""
    if bc.prompts == "random":
        return None
    if model_path is None:
        raise ValueError("--prompts=code needs a model with a tokenizer (--model)")
    tok = ji.load_tokenizer(model_path)
    return data.tokenize_documents(tok, data.load_split("test"), add_bos=False, add_eos=False)


def derive_slo(cfg, params, bc: BenchConfig) -> SLO:
    """The SLO flags, or 8x the TTFT and 4x the TPOT of one median-sized request served alone."""
    if bc.slo_ttft_s and bc.slo_tpot_s:
        return SLO(bc.slo_ttft_s, bc.slo_tpot_s)
    req = Req(0.0, [5] * (bc.max_len // 5), bc.max_len // 8)
    out = run_engine(cfg, params, engine_config(bc, "engine"), [req], None)
    s = out["summary"]
    return SLO(bc.slo_ttft_s or 8 * s["ttft"]["p50"], bc.slo_tpot_s or 4 * s["tpot"]["p50"])


def warm_spec(cfg, params, bc: BenchConfig, text=None) -> None:
    """Compiles what a speculative engine meets while serving: prefill buckets, decodes at every
    γ and batch size (`warm_up`), then one burst of each workload (another seed than the timed
    requests) for the mixed prefill + verify steps and the n-gram history lengths of real runs."""
    for system in bc.all_systems:
        if not system.startswith("spec_"):
            continue
        ecfg = engine_config(bc, system)
        warm_engine(cfg, params, ecfg, bc.max_len)
        sizes = [1 << k for k in range(min(bc.max_num_seqs, bc.num_requests).bit_length())]
        warmed = ji.Engine(cfg, params, ecfg)
        warm_up(warmed, batch_sizes=tuple(sizes))
        _TABLES[system] = warmed.controller
        for name in bc.workloads:
            burst = make_requests(name, bc.num_requests, bc.max_len, cfg.vocab_size, math.inf,
                                  bc.seed + 1, text)  # fmt: skip
            run_engine(cfg, params, ecfg, burst, None, _calibrated(system))


def _calibrated(system: str):
    """`run_engine`'s prepare for a speculative system: its fresh engine's γ controller starts
    from the step-time table `warm_up` measured (a server measures it once at start-up; without
    it every run would spend its first steps exploring each (γ, batch) cell)."""
    table = _TABLES.get(system)
    if table is None:
        return None

    def prepare(engine):
        ctl = engine.controller
        ctl.times = {k: collections.deque(v, maxlen=v.maxlen) for k, v in table.times.items()}
        ctl.seen = collections.Counter(table.seen)

    return prepare


def _run_compiled(cfg, params, bc: BenchConfig, system: str, reqs, slo, attempts: int = 5):
    """`run_engine` until a run compiles nothing (at most `attempts` runs). A speculative step's
    shape combines T, B, M with the step's γ and the n-gram history length, more than warm-up
    can enumerate; a run that compiled one (seconds, in a run of seconds) is served again on a
    fresh engine and the first is dropped. `compiles` and `attempts` say what happened."""
    for attempt in range(1, attempts + 1):
        before = engine_compiles()
        out = run_engine(cfg, params, engine_config(bc, system), reqs, slo, _calibrated(system))
        out["compiles"], out["attempts"] = engine_compiles() - before, attempt
        if not out["compiles"]:
            break
        logging.info("%s compiled %d shapes during the run: served again", system, out["compiles"])
    return out


def bench_workload(cfg, params, bc: BenchConfig, name: str, slo: SLO, text=None) -> dict:
    n, vocab = bc.num_requests, cfg.vocab_size
    burst = run_engine(
        cfg, params, engine_config(bc, "engine"),
        make_requests(name, n, bc.max_len, vocab, math.inf, bc.seed, text), None,
    )  # fmt: skip
    capacity = burst["summary"]["request_throughput"]
    rates = bc.rates or tuple(round(f * capacity, 3) for f in bc.rate_fractions)
    logging.info("%s: engine capacity %.2f req/s; rates %s", name, capacity, rates)
    runs = {s: [] for s in bc.all_systems}
    for rate in rates:
        reqs = make_requests(name, n, bc.max_len, vocab, rate, bc.seed, text)
        for system in bc.all_systems:
            if system == "static":
                out = run_static(cfg, params, bc, reqs, slo)
            else:
                out = _run_compiled(cfg, params, bc, system, reqs, slo)
            out["rate"] = rate
            runs[system].append(out)
            m = out["summary"]
            logging.info(
                "%s rate %.2f %-11s: %.1f tok/s, goodput %.2f req/s, TTFT p50 %.3fs, TPOT p50 "
                "%.4fs", name, rate, system, m["output_throughput"], m["goodput"],
                m["ttft"]["p50"], m["tpot"]["p50"],
            )  # fmt: skip
    return {"capacity_rps": capacity, "rates": list(rates), "runs": runs}


# ------------------------------------------------------------------------------ outputs


def _fmt(x, digits=3):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown(bc: BenchConfig, slo: SLO, results: dict, command: str) -> str:
    lines = [
        "# Serving benchmark",
        "",
        f"`{command}`",
        "",
        f"Model: {bc.model}. KV memory: {bc.kv_slots} token slots for every system (static: "
        f"batches of {bc.kv_slots // bc.max_len}, each request reserving {bc.max_len}; engines: "
        f"{bc.kv_slots // bc.block_size} blocks of {bc.block_size}). SLO: TTFT <= "
        f"{slo.ttft_s:.3f} s, TPOT <= {slo.tpot_s:.4f} s. {bc.num_requests} requests per rate.",
        "",
    ]
    head = (
        "| rate (req/s) | system | out tok/s | weight GB/s | req/s | goodput | "
        "TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | KV waste | peak seqs | "
        "preempt | prefix hits |"
    )
    for name, w in results.items():
        lines += [f"## {name} (engine capacity {w['capacity_rps']:.2f} req/s)", "", head]
        lines.append("|" + "---|" * 12)
        for k, rate in enumerate(w["rates"]):
            for system in w["runs"]:
                out = w["runs"][system][k]
                m = out["summary"]
                t, p = m["ttft"], m["tpot"]
                hit = m["prefix_cache_hit_rate"] if system != "static" else None
                lines.append(
                    f"| {rate:.2f} | {system} | {_fmt(m['output_throughput'], 1)} | "
                    f"{_fmt(out['weight_gbs'], 2)} | "
                    f"{_fmt(m['request_throughput'], 2)} | {_fmt(m['goodput'], 2)} | "
                    f"{_fmt(t['p50'])} / {_fmt(t['p90'])} / {_fmt(t['p99'])} | "
                    f"{_fmt(1e3 * p['p50'], 1)} / {_fmt(1e3 * p['p90'], 1)} / "
                    f"{_fmt(1e3 * p['p99'], 1)} | {_fmt(out['kv_waste'], 2)} | "
                    f"{out['peak_concurrent']} | {m['num_preemptions']} | {_fmt(hit, 2)} |"
                )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, workdir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        w = results[name]
        for system in w["runs"]:
            ax.plot(w["rates"], [o["summary"]["goodput"] for o in w["runs"][system]], "o-",
                    label=system)  # fmt: skip
        ax.set(title=name, xlabel="request rate (req/s)", ylabel="goodput (req/s within SLO)")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    goodput_png = os.path.join(workdir, "goodput_vs_rate.png")
    fig.savefig(goodput_png, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(names), 2, figsize=(10, 3.5 * len(names)), squeeze=False)
    for row, name in zip(axes, names):
        w = results[name]
        k = min(range(len(w["rates"])), key=lambda j: abs(w["rates"][j] - w["capacity_rps"]))
        for ax, key, unit in zip(row, ("ttft", "tpot"), ("s", "s")):
            for system in w["runs"]:
                xs = np.sort(w["runs"][system][k][key])
                if len(xs):
                    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=system)
            ax.set(
                title=f"{name}, {w['rates'][k]:.2f} req/s: {key.upper()} CDF",
                xlabel=f"{key.upper()} ({unit})", ylabel="fraction of requests", xscale="log",
            )  # fmt: skip
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    cdf_png = os.path.join(workdir, "latency_cdf.png")
    fig.savefig(cdf_png, dpi=110)
    plt.close(fig)
    return [goodput_png, cdf_png]


def _json_safe(x):
    """NaN -> None (strict JSON), tuples -> lists, numpy scalars -> Python."""
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    workdir = _WORKDIR.value
    cfg, params, description = load_model(_MODEL.value, _KEEP_QUANTIZED.value)
    bc = resolve_config(description)
    common.save_config(workdir, resolved=dataclasses.asdict(bc))
    for name in bc.workloads:  # unknown names fail before any compilation
        make_lengths(name, 1, bc.max_len, np.random.RandomState(0))
    t0 = time.perf_counter()
    for g in bc.spec:  # bad values fail before any compilation
        if g != "auto" and not (g.isdigit() and int(g) <= bc.max_gamma):
            raise ValueError(f"--spec={g!r}: expected 'auto' or an int in 0..{bc.max_gamma}")
    if bc.drafter == "model" and bc.spec:
        _DRAFT_MODEL.append(ji.load_checkpoint(ji.models.path("draft")))
    if bc.drafter == "head" and bc.spec:
        where = common.resolve_model(bc.draft_head)
        _DRAFT_MODEL.append(ji.speculative.heads.load_head(where, cfg))
    warm_engine(cfg, params, engine_config(bc, "engine"), bc.max_len)
    warm_engine(cfg, params, engine_config(bc, "no_chunking"), bc.max_len)
    text = prompt_text(None if description.startswith("random") else description, bc)
    warm_spec(cfg, params, bc, text)
    compiles = engine_compiles()
    slo = derive_slo(cfg, params, bc)
    logging.info("SLO: TTFT <= %.3f s, TPOT <= %.4f s", slo.ttft_s, slo.tpot_s)
    results = {name: bench_workload(cfg, params, bc, name, slo, text) for name in bc.workloads}
    command = "python -m experiments.serve_bench " + " ".join(sys.argv[1:])
    pngs = plot(results, workdir)
    with open(os.path.join(workdir, "serve_bench.md"), "w") as f:
        f.write(markdown(bc, slo, results, command))
    out = {
        "config": dataclasses.asdict(bc),
        "slo": dataclasses.asdict(slo),
        "device": str(jax.devices()[0]),
        "wall_s": time.perf_counter() - t0,
        # Compilations of the engines' jitted functions after warm-up should be 0 (timed runs
        # compile nothing; each run's own count is its "compiles"); static batches that compiled
        # were timed on a second, compiled call.
        "engine_compiles_warmup": compiles,
        "engine_compiles_timed": engine_compiles() - compiles,
        "static_compiles": _generate_core._cache_size(),
        "workloads": results,
        "plots": [os.path.basename(p) for p in pngs],
    }
    common.write_results(workdir, _json_safe(out))
    print(markdown(bc, slo, results, command))
    print(f"wrote {workdir}/results.json, serve_bench.md, {', '.join(map(os.path.basename, pngs))}")


if __name__ == "__main__":
    app.run(main)
