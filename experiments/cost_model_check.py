r"""The engine's one-cycle cost model against measurement: predicted vs measured tokens/s per
(batch, γ) cell.

    python -m experiments.cost_model_check --model=target --batch_sizes=1,4,16 --gammas=0,1,2,4,6
    python -m experiments.cost_model_check --model=smollm2-135m --rounds=2

The workload is one fixed set of --num_prompts greedy requests whose prompts repeat a phrase (so
n-gram drafts are sometimes accepted), served at a concurrency of B: a request joins as soon as
one finishes, so requests at every stage of their output share the steps, as in serving. For
every γ an engine with the n-gram drafter at that fixed γ:
  calibrate  serves the set --calibration_passes times at every B: fills the controller's
             step-time table t(γ, B) (whole decode-only steps in which every row drafts γ; a
             shape's first sample is dropped: it compiles) and the acceptance counters α_j, as
             `warm_up` and serving do;
  predict    B · E[tokens | γ, α] / t(γ, B), `GammaController`'s formula (γ = 0: B / t(0, B));
  measure    the same set again (again, until --min_seconds of timed steps); committed tokens
             over the wall time of the `Engine.step()` calls the table times too: decode-only,
             B rows each drafting γ; and none in which a request ends (max_tokens cuts what
             that cycle accepted).
The prediction's inputs come from the log of the workload it predicts (the issue's "acceptance
from the log"). Until 2026-12-06 every cell drew B fresh prompts and served them together:
a test of how alike two draws of a few prompts are (on SmolLM2 one prompt's drafts are accepted
almost always and the next one's almost never, and a B = 1 cell served one request), and of
the first steps of requests only (a step counted only while all B ran; acceptance changes
along a request's output, and the controller's recent α saw the last steps of the last batch).
The table splits each error into its factors: the step time (table median against the cell's
mean step) and tokens per row per step (chain model against the cell's).

One γ at a time: its engine calibrates, then its cells are visited once per round over --rounds
interleaved rounds (over B), then the engine and every compiled program are released before
the next γ. (All γ engines at once, rounds interleaved over γ too, aborted twice on SmolLM2 with
"LLVM ERROR: Unable to allocate section memory": five engines' programs for every batch and T
bucket of a 30-layer model.) Each cell's prediction and measurement are thus minutes apart at
most. The table gives the median error and its min-max spread, with the 1-minute load average.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import numpy as np
from absl import app, flags

import jaxinfer as ji
from experiments import common

_MODEL = flags.DEFINE_string("model", "target", "'tiny', a packaged model name or a path.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "Decoding requests per step.")
_GAMMAS = flags.DEFINE_list("gammas", ["0", "1", "2", "4", "6"], "Fixed γ per cell.")
_NEW = flags.DEFINE_integer("new_tokens", 24, "Tokens per request.", lower_bound=4)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved rounds.", lower_bound=1)
_MIN_SECONDS = flags.DEFINE_float(
    "min_seconds", 0.5, "A cell's measurement serves the prompt set again until its timed decode "
    "steps add up to this many seconds (a tiny model's 24-token run lasts ~40 ms: one "
    "descheduled time slice would be a third of it).", lower_bound=0.0,
)  # fmt: skip
_NUM_PROMPTS = flags.DEFINE_integer(
    "num_prompts", 32, "Requests in the workload (at least twice every batch size).",
    lower_bound=1,
)  # fmt: skip
_CAL_PASSES = flags.DEFINE_integer(
    "calibration_passes", 1, "Passes over the prompt set at every B before the rounds.",
    lower_bound=1,
)  # fmt: skip
_WORKDIR = flags.DEFINE_string("workdir", "runs/cost_model_check", "Where results.json goes.")
_CONFIG = common.config_flag()


def load(name: str):
    """(cfg, params): 'tiny' (random), a packaged model name, or a checkpoint path."""
    if name == "tiny":
        cfg = ji.preset("tiny-llama").replace(eos_token_id=None)
        return cfg, ji.init_params(cfg, jax.random.key(0))
    return ji.load_checkpoint(ji.models.path(name) if name in ji.models.names() else name)


def prompts(vocab: int, b: int, seed: int) -> list[list[int]]:
    """b prompts, each a random 6-token phrase repeated 5 times then 3 random tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(b):
        phrase = rng.integers(3, vocab, 6).tolist()
        out.append(phrase * 5 + rng.integers(3, vocab, 3).tolist())
    return out


