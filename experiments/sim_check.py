r"""The simulator against the measured engine: predicted vs measured TTFT p50, TPOT p50 and goodput.

    python -m experiments.sim_check --model=target --workdir=runs/sim_check_target
    python -m experiments.sim_check --model=smollm2-135m --workdir=runs/sim_check_smollm2
    python -m experiments.sim_check --model=target --quick --repeats=1 --workloads=sharegpt

Workloads, request lengths, the engine's settings and the SLO are serve_bench.py's (its flags are
ours: --workloads, --num_requests, --max_len, --kv_slots, --block_size, --max_num_seqs,
--chunk_budget, --rates / --rate_fractions, --seed, --slo_ttft_s / --slo_tpot_s, --prompts,
--quick;
--model also takes a `ji.models` name). Per workload:
  calibrate  requests of --calib_seed (never the measured ones) served in real time: a burst
             first (its request throughput is the engine's capacity), then, before every
             measured run, the same number of them at that run's rate (so the fitted steps
             cover the shapes each rate batches, and share the machine's spell with the
             measured runs: fitted on a burst and a half-capacity run made minutes before,
             the table priced measured steps 22% low to 16% high, and near capacity a step
             priced low is a queue the prediction misses);
             each engine step is timed from the end of the previous one (or the end of an idle
             wait), so a step's price includes the driver's work between steps (adding
             requests); a step that compiled is left out (it prices the compiler); the
             step-time models are fitted on those (shape, seconds) pairs: `TableStepTime` (the
             prediction) and `LinearStepTime` (reported beside it, to show why it is not used);
             the median lateness of the driver's wake-ups for arrivals after an idle sleep
             (`Simulator(idle_wake_s=...)`: an idle real-time driver oversleeps), and the
             median excess of the first step after such a sleep over its shape's price
             (`idle_step_s`: it starts on parked threads and cold caches; those steps are not
             in the fits), both also from a last run, min(--num_requests, 8) requests at a
             tenth of capacity, most of which arrive at an idle engine;
  measure    at each rate (default 0.25, 0.5, 0.9 of capacity) the requests of --seed served in
             real time by a fresh engine (the calibration's driver, timing every step),
             --repeats times, the repeats interleaved over the rates (a busy spell of a shared
             machine hits every rate);
  predict    `Simulator(engine config, model, token_buckets=engine.token_buckets)` on the same
             requests (arrival times, prompts, output lengths): deterministic, run once; with
             the calibrated models, and with a TableStepTime fitted on the calibration's and
             the other rates' measured steps (never this rate's: more step costs from the same
             spell of a shared machine, so more of what is left to predict is the dynamics).
Per cell: predicted and measured (median over repeats) TTFT p50, TPOT p50 and goodput under the
SLO, the error predicted / measured - 1, its spread (min..max of the error against each repeat),
the steps, the 1-minute load average of the repeats, and the step model's price of the
measured runs' own steps over their measured time (near 1: the model prices steps right, so a
miss is in the dynamics, what got batched when). Writes config.json, results.json and
sim_check.md into --workdir.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import numpy as np
from absl import app, flags, logging

import jaxinfer as ji
from experiments import common
from experiments import serve_bench as sb  # its flags are ours too (and --config)
from jaxinfer.engine import engine as engine_mod
from jaxinfer.engine import workload
from jaxinfer.engine.sim import LinearStepTime, SimRequest, Simulator, TableStepTime, step_shape

flags.FLAGS.set_default("workdir", "runs/sim_check")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Measured runs per rate.", lower_bound=1)
_CALIB_SEED = flags.DEFINE_integer(
    "calib_seed", 1, "Seed of the calibration requests (not --seed).", lower_bound=0
)
_TOLERANCE = flags.DEFINE_float("tolerance", 0.15, "Acceptance: |error| <= this.", lower_bound=0)
flags.register_multi_flags_validator(
    ["calib_seed", "seed"],
    lambda f: f["calib_seed"] != f["seed"],
    "--calib_seed must differ from --seed: the step-time model is fitted on other requests",
)
DEFAULT_FRACTIONS = (0.25, 0.5, 0.9)
METRICS = (("ttft_p50", "ttft", "p50"), ("tpot_p50", "tpot", "p50"), ("goodput", "goodput", None))


def serve_timed(
    engine: ji.Engine, reqs: list, wakes: list | None = None, cold: list | None = None
) -> list[tuple]:
    """`workload.serve` (real time), returning each non-empty step's (StepShape, seconds since
    the end of the previous step or idle wait); appends to `wakes` how late each idle wait
    ended after the arrival it waited for, and to `cold` the (shape, seconds) of each first
    step after an idle wait (those are not in the returned list)."""
    samples = []
    compiled = engine_mod._step._cache_size
    t0 = time.perf_counter()
    mark = t0
    i = 0
    woke = False
    while i < len(reqs) or engine.has_unfinished():
        now = time.perf_counter()
        while i < len(reqs) and t0 + reqs[i].arrival <= now:
            r = reqs[i]
            engine.add_request(r.prompt, workload.greedy(r.max_tokens), i, t0 + r.arrival)
            i += 1
        if engine.has_unfinished():
            before = compiled()
            engine.step()
            end = time.perf_counter()
            # A step that compiled prices the compiler, not the step: left out.
            if not engine.last_schedule.is_empty and compiled() == before:
                shape = step_shape(engine.last_schedule, engine.config, engine.token_buckets)
                if not woke:
                    samples.append((shape, end - mark))
                elif cold is not None:
                    cold.append((shape, end - mark))
            woke = woke and engine.last_schedule.is_empty
            mark = end
        elif i < len(reqs):
            time.sleep(max(0.0, t0 + reqs[i].arrival - time.perf_counter()))
            mark = time.perf_counter()
            woke = True
            if wakes is not None:
                wakes.append(max(0.0, mark - (t0 + reqs[i].arrival)))
    return samples


def measured_rates(bc, capacity: float) -> tuple[float, ...]:
    """The rates to measure: --rates, or --rate_fractions (default DEFAULT_FRACTIONS) of it."""
    fractions = bc.rate_fractions if sb._RATE_FRACTIONS.present else DEFAULT_FRACTIONS
    return bc.rates or tuple(round(f * capacity, 3) for f in fractions)


def capacity_run(cfg, params, ecfg, bc, name: str, text=None) -> tuple[float, tuple, list]:
    """A burst of --calib_seed requests: (capacity req/s, the engine's token buckets, steps)."""
    engine = ji.Engine(cfg, params, ecfg)
    reqs = sb.make_requests(
        name, bc.num_requests, bc.max_len, cfg.vocab_size, math.inf, _CALIB_SEED.value, text
    )
    samples = serve_timed(engine, reqs)
    return engine.metrics().request_throughput, engine.token_buckets, samples


def fit_calibration(capacity: float, buckets, samples: list, wakes: list, cold: list) -> dict:
    """The fitted step-time models and idle terms of the calibration runs' steps."""
    table = TableStepTime.fit(samples)
    return {
        "capacity_rps": capacity,
        "token_buckets": buckets,
        "num_samples": len(samples),
        "table": table,
        "linear": LinearStepTime.fit(samples),
        "idle_wake_s": float(np.median(wakes)) if wakes else 0.0,
        # A step after an idle sleep, over its shape's price (median; none: 0).
        "idle_step_s": max(0.0, float(np.median([t - table(s) for s, t in cold]))) if cold else 0.0,
        "num_cold_steps": len(cold),
        "samples": [[*dataclasses.astuple(shape), t] for shape, t in samples],  # for refits
        "samples_raw": samples,
    }


def _value(summary: dict, key: str, q: str | None) -> float:
    v = summary[key] if q is None else summary[key][q]
    return math.nan if v is None else float(v)


def _error(pred: float, meas: float) -> float | None:
    if meas == 0 or not (math.isfinite(pred) and math.isfinite(meas)):
        return 0.0 if pred == meas else None
    return pred / meas - 1


def cell(pred: dict, measured: list[dict], tolerance: float) -> dict:
    """One (workload, rate) row: per metric predicted, measured median and spread, error."""
    row = {}
    for label, key, q in METRICS:
        ms = [_value(m["summary"], key, q) for m in measured]
        med = float(np.median(ms))
        p = _value(pred, key, q)
        errs = [e for e in (_error(p, m) for m in ms) if e is not None]
        err = _error(p, med)
        row[label] = {
            "predicted": p, "measured": med, "measured_min": min(ms), "measured_max": max(ms),
            "error": err, "error_min": min(errs, default=None),
            "error_max": max(errs, default=None),
            "within": err is not None and abs(err) <= tolerance,
        }  # fmt: skip
    return row


def check_workload(cfg, params, bc, name: str, slo, text=None) -> dict:
    ecfg = sb.engine_config(bc, "engine")
    n, vocab = bc.num_requests, cfg.vocab_size
    capacity, buckets, samples = capacity_run(cfg, params, ecfg, bc, name, text)
    rates = measured_rates(bc, capacity)
    logging.info("%s: capacity %.2f req/s, rates %s", name, capacity, rates)
    calib = {r: sb.make_requests(name, n, bc.max_len, vocab, r, _CALIB_SEED.value, text)
             for r in rates}  # fmt: skip
    reqs = {r: sb.make_requests(name, n, bc.max_len, vocab, r, bc.seed, text) for r in rates}
    measured = {r: [] for r in rates}
    steps = {r: [] for r in rates}  # every measured run's (shape, seconds) per step
    wakes, cold = [], []
    for k in range(_REPEATS.value):  # interleaved: every rate once per round
        for r in rates:
            # Calibration first: other requests at the same rate, just before the measured run.
            samples += serve_timed(ji.Engine(cfg, params, ecfg), calib[r], wakes, cold)
            engine = ji.Engine(cfg, params, ecfg)
            steps[r] += serve_timed(engine, reqs[r])
            out = workload.summarize(engine.metrics_collector, slo)
            out["num_steps"] = engine.num_steps
            out["load_avg"] = common.load_average()
            measured[r].append(out)
            m = out["summary"]
            logging.info("%s rate %.2f repeat %d: TTFT p50 %.4f s, TPOT p50 %.4f s, goodput %.2f",
                         name, r, k, m["ttft"]["p50"], m["tpot"]["p50"], m["goodput"])  # fmt: skip
    # The idle probe: a few more requests at a tenth of capacity, so that most arrive at an
    # idle engine. Runs near capacity idle rarely (0-3 waits in a run), too few to price
    # the first step after a sleep, and one outlier set the mean (a 9.9 ms excess from 1 step).
    probe = sb.make_requests(name, min(n, 8), bc.max_len, vocab, capacity / 10,
                             _CALIB_SEED.value, text)  # fmt: skip
    samples += serve_timed(ji.Engine(cfg, params, ecfg), probe, wakes, cold)
    cal = fit_calibration(capacity, buckets, samples, wakes, cold)
    logging.info("%s: idle wake %.2e s, idle step +%.2e s (%d steps), %s", name, cal["idle_wake_s"],
                 cal["idle_step_s"], cal["num_cold_steps"], cal["table"])  # fmt: skip
    rows = []
    for r in rates:
        sim_reqs = [SimRequest(q.arrival, q.prompt, q.max_tokens, request_id=i)
                    for i, q in enumerate(reqs[r])]  # fmt: skip
        row = {"rate": r, "fraction": r / cal["capacity_rps"]}
        # "others": a TableStepTime fitted on the calibration's steps and the other rates'
        # measured steps (never this rate's): more of its step costs come from the same spell
        # of a shared machine as this rate's runs, so more of what is left is the dynamics.
        others = cal["samples_raw"] + [x for q in rates if q != r for x in steps[q]]
        models = {**{m: cal[m] for m in ("table", "linear")}, "others": TableStepTime.fit(others)}
        for model, step_time in models.items():
            sim = Simulator(
                ecfg, step_time, cal["token_buckets"], idle_wake_s=cal["idle_wake_s"],
                idle_step_s=cal["idle_step_s"],
            ).run(sim_reqs)  # fmt: skip
            pred = sim.summary(slo).to_dict()
            row[model] = cell(pred, measured[r], _TOLERANCE.value)
            row[model]["num_steps"] = pred["num_steps"]
        row["measured_steps"] = [o["num_steps"] for o in measured[r]]
        # The step model against the measured runs' own steps: the price of exactly the steps
        # the engine ran, over their measured seconds. Off 1 means the model misprices steps;
        # near 1 with a TTFT / TPOT miss means the dynamics differ (what got batched when).
        meas = sum(t for _, t in steps[r])
        row["step_price_ratio"] = {
            model: sum(m(shape) for shape, _ in steps[r]) / meas if meas else None
            for model, m in models.items()
        }  # fmt: skip
        row["load_avg"] = [o["load_avg"] for o in measured[r]]
        rows.append(row)
    cal = dict(
        cal, table=dataclasses.asdict(cal["table"]), linear=dataclasses.asdict(cal["linear"])
    )
    del cal["samples_raw"]
    return {"calibration": cal, "rows": rows}


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def markdown(bc, slo, results: dict, command: str) -> str:
    lines = [
        "# Simulator vs measured engine", "", f"`{command}`", "",
        f"Model: {bc.model}. SLO: TTFT <= {slo.ttft_s:.3f} s, TPOT <= {slo.tpot_s:.4f} s. "
        f"{bc.num_requests} requests per rate, {_REPEATS.value} measured repeats. Prediction: "
        "TableStepTime (LinearStepTime's error beside it, and a TableStepTime fitted on the "
        "calibration's and the other rates' measured steps). Error: predicted / median "
        "measured - 1 [min..max over repeats].", "",
    ]  # fmt: skip
    head = ("| rate (x cap) | metric | predicted | measured [min..max] | error [spread] | linear "
            "| + other rates' steps |")  # fmt: skip
    for name, w in results.items():
        cap = w["calibration"]["capacity_rps"]
        lines += [f"## {name} (capacity {cap:.2f} req/s)", "", head, "|" + "---|" * 7]
        for row in w["rows"]:
            load = "/".join(f"{x:.1f}" for x in row["load_avg"] if x is not None)
            for label, _, _ in METRICS:
                c, lin, oth = row["table"][label], row["linear"][label], row["others"][label]
                lines.append(
                    f"| {row['rate']:.2f} ({row['fraction']:.2f}) | {label} | "
                    f"{common.fmt(c['predicted'], 4)} | {common.fmt(c['measured'], 4)} "
                    f"[{common.fmt(c['measured_min'], 4)}..{common.fmt(c['measured_max'], 4)}] | "
                    f"{_pct(c['error'])} [{_pct(c['error_min'])}..{_pct(c['error_max'])}] | "
                    f"{_pct(lin['error'])} | {_pct(oth['error'])} |"
                )
            lines.append(
                f"| | steps | {row['table']['num_steps']} | {row['measured_steps']} | load "
                f"{load} | | {row['others']['num_steps']} |"
            )
            spr = row["step_price_ratio"]
            lines.append(
                f"| | model's price of the measured steps / their time | "
                f"{common.fmt(spr['table'], 3)} | | | {common.fmt(spr['linear'], 3)} | "
                f"{common.fmt(spr['others'], 3)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv):
    del argv
    common.apply_config(sb._CONFIG.value)
    workdir = sb._WORKDIR.value
    path = common.resolve_model(sb._MODEL.value) if sb._MODEL.value else None
    cfg, params, description = sb.load_model(path)
    bc = sb.resolve_config(description)
    common.save_config(workdir, resolved=dataclasses.asdict(bc))
    for name in bc.workloads:  # unknown names fail before any compilation
        sb.make_lengths(name, 1, bc.max_len, np.random.RandomState(0))
    text = sb.prompt_text(None if description.startswith("random") else description, bc)
    t0 = time.perf_counter()
    sb.warm_engine(cfg, params, sb.engine_config(bc, "engine"), bc.max_len)
    slo = sb.derive_slo(cfg, params, bc)
    logging.info("SLO: TTFT <= %.3f s, TPOT <= %.4f s", slo.ttft_s, slo.tpot_s)
    results = {name: check_workload(cfg, params, bc, name, slo, text) for name in bc.workloads}
    command = "python -m experiments.sim_check " + " ".join(sys.argv[1:])
    with open(os.path.join(workdir, "sim_check.md"), "w") as f:
        f.write(markdown(bc, slo, results, command))
    common.write_results(workdir, sb._json_safe({
        "config": dataclasses.asdict(bc), "slo": dataclasses.asdict(slo),
        "tolerance": _TOLERANCE.value, "wall_s": time.perf_counter() - t0, "workloads": results,
    }))  # fmt: skip
    print(markdown(bc, slo, results, command))
    print(f"wrote {workdir}/results.json, sim_check.md")


if __name__ == "__main__":
    app.run(main)
