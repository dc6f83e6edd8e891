r"""Learned drafters against n-gram and plain decoding on one target: exactness, α per position,
τ, draft cost, and speedup at batch 1 and 8 measured interleaved, beside the cost model's
prediction.

    python -m experiments.drafter_bench --target=smollm2-135m \
        --heads=medusa=/tmp/drafters/medusa/head,eagle=smollm2-135m-eagle \
        --drafts=distilled=/tmp/drafters/draft/draft --workdir=/tmp/drafters/bench
    python -m experiments.drafter_bench --heads=eagle=smollm2-135m-eagle --keep_quantized \
        --temperatures=0 --batch_sizes=1 --workdir=/tmp/drafters/bench_gguf   # Q4_1 as stored
    python -m experiments.drafter_bench --heads=eagle=smollm2-135m-eagle --ngram_first=2 \
        --keep_quantized --temperatures=0 --batch_sizes=1 --workdir=/tmp/drafters/hybrid

Two prompt sets: `test`, the first --prompt_len tokens of distinct windows of the held-out test
split, and `chat`, one-turn user questions (`common.CHAT_PROMPTS`) through the target's chat
template (skipped for a target without one). Per temperature (--temperatures; T > 0 samples
with per-prompt seeds and --acceptance):

- **Exactness** (T = 0): every drafter's output, token for token, against plain greedy
  `ji.generate`, on both sets, at batch 1 and in batches of 8 (a failure is reported, never
  hidden).
- **α and τ** from the cycles' accepted-count histograms: α_i = P(draft i accepted | drafts < i
  accepted), τ = mean tokens committed per cycle, per set.
- **Speed** on the test set (one prompt length, so one compilation per drafter and batch size,
  excluded): plain decoding and each drafter alternated on every batch, --repeats times;
  speedup = ratio of median wall times (prefill included), with the 1-minute load average.
- **Cost** from one host-driven logged run per drafter and batch size (`generate_with_log`):
  draft ms per cycle as a fraction of a plain decode step (t_plain = (wall at max_tokens − wall
  at 1 token) / (max_tokens − 1), medians of plain `ji.generate`'s walls in the interleaved
  rotation, where a 1-token plain run precedes every batch), and the one-cycle cost
  model's decode speedup (`autotune.summarize_log`) turned into an end-to-end prediction:
  (t_1 + n·t_plain) / (t_1 + n·t_plain / s_decode), t_1 the 1-token wall, n = max_tokens − 1.

Writes --workdir/results.json and prints markdown tables.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer.speculative import heads
from jaxinfer.speculative.autotune import summarize_log
from jaxinfer.speculative.cycle_log import generate_with_log

_TARGET = flags.DEFINE_string("target", "smollm2-135m", "Target model name or path.")
_HEADS = flags.DEFINE_list(
    "heads", [], "NAME=PATH of trained heads (heads.save_head folders or ji.models names)."
)
_DRAFTS = flags.DEFINE_list(
    "drafts", [], "NAME=PATH of draft models (HF checkpoint dirs or ji.models names), e.g. the "
    "distilled draft of `train_drafter --kind=draft`."
)  # fmt: skip
_NGRAM = flags.DEFINE_boolean("ngram", True, "Include the n-gram drafter.")
_NGRAM_FIRST = flags.DEFINE_list(
    "ngram_first",
    [],
    "For each N and each --heads entry NAME, also the hybrid NAME+ngramN "
    "(`Head.ngram_first=N`: the n-gram's proposal where N+ tokens of suffix recur).",
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder.")
_NUM_PROMPTS = flags.DEFINE_integer(
    "num_prompts", 16, "Test-split prompts (exactness, α, timing).", lower_bound=1
)
_NUM_CHAT = flags.DEFINE_integer(
    "num_chat", 8, "Chat prompts (exactness and α; 0: none).", lower_bound=0
)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Test-split prompt tokens.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Generated tokens.", lower_bound=2)
_GAMMA = flags.DEFINE_integer("gamma", 4, "Drafts per cycle.", lower_bound=1)
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0", "0.8"], "Sampling temperatures.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes timed.")
_ACCEPTANCE = flags.DEFINE_enum(
    "acceptance", "rejection", ["rejection", "coupled"], "Acceptance at T > 0."
)
_REPEATS = flags.DEFINE_integer("repeats", 1, "Interleaved timing repeats.", lower_bound=1)
_KEEP_QUANTIZED = flags.DEFINE_boolean(
    "keep_quantized", False, "A GGUF target keeps its Q4_0 / Q4_1 / Q8_0 tensors as stored "
    "(`ji.load_checkpoint(keep_quantized=True)`); plain decoding reads the same weights.",
)  # fmt: skip
_CONFIG = common.config_flag()
flag_checks.int_list(_NGRAM_FIRST, min_value=1, allow_empty=True)


def alpha_tau(outs, gamma: int) -> dict:
    """Pooled accepted-count histogram -> α per draft position and τ."""
    h = np.sum([o.accepted_histogram for o in outs], axis=0).astype(np.float64)  # [γ+1]
    reach = np.cumsum(h[::-1])[::-1]  # reach[i]: cycles that accepted >= i drafts
    alpha = [float(reach[i + 1] / reach[i]) if reach[i] else float("nan") for i in range(gamma)]
    cycles = h.sum()
    tau = float((np.arange(gamma + 1) * h).sum() / cycles + 1) if cycles else float("nan")
    return {"alpha": alpha, "tau": tau, "cycles": int(cycles), "histogram": h.astype(int).tolist()}


def _numbers(values: list[str], kind, name: str) -> list:
    try:
        out = [kind(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{name}={','.join(values)}: expected a list of numbers") from None
    if not out or any(v < 0 for v in out) or (kind is int and any(v < 1 for v in out)):
        raise app.UsageError(f"--{name}={','.join(values)}: expected positive values")
    return out


def _load_drafter(item: str, cfg, flag: str):
    """A --heads entry -> (name, Head), a --drafts entry -> (name, (dcfg, dparams))."""
    name, sep, where = item.partition("=")
    if not sep or not name or not where:
        raise app.UsageError(f"--{flag} entry {item!r}: expected NAME=PATH")
    where = common.resolve_model(where)  # a ji.models name or an existing path
    if flag == "heads":
        return name, heads.load_head(where, cfg)
    dcfg, dparams = ji.load_checkpoint(where, dtype=jnp.float32)
    if dcfg.vocab_size != cfg.vocab_size:
        raise app.UsageError(
            f"--drafts {name}: vocabulary {dcfg.vocab_size} differs from the target's "
            f"{cfg.vocab_size}"
        )
    return name, (dcfg, dparams)


def _batches(prompts: list, b: int) -> list[list]:
    """Consecutive groups of b prompts (a short last group is dropped, unless it is the only)."""
    groups = [prompts[i : i + b] for i in range(0, len(prompts), b)]
    return [g for g in groups if len(g) == b] or groups[:1]


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required")
    temps = _numbers(_TEMPERATURES.value, float, "temperatures")
    sizes = _numbers(_BATCH_SIZES.value, int, "batch_sizes")
    common.save_config(_WORKDIR.value)
    kw = {"keep_quantized": True} if _KEEP_QUANTIZED.value else {}
    cfg, params, path = common.load_model(_TARGET.value, dtype=jnp.float32, **kw)
    tok = ji.load_tokenizer(path)
    windows = common.test_windows(tok, cfg, max_tokens=10**7, seq_len=_PROMPT_LEN.value)
    step = max(len(windows) // _NUM_PROMPTS.value, 1)
    sets = {"test": [windows[i * step, : _PROMPT_LEN.value].tolist()
                     for i in range(_NUM_PROMPTS.value)]}  # fmt: skip
    if _NUM_CHAT.value and getattr(tok, "chat_template", None):
        qs = (common.CHAT_PROMPTS * _NUM_CHAT.value)[: _NUM_CHAT.value]
        sets["chat"] = [ids for _, ids in common.chat_prompts(tok, qs)]
    drafters = {"ngram": "ngram"} if _NGRAM.value else {}
    drafters.update(_load_drafter(item, cfg, "heads") for item in _HEADS.value)
    loaded = [name for name, d in drafters.items() if isinstance(d, heads.Head)]
    for first in (int(x) for x in _NGRAM_FIRST.value):
        drafters.update({f"{name}+ngram{first}": dataclasses.replace(drafters[name],
                         ngram_first=first) for name in loaded})  # fmt: skip
    drafters.update(_load_drafter(item, cfg, "drafts") for item in _DRAFTS.value)
    g, n_tok = _GAMMA.value, _MAX_TOKENS.value
    names = ["plain", *drafters]

    def sampling(temp: float, k: int, max_tokens: int = n_tok) -> list[ji.SamplingParams]:
        return [ji.SamplingParams(temperature=temp, max_tokens=max_tokens, seed=1000 + i)
                for i in range(k)]  # fmt: skip

    def run(n: str, batch: list, temp: float, first: int = 0):
        sps = sampling(temp, first + len(batch))[first:]
        if n == "plain":
            return ji.generate(cfg, params, batch, sps)
        return ji.speculative.generate(
            (cfg, params), drafters[n], batch, sps, gamma=g, acceptance=_ACCEPTANCE.value
        )

    results = {"target": _TARGET.value, "keep_quantized": _KEEP_QUANTIZED.value, "gamma": g,
               "acceptance": _ACCEPTANCE.value,
               "prompt_len": _PROMPT_LEN.value, "max_tokens": n_tok, "repeats": _REPEATS.value,
               "sets": {k: len(v) for k, v in sets.items()}, "by_temperature": {}}  # fmt: skip
    for temp in temps:
        res = {"quality": {}, "speed": {}}
        # Outputs by (drafter, set, batch size): exactness and α / τ. Chat prompts differ in
        # length, so they run at batch 1 and 8 untimed.
        outs = {}
        for set_name, prompts in sets.items():
            for b in sizes:
                for n in names:
                    got = []
                    for i in range(0, len(prompts), b):
                        got += run(n, prompts[i : i + b], temp, first=i)
                    outs[n, set_name, b] = got
        for n in drafters:
            res["quality"][n] = {}
            for set_name in sets:
                cell = alpha_tau(outs[n, set_name, sizes[0]], g)
                if temp == 0:
                    cell["exact"] = {
                        str(b): [sum(o.token_ids == r.token_ids for o, r in
                                     zip(outs[n, set_name, b], outs["plain", set_name, b])),
                                 len(sets[set_name])]
                        for b in sizes
                    }  # fmt: skip
                res["quality"][n][set_name] = cell
        # Timing on the test set, interleaved; then the per-cycle cost from one logged run.
        for b in sizes:
            groups = _batches(sets["test"], b)
            wall = {n: [] for n in names}
            first_wall = []  # plain decoding of one token, in the same rotation: t_1
            loads = []
            for _ in range(_REPEATS.value):
                for grp in groups:
                    t0 = time.perf_counter()
                    ji.generate(cfg, params, grp, sampling(temp, len(grp), max_tokens=1))
                    first_wall.append(time.perf_counter() - t0)
                    for n in names:
                        t0 = time.perf_counter()
                        run(n, grp, temp)
                        wall[n].append(time.perf_counter() - t0)
                        loads.append(common.load_average())
            full = sampling(temp, len(groups[0]))
            # The plain decode step, (wall at n − wall at 1) / (n − 1), from the interleaved
            # walls: a slow spell after the timed loop cannot skew it.
            base, t1 = statistics.median(wall["plain"]), statistics.median(first_wall)
            t_plain = (base - t1) / (n_tok - 1)
            cell = {"plain_median_s": base, "t_plain_ms": 1000 * t_plain, "t_first_s": t1,
                    "load_average": [min(loads), max(loads)], "wall_s": wall,
                    "first_token_wall_s": first_wall,
                    "drafters": {}}  # fmt: skip
            for n in drafters:
                _, records = generate_with_log(
                    (cfg, params), drafters[n], groups[0], full, gamma=g,
                    acceptance=_ACCEPTANCE.value,
                )  # fmt: skip
                model = summarize_log(records, t_plain)
                s_dec = model["predicted_speedup"]
                dec = n_tok - 1
                cell["drafters"][n] = {
                    "speedup": base / statistics.median(wall[n]),
                    "predicted_decode_speedup": s_dec,
                    "predicted_speedup": (t1 + dec * t_plain) / (t1 + dec * t_plain / s_dec),
                    "draft_ms": model["draft_ms"],
                    "verify_ms": model["verify_ms"],
                    "draft_cost_steps": model["draft_ms"] / (1000 * t_plain),
                    "verify_cost_steps": model["verify_ms"] / (1000 * t_plain),
                }
            res["speed"][str(b)] = cell
        results["by_temperature"][str(temp)] = res
    common.write_results(_WORKDIR.value, results)
    _print(results, sizes)


def _print(results: dict, sizes: list[int]) -> None:
    for temp, res in results["by_temperature"].items():
        print(f"\nT = {temp}, γ = {results['gamma']}, {results['acceptance']} acceptance")
        heads_ = " | ".join(f"speedup b={b} (pred)" for b in sizes)
        print(f"| drafter | set | exact | α per position | τ | draft / verify cost (steps, "
              f"b={sizes[0]}) | {heads_} |")  # fmt: skip
        print("|---|---|---|---|---|---|" + "---|" * len(sizes))
        for n, by_set in res["quality"].items():
            for set_name, q in by_set.items():
                a = ", ".join(common.fmt(x, 2) for x in q["alpha"])
                ex = " ".join(f"{v[0]}/{v[1]}" for v in q.get("exact", {}).values()) or "—"
                cost = speeds = "—"
                if set_name == "test":
                    d = res["speed"][str(sizes[0])]["drafters"][n]
                    cost = f"{d['draft_cost_steps']:.2f} / {d['verify_cost_steps']:.2f}"
                    speeds = " | ".join(
                        "{:.2f}× ({:.2f}×)".format(
                            res["speed"][str(b)]["drafters"][n]["speedup"],
                            res["speed"][str(b)]["drafters"][n]["predicted_speedup"],
                        )
                        for b in sizes
                    )
                else:
                    speeds = " | ".join("—" for _ in sizes)
                print(f"| {n} | {set_name} | {ex} | {a} | {q['tau']:.2f} | {cost} | {speeds} |")


if __name__ == "__main__":
    app.run(main)
