r"""Load generator over HTTP, in the style of vLLM's `bench serve`, against jaxinfer.server.

    python -m experiments.bench_serve --workdir=runs/bench_serve --quick         # ~2 min, 2 CPUs
    python -m experiments.bench_serve --workloads=sharegpt --rate_fractions=0.5,1,2
    python -m experiments.bench_serve --base_url=http://127.0.0.1:8000 --rates=4
    python -m experiments.bench_serve --soak --workdir=runs/soak                   # 1,000 requests

It starts `experiments/serve.py` as a subprocess on a free port (or attaches to a running server
with --base_url) and always stops what it started. Workloads, request lengths and the engine
settings are serve_bench.py's (the same flags: --workloads, --num_requests, --max_len,
--kv_slots, --block_size, --max_num_seqs, --chunk_budget, --rates / --rate_fractions, --seed,
--slo_ttft_s / --slo_tpot_s, --quick), so a run's numbers sit beside the in-process engine's:
with --in_process (default when the server is ours) the same requests are also served by
`serve_bench.run_engine` in this process, and the table shows both; their difference is the
HTTP overhead. Prompts are token ids (`prompt: [ids]`), generation ignores eos, so each request
produces exactly its output length.

Arrivals: Poisson at each rate (serve_bench's arrival times) or, with --burstiness != 1, gamma
inter-arrival times of shape burstiness and mean 1 / rate (vLLM's; < 1 is burstier);
--max_concurrency caps the requests in flight. Each client streams (`stream_options.include_usage`)
and records when every chunk arrives: TTFT, ITL, TPOT and E2E come from those times,
summarised by the engine's MetricsCollector (jaxinfer.engine.metrics: same definitions,
same goodput under the SLO). Rejected requests (503 when the queue is full) are counted apart.

--soak: one run of --soak_requests mixed requests (sharegpt lengths, 1 in 4 non-streaming, 1 in 8
with n = 2, 1 in 8 sampled) at --soak_rate_fraction x capacity against a server with a small
--max_waiting; reports status codes, whether every 503 was a full queue, KV blocks held after
(must be 0) and the server's RSS before and after.

Writes into --workdir: config.json, results.json, bench_serve.md, goodput_vs_rate.png.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging as std_logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
from absl import app, flags, logging

import jaxinfer as ji
from experiments import common
from experiments import serve_bench as sb  # its flags are ours too (and --config)
from experiments.pairing import paired
from jaxinfer.engine import SLO, MetricsCollector

_BASE_URL = flags.DEFINE_string("base_url", None, "Attach to this server instead of starting one.")
_SERVED_MODEL = flags.DEFINE_string(
    "served_model", None, "Model id to request; default: the first of /v1/models."
)
_BURSTINESS = flags.DEFINE_float(
    "burstiness", 1.0, "Gamma shape of inter-arrival times; 1 = Poisson.", lower_bound=1e-3
)
_MAX_CONCURRENCY = flags.DEFINE_integer(
    "max_concurrency", None, "Most requests in flight; default unbounded.", lower_bound=1
)
_MAX_WAITING = flags.DEFINE_integer(
    "max_waiting", 256, "--max_waiting of a started server.", lower_bound=1
)
_IN_PROCESS = flags.DEFINE_boolean(
    "in_process", None, "Also run serve_bench's in-process engine; default: if we start it."
)
_REPEATS = flags.DEFINE_integer(
    "repeats", 1, "Runs per rate of each path, HTTP and in-process interleaved, their order "
    "alternating; the table adds the medians of their paired differences.", lower_bound=1,
)  # fmt: skip
_TEXT: list = []  # serve_bench's prompt_text for --prompts=code, set by main
_SOAK = flags.DEFINE_boolean("soak", False, "Run the soak instead of the rate sweep.")
_SOAK_REQUESTS = flags.DEFINE_integer("soak_requests", 1000, "Soak requests.", lower_bound=1)
_SOAK_RATE = flags.DEFINE_float(
    "soak_rate_fraction", 2.0, "Soak arrival rate / measured capacity.", lower_bound=0.01
)
_SOAK_MAX_WAITING = flags.DEFINE_integer(
    "soak_max_waiting", 32, "--max_waiting of a soak's started server.", lower_bound=1
)
_TIMEOUT = flags.DEFINE_float("request_timeout_s", 600.0, "Per-request timeout.", lower_bound=1)


# ------------------------------------------------------------------------------ server


class ServerProcess:
    """experiments/serve.py on a free port, with the engine of serve_bench's "engine" system."""

    def __init__(self, model_path: str, bc: sb.BenchConfig, max_waiting: int):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cmd = [
            sys.executable, "-m", "experiments.serve",
            f"--model={model_path}", "--port=0", "--served_model_name=bench",
            f"--block_size={bc.block_size}", f"--num_blocks={bc.kv_slots // bc.block_size + 1}",
            f"--max_num_seqs={bc.max_num_seqs}", f"--max_num_batched_tokens={bc.chunk_budget}",
            f"--max_model_len={bc.max_len}", f"--min_token_bucket={bc.min_token_bucket}",
            f"--backend={bc.backend}", f"--max_waiting={max_waiting}", "--shutdown_timeout=5",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=root
        )
        self.url = None
        try:
            for line in self.proc.stdout:
                logging.info("server: %s", line.rstrip())
                m = re.match(r"serving \S+ at (\S+)", line)
                if m:
                    self.url = m.group(1)
                    break
        except BaseException:  # interrupted while it starts: it must not outlive us
            self.stop()
            raise
        if self.url is None:
            self.stop()
            raise RuntimeError(f"the server did not start (exit {self.proc.returncode})")
        # Keep reading its output, so a chatty server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            logging.debug("server: %s", line.rstrip())

    def rss_mb(self) -> float | None:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                kb = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
            return kb / 1024
        except (OSError, StopIteration):
            return None

    def cpu_s(self) -> float | None:
        """CPU seconds (user + system) the server process used so far."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 30 s; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def scrape(base_url: str, name: str) -> float | None:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


# ------------------------------------------------------------------------------ clients


@dataclasses.dataclass
class Result:
    status: int
    arrival: float  # perf_counter
    chunk_times: list[float]  # a text chunk's arrival
    completion_tokens: int = 0
    finish: float | None = None
    error: str | None = None
    code: str | None = None  # the error code of a non-200


async def one_request(h, model, req: sb.Req, extra: dict, t0: float, sem) -> Result:
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    async with sem:
        body = {
            "model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra,
        }  # fmt: skip
        res = Result(0, time.perf_counter(), [])
        try:
            if not body["stream"]:
                body.pop("stream_options")
                r = await h.post("/v1/completions", json=body)
                res.status = r.status_code
                if r.status_code == 200:
                    res.completion_tokens = r.json()["usage"]["completion_tokens"]
                    res.chunk_times = [time.perf_counter()]
                else:
                    res.code = r.json().get("error", {}).get("code")
            else:
                async with h.stream("POST", "/v1/completions", json=body) as r:
                    res.status = r.status_code
                    if r.status_code != 200:
                        await r.aread()
                        res.code = r.json().get("error", {}).get("code")
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            d = json.loads(line[6:])
                            if "error" in d:
                                res.error = d["error"]["message"]
                            elif d.get("usage"):
                                res.completion_tokens = d["usage"]["completion_tokens"]
                            elif any(c.get("text") for c in d["choices"]):
                                res.chunk_times.append(time.perf_counter())
        except Exception as e:  # a broken connection counts as a failed request
            res.error = f"{type(e).__name__}: {e}"
        res.finish = time.perf_counter()
        return res


def run_http(base_url, model, reqs, extras=None, max_concurrency=None) -> list[Result]:
    extras = extras or [{}] * len(reqs)

    async def main():
        sem = asyncio.Semaphore(max_concurrency or len(reqs))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=base_url, timeout=_TIMEOUT.value, limits=limits) as h:
            t0 = time.perf_counter()
            return await asyncio.gather(
                *(one_request(h, model, r, e, t0, sem) for r, e in zip(reqs, extras))
            )

    return asyncio.run(main())


def summarize(results: list[Result], slo: SLO | None) -> dict:
    """The engine's metrics over the clients' timings; rejected and failed requests apart."""
    mc = MetricsCollector(clock=lambda: math.nan)
    for i, r in enumerate(results):
        if r.status != 200 or r.error or not r.chunk_times:
            continue
        mc.on_arrival(i, 0, r.arrival)
        extra = max(0, r.completion_tokens - len(r.chunk_times))  # tokens of held-back text
        for k, t in enumerate(r.chunk_times):
            mc.on_tokens(i, 1 + (extra if k == len(r.chunk_times) - 1 else 0), t)
        mc.on_finish(i, r.finish)
    done = [r for r in mc.requests.values() if r.completed]
    codes: dict[str, int] = {}
    for r in results:
        key = str(r.status) if not r.error else f"{r.status}+error"
        codes[key] = codes.get(key, 0) + 1
    return {
        "summary": mc.summary(slo).to_dict() if done else None,
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "status_codes": codes,
        "rejected_503": sum(r.status == 503 for r in results),
        "rejected_not_queue_full": sum(r.status == 503 and r.code != "queue_full" for r in results),
        "failed": sum(r.status not in (200, 503) or bool(r.error) for r in results),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


# ------------------------------------------------------------------------------ workloads


def arrivals(name: str, bc: sb.BenchConfig, rate: float, n: int, vocab: int) -> list[sb.Req]:
    """serve_bench's requests; with burstiness != 1, gamma inter-arrival times instead."""
    reqs = sb.make_requests(name, n, bc.max_len, vocab, rate, bc.seed, _TEXT[0] if _TEXT else None)
    b = _BURSTINESS.value
    if b == 1.0 or not math.isfinite(rate):
        return reqs
    rng = np.random.RandomState([bc.seed, 11, int(rate * 1000)])
    gaps = rng.gamma(b, 1.0 / (rate * b), n)
    times = np.cumsum(gaps) - gaps[0]
    return [dataclasses.replace(r, arrival=float(t)) for r, t in zip(reqs, times)]


