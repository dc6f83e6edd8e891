r"""Speculative decoding benchmark: α, tokens per cycle, tokens/s and speedups, measured and
predicted, against plain `ji.generate` and transformers (plain, assisted, prompt lookup).

    python -m experiments.spec_bench --workdir=runs/spec_bench            # ~10 min on 2 CPU cores
    python -m experiments.spec_bench --workdir=runs/spec_quick --quick    # ~1-2 min
    python -m experiments.spec_bench --workdir=/tmp/s --drafters=ngram --gammas=2,4 --batch_sizes=8

Models: the shipped target and draft (`ji.models`), or randomly initialised models of the same
shapes with a printed warning when they are absent. Prompts: windows of --prompt_len tokens from
the shipped test split, tokenized with the shipped tokenizer. Every run generates --max_tokens
tokens per sequence (ignore_eos), so all rows do the same work.

What is measured, for each drafter (draft model, n-gram), temperature, acceptance mode, batch
size and γ (temperature 0 is greedy, where both acceptance modes coincide: one "greedy" row):
  * α per draft position and tokens per cycle, from the fused run's per-sequence histograms of
    accepted drafts (`estimate_alpha`);
  * tokens/s of the fused loop (compiled), end to end and decode only: runs of max_tokens and
    max_tokens/2 share the prefill, their difference is the time of max_tokens/2 decode steps.
    Every cell (plain and speculative) is timed once per round over --repeats interleaved rounds
    after a warm-up pass; the table gives medians with the min-max spread, so a busy machine
    shows as a wide spread instead of a wrong ratio;
  * the measured speedup: the median over rounds of plain `ji.generate` decode time /
    speculative decode time in the same round, same batch and temperature (and end to end);
  * achieved weight GB/s: weight bytes read per decode step (target; + γ draft reads per cycle
    for the model drafter) over its time;
  * the prediction of the speedup model: α of the largest-γ run of the same setting, the draft
    step time and verify cost line t(n) = a + b·n fitted on cycle logs (`generate_with_log`) at
    the smallest and largest γ, and the plain decode step time.
Transformers (eager PyTorch, CPU): plain `generate` at every batch size and temperature; assisted
generation with the same draft checkpoint and prompt-lookup decoding at batch 1 (transformers'
own γ schedule for the assistant). Writes into --workdir: config.json, results.json, table.md,
acceptance_by_position.png, speedup_predicted_vs_measured.png and the cycle logs (JSONL).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags, logging
from tqdm import tqdm

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer import data
from jaxinfer.memory import tree_bytes
from jaxinfer.speculative import (
    complete_alpha,
    estimate_alpha,
    expected_tokens_per_cycle,
    fit_costs,
    generate_with_log,
    pooled_alpha,
    speedup,
    summarize_log,
    write_cycle_log,
)

_WORKDIR = flags.DEFINE_string("workdir", "runs/spec_bench", "Output directory.")
_CONFIG = common.config_flag()
_QUICK = flags.DEFINE_bool(
    "quick", False, "A ~1-2 minute subset: batch 1, γ {2, 4}, 32 tokens, 2 repeats."
)
_TARGET = flags.DEFINE_string("target", None, "Target HF dir; default: the shipped target.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft HF dir; default: the shipped draft.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0", "0.8"], "Sampling temperatures.")
_GAMMAS = flags.DEFINE_list(
    "gammas", ["1", "2", "3", "4", "6", "8"], "Drafted tokens per cycle; 'auto' (autotune) too."
)
_AUTO = flags.DEFINE_bool(
    "auto", False, "Also run gamma='auto' (the speedup model's choice, calibration included)."
)
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
_DRAFTERS = flags.DEFINE_list("drafters", ["model", "ngram"], "Drafters: model, ngram.")
_ACCEPTANCE = flags.DEFINE_list("acceptance", ["rejection", "coupled"], "Acceptance modes.")
_MAX_TOKENS = flags.DEFINE_integer(
    "max_tokens", 64, "Generated tokens per sequence.", lower_bound=2
)
_PROMPT_LEN = flags.DEFINE_list("prompt_len", ["64", "128"], "Prompt window length range.")
_REPEATS = flags.DEFINE_integer(
    "repeats", 2, "Timed runs after the warm-up (best kept).", lower_bound=1
)
_TRANSFORMERS = flags.DEFINE_bool("transformers", True, "Also time transformers baselines.")
_SEED = flags.DEFINE_integer("seed", 0, "Prompt selection and sampling seeds.", lower_bound=0)
DRAFTERS = ("model", "ngram")
flag_checks.float_list(_TEMPERATURES, min_value=0.0)
flag_checks.int_list(_GAMMAS, min_value=1)
flag_checks.int_list(_BATCH_SIZES, min_value=1)
flag_checks.choice_list(_DRAFTERS, DRAFTERS)
flag_checks.choice_list(_ACCEPTANCE, ji.speculative.ACCEPTANCE_MODES)
flag_checks.int_list(_PROMPT_LEN, min_value=1, length=2)
flags.register_validator(
    "prompt_len",
    lambda v: len(v) != 2 or not all(x.isdigit() for x in v) or int(v[0]) <= int(v[1]),
    "--prompt_len=LO,HI needs LO <= HI",
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """The resolved settings of a run (written to config.json)."""

    temperatures: tuple[float, ...]
    gammas: tuple[int, ...]
    auto: bool  # also a gamma="auto" cell per setting (its calibration run is timed with it)
    batch_sizes: tuple[int, ...]
    drafters: tuple[str, ...]  # "model" (the draft checkpoint) and / or "ngram"
    acceptance: tuple[str, ...]
    max_tokens: int
    prompt_len: tuple[int, int]  # window lengths drawn uniformly in [lo, hi]
    repeats: (
        int  # timing: median of `repeats` interleaved rounds after one warm-up (shared machine)
    )
    transformers: bool
    seed: int
    quick: bool


def _resolve() -> BenchConfig:
    quick = _QUICK.value

    def pick(flag, parse, quick_value):
        values = tuple(parse(x) for x in flag.value)
        return quick_value if quick and not flag.present else values

    lo, hi = (int(x) for x in _PROMPT_LEN.value)
    return BenchConfig(
        temperatures=tuple(float(t) for t in _TEMPERATURES.value),
        gammas=pick(_GAMMAS, int, (2, 4)),
        auto=_AUTO.value,
        batch_sizes=pick(_BATCH_SIZES, int, (1,)),
        drafters=tuple(_DRAFTERS.value),
        acceptance=tuple(_ACCEPTANCE.value),
        max_tokens=32 if quick and not _MAX_TOKENS.present else _MAX_TOKENS.value,
        prompt_len=(lo, hi),
        repeats=2 if quick and not _REPEATS.present else _REPEATS.value,
        transformers=_TRANSFORMERS.value,
        seed=_SEED.value,
        quick=quick,
    )


def _load_models():
    """(target, draft, target_dir, draft_dir, note): shipped models, else random ones saved."""
    target_dir = _TARGET.value or ("target" in ji.models.names() and ji.models.path("target"))
    draft_dir = _DRAFT.value or ("draft" in ji.models.names() and ji.models.path("draft"))
    if target_dir and draft_dir:
        return (
            ji.load_checkpoint(target_dir),
            ji.load_checkpoint(draft_dir),
            target_dir,
            draft_dir,
            "",
        )
    from experiments.configs import get_config

    note = (
        "WARNING: no shipped target/draft models; benchmarking RANDOMLY INITIALISED models of the "
        "shipped shapes: acceptance rates and speedups say nothing about trained models."
    )
    print(note)
    root = tempfile.mkdtemp(prefix="spec_bench_models_")
    dirs = []
    for i, name in enumerate(("target", "draft")):
        cfg = get_config(name).model
        path = os.path.join(root, name)
        ji.save_checkpoint(path, cfg, ji.init_params(cfg, jax.random.key(i), std=0.02))
        dirs.append(path)
    return ji.load_checkpoint(dirs[0]), ji.load_checkpoint(dirs[1]), dirs[0], dirs[1], note


def _prompts(bc: BenchConfig, n: int) -> list[list[int]]:
    """`n` windows of the shipped test split, lengths in bc.prompt_len, from distinct documents."""
    tok = data.load_tokenizer()
    docs = data.load_split("test")
    rng = np.random.RandomState(bc.seed)
    lo, hi = bc.prompt_len
    out = []
    for d in rng.permutation(len(docs)):
        ids = tok.encode(docs[d], add_special_tokens=False).ids
        length = int(rng.randint(lo, hi + 1))
        if len(ids) < length:
            continue
        start = int(rng.randint(0, len(ids) - length + 1))
        out.append([data.BOS_ID] * (start == 0) + ids[start : start + length - (start == 0)])
        if len(out) == n:
            return out
    raise ValueError(f"the test split has fewer than {n} documents of >= {lo} tokens")


def _median_time(repeats: int, fn, *args, **kwargs) -> float:
    """Median wall seconds of `repeats` calls of fn after a warm-up call."""
    fn(*args, **kwargs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _sampling(bc: BenchConfig, b: int, temperature: float, max_tokens: int):
    return [
        ji.SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            ignore_eos=True,
            seed=bc.seed + i,
        )  # fmt: skip
        for i in range(b)
    ]


def _interleaved(bc: BenchConfig, cells: dict) -> dict:
    """Times every cell `key -> (run, batch, temperature)` at max_tokens and at half of it, in
    --repeats rounds that each visit every cell once (a busy spell of the shared machine then
    hits every cell alike), after one warm-up pass that compiles.

    A round's full and half runs share the prefill and every fixed cost, so their difference is
    the decode of the second half: step_s = (t_full − t_half) / (max_tokens − half), seconds per
    decode step (None in a round where noise makes the difference non-positive). Each cell keeps
    its rounds (`round_step_s`) and their median, with the min-max spread of tok/s.
    """
    half = bc.max_tokens // 2
    outs = {}
    for key, (run, b, temp) in cells.items():  # warm-up: compiles both lengths
        outs[key] = run(_sampling(bc, b, temp, bc.max_tokens))
        run(_sampling(bc, b, temp, half))
    times = {key: [] for key in cells}
    for _ in tqdm(range(bc.repeats), desc="rounds", file=sys.stdout):
        for key, (run, b, temp) in cells.items():
            t0 = time.perf_counter()
            run(_sampling(bc, b, temp, bc.max_tokens))
            t1 = time.perf_counter()
            run(_sampling(bc, b, temp, half))
            times[key].append((t1 - t0, time.perf_counter() - t1))
    res = {}
    for key, (_, b, _) in cells.items():
        full = [t for t, _ in times[key]]
        steps = [(t - h) / (bc.max_tokens - half) if t > h else None for t, h in times[key]]
        good = [x for x in steps if x is not None]
        step = float(np.median(good)) if good else None
        res[key] = {
            "outs": outs[key],
            "seconds": float(np.median(full)),
            "tok_s": b * bc.max_tokens / float(np.median(full)),
            "tok_s_spread": [b * bc.max_tokens / max(full), b * bc.max_tokens / min(full)],
            "step_s": step,
            "round_step_s": steps,
            "decode_tok_s": step and b / step,
            "decode_tok_s_spread": [b / max(good), b / min(good)] if good else None,
            "load1": os.getloadavg()[0],
        }
    return res


def _ratios(ref: list, new: list) -> list[float]:
    """Per-round ref / new of two cells' round_step_s (rounds where both were measured)."""
    return [r / n for r, n in zip(ref, new) if r is not None and n is not None]


