r"""The main job: the whole story on the models shipped with the package.

    python experiments/pipeline.py --workdir=runs/pipeline

Stages, quality before any speed claim:
  1. quality     — perplexity and top-1 accuracy of the target and the draft on the shipped test
                   split (a fixed token budget), the unigram baseline, the draft's greedy
                   agreement with the target; completions of code prompts; decode tokens/s;
  2. quantization — experiments/quality_report.py: RTN / GPTQ / AWQ / SmoothQuant / KV formats;
  3. memory      — experiments/memory_report.py: weight and KV bytes, sequences that fit a GPU;
  4. serving     — experiments/serve_bench.py: static batching vs the engine under load;
  5. speculative — experiments/spec_bench.py: acceptance, tokens per cycle, speedups.
Stages 2-5 are the experiment scripts themselves, run as subprocesses in `--quick` mode (pass
`--full` for their default settings) with their outputs under `--workdir/<stage>/`; the report
embeds their tables and plots. Writes into --workdir: config.json (the resolved flags),
results.json, report.md and the PNGs. Without shipped models (a checkout before they were
trained) it runs on randomly initialised models and says so in its output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
from absl import app, flags, logging

import jaxinfer as ji
from jaxinfer import data
from jaxinfer import eval as ji_eval

try:
    from experiments import flag_checks
except ImportError:  # run as `python experiments/X.py`: experiments/ itself is on sys.path
    import flag_checks

_WORKDIR = flags.DEFINE_string("workdir", "runs/pipeline", "Output directory.")
_MODEL = flags.DEFINE_string("model", None, "Target HF dir; default: the shipped target.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft HF dir; default: the shipped draft.")
_EVAL_TOKENS = flags.DEFINE_integer(
    "eval_tokens", ji_eval.EVAL_TOKENS, "Test-split token budget for perplexity.", lower_bound=1
)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 48, "Tokens per sample completion.", lower_bound=1)
_STAGES = flags.DEFINE_list(
    "stages", ["quality", "quantization", "memory", "serving", "speculative"], "Stages to run."
)
_FULL = flags.DEFINE_bool("full", False, "Run stages 2-5 with their full default settings.")

EXPERIMENTS = os.path.dirname(os.path.abspath(__file__))
# stage -> (script, extra flags, markdown file it writes, title)
SCRIPT_STAGES = {
    "quantization": ("quality_report.py", [], "quality.md", "Quantization quality"),
    "memory": ("memory_report.py", [], "memory.md", "Memory"),
    "serving": ("serve_bench.py", [], "serve_bench.md", "Serving"),
    "speculative": ("spec_bench.py", [], "table.md", "Speculative decoding"),
}
flag_checks.choice_list(_STAGES, ("quality", *SCRIPT_STAGES))

# No trailing newline: the tokenizer merges a newline with the next line's indentation, so a
# prompt cut after "\n" would end on a token boundary the model never saw in training.
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "    for i in range(len(items)):",
    "    def __repr__(self):\n        return",
]


def _load_models():
    """(target, draft, tokenizer, note): shipped models by default, random tiny ones if absent."""
    target_dir = _MODEL.value or ("target" in ji.models.names() and ji.models.path("target"))
    draft_dir = _DRAFT.value or ("draft" in ji.models.names() and ji.models.path("draft"))
    if target_dir:
        target = ji.load_checkpoint(target_dir)
        draft = ji.load_checkpoint(draft_dir) if draft_dir else None
        tok = ji.load_tokenizer(target_dir)
        return target, draft, tok, {"target": target_dir, "draft": draft_dir or None}
    logging.warning("no shipped models: running on RANDOMLY INITIALISED tiny models")
    tok = data.load_tokenizer()
    cfg = ji.preset("bench-5m").replace(
        vocab_size=tok.get_vocab_size(), bos_token_id=data.BOS_ID, eos_token_id=data.EOS_ID
    )
    dcfg = cfg.replace(num_layers=2, hidden_size=128, num_heads=2, head_dim=64, num_kv_heads=1)
    target = (cfg, ji.init_params(cfg, jax.random.key(0)))
    draft = (dcfg, ji.init_params(dcfg, jax.random.key(1)))
    note = "RANDOMLY INITIALISED bench-5m (no shipped models found): figures are meaningless"
    return target, draft, tok, {"target": note, "draft": note}


def stage_quality(target, draft, tok) -> dict:
    windows = ji_eval.standard_windows(tok, max_tokens=_EVAL_TOKENS.value)
    train = data.token_stream("train", tok)
    out = {"eval_windows": list(windows.shape), "eval_tokens": int(windows[:, 1:].size)}
    t = ji_eval.lm_stats(*target, windows, progress=True)
    out["target"] = {"ppl": t.perplexity, "nll": t.nll, "top1": t.accuracy}
    uni = ji_eval.unigram_stats(train, windows, target[0].vocab_size)
    out["unigram"] = {"ppl": uni.perplexity, "nll": uni.nll, "top1": uni.accuracy}
    if draft is not None:
        d = ji_eval.lm_stats(*draft, windows, progress=True)
        out["draft"] = {"ppl": d.perplexity, "nll": d.nll, "top1": d.accuracy}
        pair = ji_eval.pair_stats(target, draft, windows, progress=True)
        out["draft_agreement"] = pair.agreement
        out["draft_kl"] = pair.kl
    return out


def stage_samples(target, tok) -> list[dict]:
    cfg, params = target
    prompts = [[cfg.bos_token_id or 0] + tok.encode(p).ids for p in PROMPTS]
    greedy = ji.generate(
        cfg, params, prompts, ji.SamplingParams(temperature=0, max_tokens=_MAX_TOKENS.value)
    )
    sampled = ji.generate(
        cfg, params, prompts,
        ji.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=_MAX_TOKENS.value, seed=1),
    )  # fmt: skip
    return [
        {"prompt": p, "greedy": tok.decode(g.token_ids), "sampled": tok.decode(s.token_ids)}
        for p, g, s in zip(PROMPTS, greedy, sampled)
    ]


def stage_decode(target) -> dict:
    cfg, params = target
    out = {}
    for b in (1, 8):
        prompts = np.random.RandomState(b).randint(3, cfg.vocab_size, (b, 32)).tolist()
        sp = ji.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        ji.generate(cfg, params, prompts, sp)  # compile
        t0 = time.perf_counter()
        ji.generate(cfg, params, prompts, sp)
        out[f"batch{b}_tok_s"] = b * 64 / (time.perf_counter() - t0)
    return out


def _loss_curves(models: dict, workdir: str) -> list[str]:
    pngs = []
    for name, d in models.items():
        src = os.path.join(d, "loss_curve.png") if d and os.path.isdir(str(d)) else None
        if src and os.path.exists(src):
            dst = os.path.join(workdir, f"loss_curve_{name}.png")
            shutil.copy(src, dst)
            pngs.append(os.path.basename(dst))
    return pngs


def _quality_section(results: dict) -> list[str]:
    q = results["quality"]
    lines = ["", "## 1. Quality (test split)", ""]
    lines += [
        f"{q['eval_tokens']} predicted tokens ({q['eval_windows'][0]} windows of "
        f"{q['eval_windows'][1] - 1}).",
        "",
        "| model | perplexity | top-1 accuracy |",
        "|---|---|---|",
    ]
    for name in ("target", "draft", "unigram"):
        if name in q:
            lines.append(f"| {name} | {q[name]['ppl']:.2f} | {100 * q[name]['top1']:.1f}% |")
    if "draft_agreement" in q:
        lines += [
            "",
            f"Draft greedy agreement with the target: {100 * q['draft_agreement']:.1f}% "
            f"(KL(target || draft) = {q['draft_kl']:.3f} nats/token).",
        ]
    lines += ["", "### Sample completions (target)", ""]
    for s in results["samples"]:
        lines += ["Greedy:", "```python", s["prompt"] + s["greedy"], "```"]
        lines += ["Sampled (T=0.8, top-p 0.95):", "```python", s["prompt"] + s["sampled"], "```"]
    d = results["decode"]
    lines += [
        "",
        "### Decode throughput (`ji.generate`, greedy, 32-token prompts, 64 new tokens)",
        "",
        f"batch 1: {d['batch1_tok_s']:.0f} tokens/s; batch 8: {d['batch8_tok_s']:.0f} tokens/s.",
    ]
    return lines


def run_script_stage(stage: str, workdir: str, models: dict) -> dict:
    """Runs one experiment script as a subprocess; returns its markdown, plots and status."""
    script, extra, md_name, title = SCRIPT_STAGES[stage]
    out_dir = os.path.join(workdir, stage)
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, os.path.join(EXPERIMENTS, script), f"--workdir={out_dir}", *extra]
    if stage != "memory" and not _FULL.value:
        cmd.append("--quick")
    if stage in ("quantization", "serving") and _MODEL.value:
        cmd.append(f"--model={_MODEL.value}")
    if stage == "speculative":
        cmd += [f"--{k}={v}" for k, v in (("target", _MODEL.value), ("draft", _DRAFT.value)) if v]
        # The transformers baselines need the test extras (torch, transformers).
        if not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
            cmd.append("--notransformers")
    print(f"[{stage}] " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    with open(os.path.join(out_dir, "log.txt"), "w") as f:
        f.write(proc.stdout + "\n" + proc.stderr)
    md_path = os.path.join(out_dir, md_name)
    md = open(md_path).read() if os.path.exists(md_path) else None
    if proc.returncode != 0 or md is None:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        print(f"[{stage}] FAILED (exit {proc.returncode}); see {out_dir}/log.txt\n{tail}")
    pngs = sorted(os.path.join(stage, f) for f in os.listdir(out_dir) if f.endswith(".png"))
    shown = ["python", f"experiments/{script}", *cmd[2:]]
    command = " ".join(shown).replace(out_dir, f"<workdir>/{stage}")
    return {"title": title, "ok": proc.returncode == 0 and md is not None, "seconds": seconds,
            "markdown": md, "pngs": pngs, "command": command}  # fmt: skip


def write_report(workdir: str, models: dict, results: dict, pngs: list[str]) -> None:
    lines = ["# jaxinfer pipeline report", ""]
    lines += [f"- {k}: `{v}`" for k, v in models.items()]
    lines += [f"- machine: {results['machine']}"]
    if "quality" in results:
        lines += _quality_section(results)
    for n, stage in enumerate(SCRIPT_STAGES, start=2):
        if stage not in results:
            continue
        r = results[stage]
        lines += ["", f"## {n}. {r['title']}", "", f"`{r['command']}` ({r['seconds']:.0f} s)", ""]
        if not r["ok"]:
            lines += [f"**This stage failed**; its log is `{stage}/log.txt`.", ""]
        if r["markdown"]:
            body = r["markdown"].strip().splitlines()
            # Demote the script's own headings under this section's.
            lines += ["#" + ln if ln.startswith("#") else ln for ln in body]
        lines += [f"![{p}]({p})" for p in r["pngs"]]
    if pngs:
        lines += ["", "## Training loss curves", ""] + [f"![{p}]({p})" for p in pngs]
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv):
    del argv
    workdir = _WORKDIR.value
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(flags.FLAGS.flag_values_dict(), f, indent=2, default=str)
    target, draft, tok, models = _load_models()
    print(f"models: {models}")
    results = {"models": models, "machine": f"{os.cpu_count()} cores, {jax.default_backend()}"}
    t0 = time.perf_counter()
    if "quality" in _STAGES.value:
        results["quality"] = stage_quality(target, draft, tok)
        print(json.dumps(results["quality"], indent=2))
        results["samples"] = stage_samples(target, tok)
        print(results["samples"][0]["prompt"] + results["samples"][0]["greedy"])
        results["decode"] = stage_decode(target)
        print(results["decode"])
    for stage in SCRIPT_STAGES:
        if stage in _STAGES.value:
            results[stage] = run_script_stage(stage, workdir, models)
    results["seconds"] = time.perf_counter() - t0
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    write_report(workdir, models, results, _loss_curves(models, workdir))
    print(f"wrote {os.path.join(workdir, 'report.md')}")


if __name__ == "__main__":
    app.run(main)