def capacity(base_url, model, name, bc, vocab) -> float:
    """Completed requests per second of a burst (every request at t = 0)."""
    reqs = arrivals(name, bc, math.inf, bc.num_requests, vocab)
    res = run_http(base_url, model, reqs)
    ok = [r for r in res if r.status == 200 and not r.error]
    return len(ok) / (max(r.finish for r in ok) - min(r.arrival for r in res))


def derive_slo(base_url, model, bc) -> SLO:
    """The SLO flags, or 8x TTFT and 4x TPOT of one median request alone, over HTTP."""
    if bc.slo_ttft_s and bc.slo_tpot_s:
        return SLO(bc.slo_ttft_s, bc.slo_tpot_s)
    req = sb.Req(0.0, [5] * (bc.max_len // 5), bc.max_len // 8)
    run_http(base_url, model, [req])  # warm the connection path
    s = summarize(run_http(base_url, model, [req]), None)["summary"]
    return SLO(bc.slo_ttft_s or 8 * s["ttft"]["p50"], bc.slo_tpot_s or 4 * s["tpot"]["p50"])


# ------------------------------------------------------------------------------ runs


def _cpu_ms_per_token(seconds: float | None, out: dict) -> float | None:
    m = out.get("summary")
    if seconds is None or not m or not m["total_output_tokens"]:
        return None
    return 1e3 * seconds / m["total_output_tokens"]


def reset_prefix_cache(base_url: str) -> None:
    """Empties the server's prefix cache, so a replayed workload finds only what it shares
    itself (the in-process engine starts empty every run); a server without the route is told."""
    r = httpx.post(base_url + "/reset_prefix_cache")
    if r.status_code == 404:
        logging.warning(
            "%s has no /reset_prefix_cache: HTTP runs may hit earlier runs' prompts", base_url
        )
    else:
        r.raise_for_status()


def _serve_http(base_url, model, reqs, slo, server) -> dict:
    """One run over HTTP, with the CPU ms per token of the server process and of the clients."""
    reset_prefix_cache(base_url)
    load = common.load_average()
    srv0, cli0 = server.cpu_s() if server else None, time.process_time()
    res = summarize(run_http(base_url, model, reqs, None, _MAX_CONCURRENCY.value), slo)
    srv1, cli1 = server.cpu_s() if server else None, time.process_time()
    srv_s = srv1 - srv0 if srv0 is not None and srv1 is not None else None
    res.update(
        load_avg_1m=load,
        server_cpu_ms_per_token=_cpu_ms_per_token(srv_s, res),
        client_cpu_ms_per_token=_cpu_ms_per_token(cli1 - cli0, res),
    )
    return res


def _serve_in_process(cfg, params, ecfg, reqs, slo) -> dict:
    load, cpu0 = common.load_average(), time.process_time()
    res = sb.run_engine(cfg, params, ecfg, reqs, slo)
    res.update(
        load_avg_1m=load,
        server_cpu_ms_per_token=_cpu_ms_per_token(time.process_time() - cpu0, res),
    )
    return res


def sweep(base_url, model, bc, slo, vocab, in_process, server=None) -> dict:
    """Each rate over HTTP and in-process (`in_process`: (cfg, params, EngineConfig), or None),
    --repeats times, the two interleaved with their order alternating; with CPU ms per output
    token of the server process, of this process's clients, and of the in-process engine (this
    process). `runs[path][k]` is rate k's first repeat (with every repeat under "repeats");
    `paired[k]` compares the repeats pair by pair."""
    out = {}
    for name in bc.workloads:
        cap = capacity(base_url, model, name, bc, vocab)
        rates = list(bc.rates) or [f * cap for f in bc.rate_fractions]
        runs: dict = {"http": [], "in_process": []}
        pairs_by_rate = []
        for rate in rates:
            reqs = arrivals(name, bc, rate, bc.num_requests, vocab)
            pairs = []
            for rep in range(_REPEATS.value):
                order = ("http", "in_process") if rep % 2 == 0 else ("in_process", "http")
                pair = {}
                for path in order:
                    if path == "http":
                        pair[path] = _serve_http(base_url, model, reqs, slo, server)
                    elif in_process is not None:
                        pair[path] = _serve_in_process(*in_process, reqs, slo)
                pairs.append(pair)
            for path in pairs[0]:
                runs[path].append(dict(pairs[0][path], repeats=[p[path] for p in pairs]))
            pairs_by_rate.append(paired(pairs))
            logging.info("%s @ %.2f req/s done", name, rate)
        out[name] = {"capacity_rps": cap, "rates": rates, "runs": runs, "paired": pairs_by_rate}
    return out


def soak(base_url, model, bc, vocab, server: ServerProcess | None) -> dict:
    cap = capacity(base_url, model, "sharegpt", bc, vocab)
    rate = _SOAK_RATE.value * cap
    n = _SOAK_REQUESTS.value
    reqs = arrivals("sharegpt", bc, rate, n, vocab)
    extras = []
    for k in range(n):
        e = {}
        if k % 4 == 1:
            e["stream"] = False
        if k % 8 == 2:
            e["n"] = 2
        if k % 8 == 5:
            e.update(temperature=0.8, seed=k)
        extras.append(e)
    rss0 = server.rss_mb() if server else None
    t0 = time.perf_counter()
    res = run_http(base_url, model, reqs, extras)
    wall = time.perf_counter() - t0
    time.sleep(0.5)
    out = summarize(res, None)
    out.pop("ttft")
    out.pop("tpot")
    out.update(
        requests=n,
        rate_rps=rate,
        capacity_rps=cap,
        wall_s=wall,
        kv_blocks_used_after=scrape(base_url, "jaxinfer:kv_cache_used_blocks"),
        waiting_after=scrape(base_url, "jaxinfer:num_requests_waiting"),
        rss_mb_before=rss0,
        rss_mb_after=server.rss_mb() if server else None,
    )
    out["ok"] = (
        out["failed"] == 0
        and out["rejected_not_queue_full"] == 0
        and out["kv_blocks_used_after"] == 0
    )
    return out


def markdown(bc, slo, results, command) -> str:
    lines = [
        "# Serving benchmark over HTTP", "", f"`{command}`", "",
        f"Model: {bc.model}. Engine: {bc.kv_slots // bc.block_size} blocks of {bc.block_size}, "
        f"{bc.max_num_seqs} seqs, {bc.chunk_budget} tokens per step. SLO: TTFT <= "
        f"{slo.ttft_s:.3f} s, TPOT <= {slo.tpot_s:.4f} s. {bc.num_requests} requests per rate; "
        f"burstiness {_BURSTINESS.value}; max concurrency {_MAX_CONCURRENCY.value or '∞'}.", "",
    ]  # fmt: skip
    head = (
        f"| rate (req/s) | path | {common.SERVING_HEAD} | 503 | failed | CPU ms/token: server or "
        "in-process / clients | load 1m |"
    )
    for name, w in results.items():
        lines += [f"## {name} (HTTP capacity {w['capacity_rps']:.2f} req/s)", "", head]
        lines.append("|" + "---|" * 11)
        for k, rate in enumerate(w["rates"]):
            for path in ("http", "in_process"):
                if len(w["runs"][path]) <= k:
                    continue
                out = w["runs"][path][k]
                m = out["summary"]
                if m is None:
                    lines.append(f"| {rate:.2f} | {path} | no request completed |||||||||")
                    continue
                lines.append(
                    f"| {rate:.2f} | {path} | {common.serving_cells(m)} | "
                    f"{out.get('rejected_503', '—')} | {out.get('failed', '—')} | "
                    f"{common.fmt(out.get('server_cpu_ms_per_token'), 2)} / "
                    f"{common.fmt(out.get('client_cpu_ms_per_token'), 2)} | "
                    f"{common.fmt(out.get('load_avg_1m'), 1)} |"
                )
        lines.append("")
        if any(w.get("paired") or ()):
            lines += [
                f"HTTP against in-process over {_REPEATS.value} interleaved repeats per rate "
                "(median [min, max] of the pairs):", "",
                "| rate (req/s) | pairs | goodput HTTP / in-process | TTFT p50 HTTP − in-process "
                "(ms) | pooled TTFT p50 diff (ms) | per-request TTFT diff, median / mean (ms) | "
                "TPOT p50 HTTP − in-process (ms) |", "|---|---|---|---|---|---|---|",
            ]  # fmt: skip
            for rate, pr in zip(w["rates"], w["paired"]):
                if pr is None:
                    continue
                cells = []
                for key, digits in (
                    ("goodput_ratio", 3),
                    ("ttft_p50_diff_ms", 1),
                    ("tpot_p50_diff_ms", 1),
                ):
                    st = pr[key]
                    cells.append("—" if st is None else f"{st['median']:.{digits}f} "
                                 f"[{st['min']:.{digits}f}, {st['max']:.{digits}f}]")  # fmt: skip
                    if key == "ttft_p50_diff_ms":
                        per = pr.get("ttft_per_request_diff_ms")
                        cells.append(common.fmt(pr.get("ttft_p50_pooled_diff_ms"), 1))
                        cells.append("—" if per is None else
                                     f"{per['median']:.1f} / {per['mean']:.1f}")  # fmt: skip
                lines.append(f"| {rate:.2f} | {pr['pairs']} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def plot(results: dict, workdir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        w = results[name]
        for path, runs in w["runs"].items():
            if runs:
                good = [(o["summary"] or {}).get("goodput", math.nan) for o in runs]
                ax.plot(w["rates"][: len(good)], good, "o-", label=path)
        ax.set(title=name, xlabel="request rate (req/s)", ylabel="goodput (req/s within SLO)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png = os.path.join(workdir, "goodput_vs_rate.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [png]


def main(argv):
    del argv
    std_logging.getLogger("httpx").setLevel(std_logging.WARNING)  # a line per request
    common.apply_config(sb._CONFIG.value)
    workdir = sb._WORKDIR.value
    if workdir == "runs/serve_bench":  # serve_bench's default
        workdir = "runs/bench_serve"
    attach = _BASE_URL.value is not None
    model_path = common.resolve_model(sb._MODEL.value or "target")
    bc = sb.resolve_config(model_path)
    in_process = _IN_PROCESS.value if _IN_PROCESS.value is not None else not attach
    if _SOAK.value and bc.num_requests == (12 if sb._QUICK.value else 40):
        bc = dataclasses.replace(bc, num_requests=40)  # capacity burst size
    common.save_config(workdir, resolved=dataclasses.asdict(bc))
    for name in bc.workloads:  # unknown names fail before the server starts
        sb.make_lengths(name, 1, bc.max_len, np.random.RandomState(0))
    cfg_params = ji.load_checkpoint(model_path) if (in_process or not attach) else None
    text = sb.prompt_text(model_path, bc)
    if text is not None:
        _TEXT.append(text)
    vocab = cfg_params[0].vocab_size if cfg_params else 4096
    max_waiting = _SOAK_MAX_WAITING.value if _SOAK.value else _MAX_WAITING.value
    # SIGTERM / SIGINT end the run through the `finally` below, which stops our server.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, _: sys.exit(128 + num))
    server = None if attach else ServerProcess(model_path, bc, max_waiting)
    t0 = time.perf_counter()
    try:
        base_url = _BASE_URL.value or server.url
        model = _SERVED_MODEL.value or httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
        if _SOAK.value:
            out = {"soak": soak(base_url, model, bc, vocab, server)}
            print(json.dumps(out["soak"], indent=1))
        else:
            slo = derive_slo(base_url, model, bc)
            logging.info("SLO: TTFT <= %.3f s, TPOT <= %.4f s", slo.ttft_s, slo.tpot_s)
            twin, buckets_used = None, None
            if in_process:
                # The server's T buckets: each process measures its own cost table, and two
                # tables can keep different buckets, so the two paths would pad steps apart
                # and their difference would not be the HTTP overhead alone.
                buckets = httpx.get(base_url + "/health").json().get("token_buckets")
                ecfg = sb.engine_config(bc, "engine")
                if buckets:
                    ecfg = dataclasses.replace(ecfg, token_buckets=tuple(buckets))
                logging.info("token buckets: server %s, in-process %s", buckets,
                             ecfg.token_buckets)  # fmt: skip
                sb.warm_engine(*cfg_params, ecfg, bc.max_len)
                twin = (*cfg_params, ecfg)
                buckets_used = {"server": buckets, "in_process": list(ecfg.token_buckets)}
            results = sweep(base_url, model, bc, slo, vocab, twin, server)
            command = "python -m experiments.bench_serve " + " ".join(sys.argv[1:])
            pngs = plot(results, workdir)
            md = markdown(bc, slo, results, command)
            with open(os.path.join(workdir, "bench_serve.md"), "w") as f:
                f.write(md)
            out = {"slo": dataclasses.asdict(slo), "workloads": results, "plots": pngs,
                   "token_buckets": buckets_used}  # fmt: skip
            print(md)
    finally:
        exit_code = server.stop() if server else None
    out.update(config=dataclasses.asdict(bc), wall_s=time.perf_counter() - t0)
    out["server_exit_code"] = exit_code
    common.write_results(workdir, sb._json_safe(out))
    print(f"wrote {workdir}/results.json (server exit code {exit_code})")
    if _SOAK.value and not out["soak"]["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