def serve_set(engine, reqs, b: int, n: int, gamma: int) -> tuple[int, float, int]:
    """Serves `reqs` at a concurrency of b (a request joins as soon as one finishes, as in
    serving: requests at every stage of their output share a step) -> (committed tokens, wall
    seconds, steps) of the timed steps: decode-only, b rows each drafting `gamma` (none cut short
    near max_tokens), no request ending (max_tokens cut that cycle's accepted tokens). The
    controller's table times the same steps (`cycles.account`)."""
    sp = ji.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    queue, live = list(reqs), set()
    tokens, seconds, steps = 0, 0.0, 0
    while queue or engine.has_unfinished():
        while queue and len(live) < b:
            live.add(engine.add_request(queue.pop(0), sp))
        decode = (
            len(engine.scheduler.running) == b
            and not engine.scheduler.waiting
            and all(not s.in_prefill for s in engine.scheduler.running)
        )
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        drafted = all(s.num_lookahead == gamma for s in engine.last_schedule.seqs)
        if decode and drafted and not any(o.finished for o in outs):
            tokens += sum(len(o.new_token_ids) for o in outs)
            seconds += dt
            steps += 1
        live -= {o.request_id for o in outs if o.request_finished}
    return tokens, seconds, steps


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    try:
        bs = [int(b) for b in _BATCH_SIZES.value]
        gammas = [int(g) for g in _GAMMAS.value]
    except ValueError as e:
        raise app.UsageError(f"--batch_sizes / --gammas: {e}") from None
    if not bs or not gammas or min(bs) < 1 or min(gammas) < 0:
        raise app.UsageError(f"--batch_sizes >= 1 and --gammas >= 0, got {bs} and {gammas}")
    if _NUM_PROMPTS.value < 2 * max(bs):
        raise app.UsageError(
            f"--num_prompts={_NUM_PROMPTS.value} must be at least twice every batch size {bs}"
        )
    common.save_config(_WORKDIR.value)
    cfg, params = load(_MODEL.value)
    n = _NEW.value
    gmax = max(max(gammas), 1)
    ecfg = dict(
        block_size=16,
        num_blocks=max(bs) * (-(-(33 + n + gmax + 1) // 16) + 1) + 2,
        max_num_seqs=max(bs),
        max_num_batched_tokens=max(512, max(bs) * (gmax + 1)),
        enable_prefix_caching=False,  # every run recomputes its prompts: same shapes each time
        min_seq_bucket=1,
    )
    reqs = prompts(cfg.vocab_size, _NUM_PROMPTS.value, seed=0)
    results = {(b, g): [] for b in bs for g in gammas}
    parts = {(b, g): [] for b in bs for g in gammas}
    loads = []
    for g in gammas:  # one engine at a time (module docstring)
        spec = ji.SpeculativeConfig(drafter="ngram", num_speculative_tokens=g, max_gamma=gmax)
        e = ji.Engine(cfg, params, ji.EngineConfig(**ecfg, speculative=spec))
        for b in bs:  # calibrate: compiles, fills t(γ, B) and α
            for _ in range(_CAL_PASSES.value):
                serve_set(e, reqs, b, n, g)
        for _ in range(_ROUNDS.value):
            for b in bs:
                ctl = e.controller
                t = ctl.step_time(g, b)
                per_row = ctl.expected_tokens(g)
                pred = b * per_row / t if t else float("nan")
                tokens, seconds, steps = 0, 0.0, 0
                while seconds <= _MIN_SECONDS.value:
                    k, dt, m = serve_set(e, reqs, b, n, g)
                    tokens, seconds, steps = tokens + k, seconds + dt, steps + m
                    if dt == 0.0:  # no full decode-only step: more passes cannot help
                        break
                meas = tokens / seconds if seconds else float("nan")
                results[(b, g)].append((pred, meas))
                # The error's two factors: step time (table median against the cell's mean
                # step) and tokens per row per step (chain model against the cell's).
                parts[(b, g)].append(
                    (
                        t or float("nan"),
                        seconds / max(steps, 1),
                        per_row,
                        tokens / max(steps * b, 1),
                    )
                )
            loads.append(os.getloadavg()[0])
        del e
        jax.clear_caches()  # this γ's compiled programs go before the next γ's compile
    print(
        f"model={_MODEL.value} new_tokens={n} rounds={_ROUNDS.value} "
        f"load1={min(loads):.2f}-{max(loads):.2f}"
    )
    print(
        "| batch | γ | predicted tok/s | measured tok/s | error (median) | error spread "
        "| step ms, table / measured | tokens per row-step, model / measured |"
    )
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    cells = []
    for (b, g), rows in results.items():
        errs = [p / m - 1 for p, m in rows]
        med = statistics.median(errs)
        worst = max(worst, abs(med))
        tp, tm, kp, km = (statistics.median(x) for x in zip(*parts[(b, g)]))
        cells.append({
            "batch": b, "gamma": g, "predicted_measured": rows, "median_error": med,
            "step_s_table_measured_tokens_model_measured": parts[(b, g)],
        })  # fmt: skip
        print(
            f"| {b} | {g} | {statistics.median(p for p, _ in rows):.1f} | "
            f"{statistics.median(m for _, m in rows):.1f} | {100 * med:+.1f}% | "
            f"{100 * min(errs):+.1f}% .. {100 * max(errs):+.1f}% | "
            f"{1e3 * tp:.1f} / {1e3 * tm:.1f} | {kp:.2f} / {km:.2f} |"
        )
    print(f"largest |median error|: {100 * worst:.1f}%")
    common.write_results(
        _WORKDIR.value,
        {"model": _MODEL.value, "new_tokens": n, "rounds": _ROUNDS.value, "load1": loads,
         "num_prompts": _NUM_PROMPTS.value, "calibration_passes": _CAL_PASSES.value,
         "cells": cells, "largest_median_error": worst},
    )  # fmt: skip


if __name__ == "__main__":
    app.run(main)