def _bench_all(bc, target, draft, prompts) -> tuple[dict, list[dict]]:
    """Plain ji.generate per (batch, temperature) and the fused speculative runs over the grid,
    timed interleaved (`_interleaved`)."""
    cfg, params = target
    cells = {}
    for b in bc.batch_sizes:
        for temp in bc.temperatures:  # temperature is data: compiled once
            run = functools.partial(ji.generate, cfg, params, prompts[:b])
            cells[("plain", b, temp)] = (run, b, temp)
    grid = [
        (name, b, g, mode)
        for name in bc.drafters
        for b in bc.batch_sizes
        for g in bc.gammas + (("auto",) if bc.auto else ())
        for mode in bc.acceptance
    ]
    for name, b, gamma, mode in grid:
        run = functools.partial(
            _spec_run, target, draft if name == "model" else "ngram", prompts[:b], gamma, mode
        )
        for temp in bc.temperatures:
            if temp == 0 and mode != bc.acceptance[0]:
                continue  # greedy: every acceptance mode is the same computation
            cells[(name, b, gamma, mode, temp)] = (run, b, temp)
    timed = _interleaved(bc, cells)
    w_target = tree_bytes(params)
    w_draft = tree_bytes(draft[1]) if draft is not None else 0
    plain = {}
    for b in bc.batch_sizes:
        for temp in bc.temperatures:
            m = timed[("plain", b, temp)]
            gbs = m["step_s"] and w_target / m["step_s"] / 1e9
            plain[(b, temp)] = {"batch": b, "temperature": temp, **m, "weight_gbs": gbs}
    rows = []
    for key, m in timed.items():
        if key[0] == "plain":
            continue
        name, b, gamma, mode, temp = key
        outs = m.pop("outs")
        auto = gamma == "auto"
        gamma = len(outs[0].accepted_histogram) - 1  # auto: the γ it chose
        counts = np.concatenate(
            [np.repeat(np.arange(gamma + 1), o.accepted_histogram) for o in outs]
        )
        alpha = estimate_alpha(counts, gamma)
        ref = plain[(b, temp)]
        ratios = _ratios(ref["round_step_s"], m["round_step_s"])
        tpc = float(np.mean(counts + 1))
        # Weights read per cycle: the target once, the draft model γ times (n-gram: none).
        per_cycle = w_target + (gamma * w_draft if name == "model" else 0)
        rows.append(
            {
                "drafter": name, "temperature": temp,
                "acceptance": "greedy" if temp == 0 else mode, "batch": b, "gamma": gamma,
                "auto": auto,
                "alpha": [None if np.isnan(a) else float(a) for a in alpha],
                "pooled_alpha": pooled_alpha(counts, gamma),
                "tokens_per_cycle": tpc,
                "cycles": int(sum(o.num_cycles for o in outs)),
                **m,
                "weight_gbs": m["step_s"] and per_cycle / (m["step_s"] * tpc) / 1e9,
                "speedup": float(np.median(ratios)) if ratios else None,
                "speedup_spread": [min(ratios), max(ratios)] if ratios else None,
                "speedup_e2e": ref["seconds"] / m["seconds"],
                # Greedy and coupled runs must reproduce plain decoding token for token;
                # rejection sampling at T > 0 draws different (equally distributed) tokens.
                "matches_plain": None if temp > 0 and mode == "rejection"
                else [o.token_ids for o in outs] == [o.token_ids for o in ref["outs"]],
            }
        )  # fmt: skip
    return plain, rows


