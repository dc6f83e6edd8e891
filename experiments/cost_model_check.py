r"""The engine's one-cycle cost model against measurement: predicted vs measured tokens/s per
(batch, γ) cell.

    python -m experiments.cost_model_check --model=target --batch_sizes=1,4,16 --gammas=0,1,2,4,6
    python -m experiments.cost_model_check --model=smollm2-135m --rounds=2

For every γ an engine with the n-gram drafter at that fixed γ serves, for every batch size B, B
greedy requests whose prompts repeat a phrase (so n-gram drafts are sometimes accepted):
  calibrate  one run fills the controller's step-time table t(γ, B) (draft + verify seconds of
             decode-only steps, the first sample of a shape dropped: it compiles) and the
             acceptance counters α_j, as `warm_up` and serving do;
  predict    B · E[tokens | γ, α] / t(γ, B), `GammaController`'s formula (γ = 0: B / t(0, B));
  measure    fresh requests of the same shape, batch after batch until --min_seconds of timed
             steps; committed tokens over the wall time of the decode-only, full-batch
             `Engine.step()` calls (the table times the same whole step), leaving out the steps
             in which a request ends (max_tokens cuts what that cycle accepted).
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
    "min_seconds", 0.5, "A cell's measurement serves fresh batches until its timed decode steps "
    "add up to this many seconds (a tiny model's 24-token run lasts ~40 ms: one descheduled "
    "time slice would be a third of it).", lower_bound=0.0,
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


def serve_timed(engine, reqs, n: int) -> tuple[int, float]:
    """(committed tokens, wall seconds) of the decode-only steps of serving `reqs` together."""
    sp = ji.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for p in reqs:
        engine.add_request(p, sp)
    tokens, seconds = 0, 0.0
    while engine.has_unfinished():
        decode = (
            bool(engine.scheduler.running)
            and not engine.scheduler.waiting
            and all(not s.in_prefill for s in engine.scheduler.running)
        )
        full = len(engine.scheduler.running) == len(reqs)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        # The batch the cell names, all decoding; not a step where a request ended (max_tokens
        # cut its last cycle's accepted tokens, which the model's full cycles do not have).
        if decode and full and not any(o.finished for o in outs):
            tokens += sum(len(o.new_token_ids) for o in outs)
            seconds += dt
    return tokens, seconds


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
    seed = 0
    results = {(b, g): [] for b in bs for g in gammas}
    loads = []
    for g in gammas:  # one engine at a time (module docstring)
        spec = ji.SpeculativeConfig(drafter="ngram", num_speculative_tokens=g, max_gamma=gmax)
        e = ji.Engine(cfg, params, ji.EngineConfig(**ecfg, speculative=spec))
        for b in bs:  # calibrate: compiles, fills t(γ, B) and α
            for _ in range(2):
                seed += 1
                serve_timed(e, prompts(cfg.vocab_size, b, seed), n)
        for _ in range(_ROUNDS.value):
            for b in bs:
                ctl = e.controller
                t = ctl.step_time(g, b)
                pred = b * ctl.expected_tokens(g) / t if t else float("nan")
                tokens, seconds = 0, 0.0
                while seconds <= _MIN_SECONDS.value:
                    seed += 1
                    k, dt = serve_timed(e, prompts(cfg.vocab_size, b, seed), n)
                    tokens, seconds = tokens + k, seconds + dt
                    if dt == 0.0:  # no full decode-only step: more batches cannot help
                        break
                meas = tokens / seconds if seconds else float("nan")
                results[(b, g)].append((pred, meas))
            loads.append(os.getloadavg()[0])
        del e
        jax.clear_caches()  # this γ's compiled programs go before the next γ's compile
    print(
        f"model={_MODEL.value} new_tokens={n} rounds={_ROUNDS.value} "
        f"load1={min(loads):.2f}-{max(loads):.2f}"
    )
    print("| batch | γ | predicted tok/s | measured tok/s | error (median) | error spread |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    cells = []
    for (b, g), rows in results.items():
        errs = [p / m - 1 for p, m in rows]
        med = statistics.median(errs)
        worst = max(worst, abs(med))
        cells.append({"batch": b, "gamma": g, "predicted_measured": rows, "median_error": med})
        print(
            f"| {b} | {g} | {statistics.median(p for p, _ in rows):.1f} | "
            f"{statistics.median(m for _, m in rows):.1f} | {100 * med:+.1f}% | "
            f"{100 * min(errs):+.1f}% .. {100 * max(errs):+.1f}% |"
        )
    print(f"largest |median error|: {100 * worst:.1f}%")
    common.write_results(
        _WORKDIR.value,
        {"model": _MODEL.value, "new_tokens": n, "rounds": _ROUNDS.value, "load1": loads,
         "cells": cells, "largest_median_error": worst},
    )  # fmt: skip


if __name__ == "__main__":
    app.run(main)
