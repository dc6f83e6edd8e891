r"""Learned drafters against n-gram and plain decoding on one target: exactness, α per position,
τ, and batch-1 speedup measured interleaved.

    python -m experiments.drafter_bench --target=smollm2-135m \
        --heads=medusa=/tmp/drafters/medusa/head,eagle=/tmp/drafters/eagle/head \
        --workdir=/tmp/drafters/bench

Prompts are the first --prompt_len tokens of distinct windows of the held-out test split. At
T = 0 every drafter's output is checked token for token against plain greedy `ji.generate` (an
exactness failure is reported, never hidden). From the cycles' accepted-count histograms:
α_i = P(draft i accepted | drafts < i accepted), τ = mean tokens committed per cycle. Speed:
everything runs at batch 1 (one compilation per drafter, excluded), plain decoding and each
drafter alternated on every prompt; speedup = ratio of median wall times, with the 1-minute
load average recorded beside it.

Writes --workdir/results.json and prints a markdown table.
"""

from __future__ import annotations

import statistics
import time

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxinfer as ji
from experiments import common
from jaxinfer.speculative import heads

_TARGET = flags.DEFINE_string("target", "smollm2-135m", "Target model name or path.")
_HEADS = flags.DEFINE_list("heads", [], "NAME=PATH of trained heads (heads.save_head folders).")
_NGRAM = flags.DEFINE_boolean("ngram", True, "Include the n-gram drafter.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder.")
_NUM_PROMPTS = flags.DEFINE_integer(
    "num_prompts", 16, "Prompts for exactness and α.", lower_bound=1
)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Generated tokens.", lower_bound=1)
_GAMMA = flags.DEFINE_integer("gamma", 4, "Drafts per cycle.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 1, "Interleaved timing repeats.", lower_bound=1)
_CONFIG = common.config_flag()


def alpha_tau(outs, gamma: int) -> dict:
    """Pooled accepted-count histogram -> α per draft position and τ."""
    h = np.sum([o.accepted_histogram for o in outs], axis=0).astype(np.float64)  # [γ+1]
    reach = np.cumsum(h[::-1])[::-1]  # reach[i]: cycles that accepted >= i drafts
    alpha = [float(reach[i + 1] / reach[i]) if reach[i] else float("nan") for i in range(gamma)]
    cycles = h.sum()
    tau = float((np.arange(gamma + 1) * h).sum() / cycles + 1) if cycles else float("nan")
    return {"alpha": alpha, "tau": tau, "cycles": int(cycles), "histogram": h.astype(int).tolist()}


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required")
    common.save_config(_WORKDIR.value)
    cfg, params, path = common.load_model(_TARGET.value, dtype=jnp.float32)
    tok = ji.load_tokenizer(path)
    windows = common.test_windows(tok, cfg, max_tokens=10**7, seq_len=_PROMPT_LEN.value)
    step = max(len(windows) // _NUM_PROMPTS.value, 1)
    prompts = [windows[i * step, : _PROMPT_LEN.value].tolist() for i in range(_NUM_PROMPTS.value)]
    sp = ji.SamplingParams(temperature=0, max_tokens=_MAX_TOKENS.value)
    drafters = {"ngram": "ngram"} if _NGRAM.value else {}
    for item in _HEADS.value:
        name, _, hpath = item.partition("=")
        drafters[name] = heads.load_head(hpath, cfg)
    g = _GAMMA.value
    names = ["plain", *drafters]

    def one(n, p):
        if n == "plain":
            return ji.generate(cfg, params, [p], sp)[0]
        return ji.speculative.generate((cfg, params), drafters[n], [p], sp, gamma=g)[0]

    # Batch 1 throughout, so exactness, α and timing share one compilation per drafter: compile
    # on the first prompt (untimed), then every prompt with every drafter in turn, `repeats` times.
    for n in names:
        one(n, prompts[0])
    outs = {n: [] for n in names}
    wall = {n: [] for n in names}
    loads = []
    for rep in range(_REPEATS.value):
        for p in prompts:
            for n in names:
                t0 = time.perf_counter()
                o = one(n, p)
                wall[n].append(time.perf_counter() - t0)
                loads.append(common.load_average())
                if rep == 0:
                    outs[n].append(o)
    ref = [o.token_ids for o in outs["plain"]]
    base = statistics.median(wall["plain"])
    results = {"target": _TARGET.value, "gamma": g, "num_prompts": len(prompts),
               "prompt_len": _PROMPT_LEN.value, "max_tokens": _MAX_TOKENS.value,
               "repeats": _REPEATS.value, "plain_median_s": base,
               "load_average": {"min": min(loads), "max": max(loads)},
               "wall_s": wall, "drafters": {}}  # fmt: skip
    for n in drafters:
        same = sum(o.token_ids == r for o, r in zip(outs[n], ref))
        results["drafters"][n] = {
            "exact_prompts": same,
            "speedup_b1": base / statistics.median(wall[n]),
            **alpha_tau(outs[n], g),
        }
    common.write_results(_WORKDIR.value, results)
    print("| drafter | exact | α per position | τ | speedup b=1 |")
    print("|---|---|---|---|---|")
    for n, r in results["drafters"].items():
        a = ", ".join(f"{x:.2f}" for x in r["alpha"])
        s = f"{r['speedup_b1']:.2f}×" if "speedup_b1" in r else "—"
        print(f"| {n} | {r['exact_prompts']}/{len(prompts)} | {a} | {r['tau']:.2f} | {s} |")


if __name__ == "__main__":
    app.run(main)