def _spec_run(target, drafter, prompts, gamma, mode, sampling):
    return ji.speculative.generate(target, drafter, prompts, sampling, gamma=gamma, acceptance=mode)


def _bench_costs(bc, target, draft, prompts, workdir) -> dict:
    """Cycle logs at the smallest and largest γ per (drafter, batch) -> draft / verify costs."""
    costs = {}
    gammas = sorted({min(bc.gammas), max(bc.gammas)})
    grid = [(name, b) for name in bc.drafters for b in bc.batch_sizes]
    for name, b in tqdm(grid, desc="cycle logs", file=sys.stdout):
        drafter = draft if name == "model" else "ngram"
        logs = []
        for g in gammas:
            # generate_with_log compiles both phases on a discarded warm-up cycle before timing.
            _, records = generate_with_log(
                target, drafter, prompts[:b], _sampling(bc, b, 0, bc.max_tokens), gamma=g
            )
            write_cycle_log(os.path.join(workdir, f"cycles_{name}_b{b}_g{g}.jsonl"), records)
            logs.append(records)
        t_draft, verify = fit_costs(logs)
        costs[(name, b)] = {
            "t_draft_s": t_draft,
            "verify": verify,
            "logs": {g: summarize_log(r) for g, r in zip(gammas, logs)},
        }
    return costs


def _predict(rows, costs, plain) -> None:
    """Adds the speedup model's predictions to each row (α from the largest γ of its setting)."""
    by_setting = {}
    for r in rows:
        key = (r["drafter"], r["temperature"], r["acceptance"], r["batch"])
        if not r["auto"] and r["gamma"] > by_setting.get(key, {"gamma": 0})["gamma"]:
            by_setting[key] = r
    for r in rows:
        ref = by_setting[(r["drafter"], r["temperature"], r["acceptance"], r["batch"])]
        g = r["gamma"]
        alpha = complete_alpha(np.array(ref["alpha"], dtype=np.float64), g)
        r["predicted_tokens_per_cycle"] = expected_tokens_per_cycle(alpha, g)
        c = costs.get((r["drafter"], r["batch"]))
        t_plain = plain[(r["batch"], r["temperature"])]["step_s"]
        if c is None or not isinstance(c["verify"], ji.speculative.LinearCost) or not t_plain:
            continue  # one γ logged (no verify line) or a plain decode time lost in noise
        if c["verify"](g + 1) <= 0:
            continue  # a noisy line: no prediction rather than a meaningless one
        r["predicted_speedup"] = speedup(alpha, g, t_plain, c["t_draft_s"], c["verify"])


def _bench_transformers(bc, target_dir, draft_dir, prompts) -> list[dict]:
    """transformers plain generate (every batch) and assisted / prompt lookup at batch 1."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hfd = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    n = bc.max_tokens
    rows = []

    def batch_ids(b):  # left padding, as decoder-only batched generation requires
        width = max(len(p) for p in prompts[:b])
        ids = torch.full((b, width), data.PAD_ID, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompts[:b]):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids, mask

    def run(b, temp, **extra):
        ids, mask = batch_ids(b)
        kw = dict(max_new_tokens=n, min_new_tokens=n, pad_token_id=data.PAD_ID, do_sample=temp > 0)
        if temp > 0:
            kw.update(temperature=temp, top_k=0, top_p=1.0)
        torch.manual_seed(bc.seed)
        with torch.no_grad():
            return hf.generate(ids, attention_mask=mask, **kw, **extra)

    settings = [(b, t, "plain", {}) for b in bc.batch_sizes for t in bc.temperatures]
    settings += [(1, t, "assisted", {"assistant_model": hfd}) for t in bc.temperatures]
    # transformers' prompt lookup is greedy-only.
    lookup = {"prompt_lookup_num_tokens": max(bc.gammas)}
    settings += [(1, 0.0, "prompt_lookup", lookup)] if 0.0 in bc.temperatures else []
    for b, temp, kind, extra in tqdm(settings, desc="transformers", file=sys.stdout):
        t = _median_time(bc.repeats, run, b, temp, **extra)
        rows.append(
            {"kind": kind, "batch": b, "temperature": temp, "seconds": t, "tok_s": b * n / t}
        )
    return rows


def _plots(rows, workdir) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    big = max(r["batch"] for r in rows)
    gmax = max(r["gamma"] for r in rows)
    for r in rows:
        if r["batch"] == big and r["gamma"] == gmax:
            a = [np.nan if x is None else x for x in r["alpha"]]
            label = f"{r['drafter']}, T={r['temperature']:g}, {r['acceptance']}"
            ax.plot(np.arange(1, len(a) + 1), a, marker="o", label=label)
    ax.set(xlabel="draft position", ylabel="acceptance rate α", ylim=(0, 1.05))
    ax.set_xticks(np.arange(1, gmax + 1))
    ax.set_title(f"Acceptance by draft position (γ={gmax}, batch {big})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "acceptance_by_position.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 5))
    pred = [r for r in rows if "predicted_speedup" in r and r["speedup"]]
    for name, marker in (("model", "o"), ("ngram", "s")):
        for temp, color in zip(sorted({r["temperature"] for r in pred}), ("C0", "C1", "C2", "C3")):
            sel = [r for r in pred if r["drafter"] == name and r["temperature"] == temp]
            if sel:
                ax.scatter(
                    [r["predicted_speedup"] for r in sel], [r["speedup"] for r in sel],
                    marker=marker, color=color, label=f"{name}, T={temp:g}",
                )  # fmt: skip
    if pred:
        hi = max(max(r["predicted_speedup"], r["speedup"]) for r in pred) * 1.1
        ax.plot([0, hi], [0, hi], "k--", lw=0.8)
        ax.axhline(1.0, color="grey", lw=0.5)
    ax.set(xlabel="predicted speedup", ylabel="measured decode speedup")
    ax.set_title("Speedup over plain ji.generate")
    if pred:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "speedup_predicted_vs_measured.png"), dpi=120)
    plt.close(fig)


def _table(rows, plain, hf, note) -> str:
    lines = [note, ""] if note else []
    lines += [
        "| drafter | T | acceptance | batch | γ | α | tok/cycle | tok/cycle pred | tok/s | "
        "decode tok/s (spread) | weight GB/s | speedup e2e | speedup decode (spread) | "
        "speedup pred | = plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pred = r.get("predicted_speedup")
        dec, sp = r["decode_tok_s"], r["speedup"]
        dsp, ssp, gbs = r["decode_tok_s_spread"], r["speedup_spread"], r["weight_gbs"]
        lines.append(
            f"| {r['drafter']} | {r['temperature']:g} | {r['acceptance']} | {r['batch']} | "
            f"{'auto→' if r['auto'] else ''}{r['gamma']} | {r['pooled_alpha']:.2f} | "
            f"{r['tokens_per_cycle']:.2f} | "
            f"{r['predicted_tokens_per_cycle']:.2f} | {r['tok_s']:.0f} | "
            f"{'-' if dec is None else f'{dec:.0f} ({dsp[0]:.0f}-{dsp[1]:.0f})'} | "
            f"{'-' if gbs is None else f'{gbs:.2f}'} | {r['speedup_e2e']:.2f}x | "
            f"{'-' if sp is None else f'{sp:.2f}x ({ssp[0]:.2f}-{ssp[1]:.2f})'} | "
            f"{'-' if pred is None else f'{pred:.2f}x'} | "
            f"{ {None: '-', True: 'yes', False: 'NO'}[r['matches_plain']] } |"
        )
    lines += ["", "| baseline | T | batch | tok/s | decode tok/s (spread) | weight GB/s |"]
    lines.append("|---|---|---|---|---|---|")
    for (b, temp), r in plain.items():
        dec, dsp, gbs = r["decode_tok_s"], r["decode_tok_s_spread"], r["weight_gbs"]
        lines.append(
            f"| ji.generate | {temp:g} | {b} | {r['tok_s']:.0f} | "
            f"{'-' if dec is None else f'{dec:.0f} ({dsp[0]:.0f}-{dsp[1]:.0f})'} | "
            f"{'-' if gbs is None else f'{gbs:.2f}'} |"
        )
    for r in hf:
        lines.append(
            f"| transformers {r['kind']} | {r['temperature']:g} | {r['batch']} | {r['tok_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    bc = _resolve()
    workdir = _WORKDIR.value
    common.save_config(workdir, resolved=dataclasses.asdict(bc))
    target, draft, target_dir, draft_dir, note = _load_models()
    prompts = _prompts(bc, max(bc.batch_sizes))
    t0 = time.perf_counter()
    plain, rows = _bench_all(bc, target, draft, prompts)
    costs = _bench_costs(bc, target, draft, prompts, workdir)
    _predict(rows, costs, plain)
    hf = _bench_transformers(bc, target_dir, draft_dir, prompts) if bc.transformers else []
    for row in plain.values():
        row.pop("outs")
    result = {
        "config": dataclasses.asdict(bc),
        "note": note,
        "models": {"target": target_dir, "draft": draft_dir},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} "
        f"({jax.default_backend()})",
        "seconds": time.perf_counter() - t0,
        "plain": list(plain.values()),
        "costs": {
            f"{name}_b{b}": {
                "t_draft_ms": 1000 * c["t_draft_s"],
                "verify": dataclasses.asdict(c["verify"]),
                "logs": c["logs"],
            }
            for (name, b), c in costs.items()
        },
        "speculative": rows,
        "transformers": hf,
    }
    common.write_results(workdir, result)
    table = _table(rows, plain, hf, note)
    with open(os.path.join(workdir, "table.md"), "w") as f:
        f.write(table)
    _plots(rows, workdir)
    print(table)
    logging.info("wrote %s in %.0f s", workdir, result["seconds"])


if __name__ == "__main__":
    app.run(main)
