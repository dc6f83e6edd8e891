r"""The main job: the whole story on SmolLM2-135M-Instruct (default) or the tiny trained pair.

    python -m experiments.pipeline --workdir=runs/pipeline                 # SmolLM2, quick
    python -m experiments.pipeline --workdir=runs/tiny --model=target      # the tiny pair (fast)
    python -m experiments.pipeline --workdir=runs/full --full               # the long settings

--model is a name of `ji.models.names()` ("smollm2-135m", "target") or a checkpoint path.
Stages, quality before any speed claim:
  1. quality     — perplexity and top-1 accuracy on the shipped test split (tokenized with the
                   model's own tokenizer; a fixed token budget); with the tiny pair also the draft,
                   the unigram baseline and the draft's greedy agreement; sample completions,
                   greedy and sampled, raw and (for a model with a chat template) through it;
                   decode tokens/s;
  2. quantization — tiny pair: experiments/quality_report.py (RTN / GPTQ / AWQ / SmoothQuant / KV);
                   others: experiments/quant_sweep.py (group sizes that divide their widths);
  3. memory      — experiments/memory_report.py: weight and KV bytes, sequences that fit a GPU;
  4. serving     — experiments/serve_bench.py: static batching vs the engine under load;
  5. speculative — tiny pair: experiments/spec_bench.py (model and n-gram drafters); others:
                   experiments/spec_ngram.py (the n-gram drafter: no learned drafter exists yet).
Stages 2-5 are the experiment scripts themselves, run as subprocesses with `--quick` (the
default; `--full` gives them their default settings) with their outputs under
`--workdir/<stage>/`; the report embeds their tables and plots and each stage's wall time.
Writes into --workdir: config.json (the resolved flags), results.json, report.md and the PNGs.
With --model=target and no shipped models (a checkout before they were trained) it runs on
randomly initialised models and says so in its output.
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
from experiments import common, flag_checks
from jaxinfer import data
from jaxinfer import eval as ji_eval

# Predicted-token budgets of --quick (+1: windows share a boundary token): 32 windows of 256 for
# the tiny pair; 16 for a 135 M model, whose dense forward is ~35x costlier a token on a CPU.
QUICK_EVAL_TOKENS = {"tiny": 32 * 256 + 1, "pretrained": 16 * 256 + 1}

_WORKDIR = flags.DEFINE_string("workdir", "runs/pipeline", "Output directory.")
_MODEL = flags.DEFINE_string(
    "model",
    "smollm2-135m",
    "Target: a name of ji.models.names() or a checkpoint path (HF dir or .gguf); 'target' for "
    "the tiny trained pair (fast runs).",
)
_DRAFT = flags.DEFINE_string(
    "draft",
    None,
    "Draft: a model name or path; default 'draft' with --model=target, none otherwise (the "
    "speculative stage then uses the n-gram drafter).",
)
_QUICK = flags.DEFINE_bool(
    "quick", True, "Quick settings in every stage: THE DEFAULT. --full for the long settings."
)
_FULL = flags.DEFINE_bool(
    "full", False, "The long settings: full eval budget, stages 2-5 with their defaults."
)
_EVAL_TOKENS = flags.DEFINE_integer(
    "eval_tokens",
    None,
    f"Test-split token budget for perplexity; default quick: {QUICK_EVAL_TOKENS['tiny']} (tiny "
    f"pair) / {QUICK_EVAL_TOKENS['pretrained']} (others), --full: {ji_eval.EVAL_TOKENS}.",
    lower_bound=2,
)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 48, "Tokens per sample completion.", lower_bound=1)
_STAGES = flags.DEFINE_list(
    "stages", ["quality", "quantization", "memory", "serving", "speculative"], "Stages to run."
)

_CONFIG = common.config_flag()

# The checkout root, on the stages' PYTHONPATH: they run as `python -m experiments.X` from any
# working directory (their --workdir paths stay relative to this one's).
ROOT = os.path.dirname(common.EXPERIMENTS_DIR)
TITLES = {
    "quantization": "Quantization quality",
    "memory": "Memory",
    "serving": "Serving",
    "speculative": "Speculative decoding",
}
# (stage, tiny pair?) -> (module of experiments/, markdown file it writes)
STAGE_SCRIPTS = {
    ("quantization", True): ("quality_report", "quality.md"),
    ("quantization", False): ("quant_sweep", "quant_sweep.md"),
    ("memory", True): ("memory_report", "memory.md"),
    ("memory", False): ("memory_report", "memory.md"),
    ("serving", True): ("serve_bench", "serve_bench.md"),
    ("serving", False): ("serve_bench", "serve_bench.md"),
    ("speculative", True): ("spec_bench", "table.md"),
    ("speculative", False): ("spec_ngram", "spec_ngram.md"),
}
flag_checks.choice_list(_STAGES, ("quality", *TITLES))

# No trailing newline: the tokenizer merges a newline with the next line's indentation, so a
# prompt cut after "\n" would end on a token boundary the model never saw in training.
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "    for i in range(len(items)):",
    "    def __repr__(self):\n        return",
]


def _quick() -> bool:
    return _QUICK.value and not _FULL.value


def _is_tiny(tok) -> bool:
    """True for the tiny pair's tokenizer (the shipped corpus tokenizer, with its specials)."""
    return tok.token_to_id(data.BOS_TOKEN) is not None


def _load_models():
    """(target, draft, tokenizer, paths, random_init): --model and its draft (or random ones)."""
    draft_name = _DRAFT.value or ("draft" if _MODEL.value == "target" else None)
    if _MODEL.value != "target" or "target" in ji.models.names():
        path = common.resolve_model(_MODEL.value)
        target = ji.load_checkpoint(path)
        dpath = common.resolve_model(draft_name) if draft_name else None
        draft = ji.load_checkpoint(dpath) if dpath else None
        return target, draft, ji.load_tokenizer(path), {"target": path, "draft": dpath}, False
    logging.warning("no shipped models: running on RANDOMLY INITIALISED tiny models")
    tok = data.load_tokenizer()
    cfg = ji.preset("bench-5m").replace(
        vocab_size=tok.get_vocab_size(), bos_token_id=data.BOS_ID, eos_token_id=data.EOS_ID
    )
    dcfg = cfg.replace(num_layers=2, hidden_size=128, num_heads=2, head_dim=64, num_kv_heads=1)
    target = (cfg, ji.init_params(cfg, jax.random.key(0)))
    draft = (dcfg, ji.init_params(dcfg, jax.random.key(1)))
    note = "RANDOMLY INITIALISED bench-5m (no shipped models found): figures are meaningless"
    return target, draft, tok, {"target": note, "draft": note}, True


def eval_budget(tiny: bool) -> int:
    """The test-split token budget: --eval_tokens, else by --quick / --full and model size."""
    if _EVAL_TOKENS.value:
        return _EVAL_TOKENS.value
    return QUICK_EVAL_TOKENS["tiny" if tiny else "pretrained"] if _quick() else ji_eval.EVAL_TOKENS


def stage_quality(target, draft, tok) -> dict:
    tiny = _is_tiny(tok)
    windows = common.test_windows(tok, target[0], eval_budget(tiny))  # [N, 257]
    out = {"eval_windows": list(windows.shape), "eval_tokens": int(windows[:, 1:].size)}
    bs = ji_eval.EVAL_BATCH_SIZE if tiny else 4  # [4, 256, 49152] float32 logits: 200 MB
    t = ji_eval.lm_stats(*target, windows, batch_size=bs, progress=True)
    out["target"] = {"ppl": t.perplexity, "nll": t.nll, "top1": t.accuracy}
    if tiny:  # the train split tokenized by a 49 k-vocabulary tokenizer costs minutes: tiny only
        train = data.token_stream("train", tok)
        uni = ji_eval.unigram_stats(train, windows, target[0].vocab_size)
        out["unigram"] = {"ppl": uni.perplexity, "nll": uni.nll, "top1": uni.accuracy}
    if draft is not None:
        d = ji_eval.lm_stats(*draft, windows, progress=True)
        out["draft"] = {"ppl": d.perplexity, "nll": d.nll, "top1": d.accuracy}
        pair = ji_eval.pair_stats(target, draft, windows, progress=True)
        out["draft_agreement"] = pair.agreement
        out["draft_kl"] = pair.kl
    return out


def sample_prompts(cfg, tok) -> list[tuple[str, str, list[int]]]:
    """(kind, shown text, ids): the raw code prompts, then the chat prompts if a template exists."""
    tiny = _is_tiny(tok)
    bos = [cfg.bos_token_id or 0] if tiny else []  # SmolLM2's bos is <|im_start|>: not for raw text
    out = [("raw", p, bos + tok.encode(p, add_special_tokens=False).ids) for p in PROMPTS]
    if getattr(tok, "chat_template", None):
        for text, ids in common.chat_prompts(tok, common.CHAT_PROMPTS[:3]):
            out.append(("chat", text, ids))
    return out


def stage_samples(target, tok) -> list[dict]:
    cfg, params = target
    prompts = sample_prompts(cfg, tok)
    ids = [p[2] for p in prompts]
    n = _MAX_TOKENS.value
    greedy = ji.generate(cfg, params, ids, ji.SamplingParams(temperature=0, max_tokens=n))
    sampled = ji.generate(
        cfg, params, ids, ji.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, seed=1)
    )
    return [
        {"kind": k, "prompt": text, "greedy": tok.decode(g.token_ids),
         "sampled": tok.decode(s.token_ids)}
        for (k, text, _), g, s in zip(prompts, greedy, sampled)
    ]  # fmt: skip


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
        f"{q['eval_windows'][1] - 1}), tokenized with the model's own tokenizer "
        f"({results['stage_seconds']['quality']:.0f} s).",
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
    lines += ["", f"### Sample completions (target, {_MAX_TOKENS.value} tokens at most)", ""]
    for s in results["samples"]:
        # Four backticks: a chat answer may hold a ``` code block of its own.
        fence = "````python" if s["kind"] == "raw" else "````text"
        head = "" if s["kind"] == "raw" else " (through the chat template)"
        lines += [f"Greedy{head}:", fence, s["prompt"] + s["greedy"], "````"]
        lines += [f"Sampled (T=0.8, top-p 0.95){head}:", fence, s["prompt"] + s["sampled"], "````"]
    d = results["decode"]
    lines += [
        "",
        "### Decode throughput (`ji.generate`, greedy, 32-token prompts, 64 new tokens)",
        "",
        f"batch 1: {d['batch1_tok_s']:.1f} tokens/s; batch 8: {d['batch8_tok_s']:.1f} tokens/s "
        "(one timed run each, after a compiling run; bench_decode.py has the careful figures).",
    ]
    return lines


def stage_command(stage: str, out_dir: str, paths: dict, tiny: bool, random_init: bool) -> list:
    """The subprocess command line of a script stage."""
    module = STAGE_SCRIPTS[(stage, tiny)][0]
    cmd = [sys.executable, "-m", f"experiments.{module}", f"--workdir={out_dir}"]
    if stage != "memory" and _quick():
        cmd.append("--quick")
    target = None if random_init else paths["target"]
    if stage in ("quantization", "serving") and target:
        cmd.append(f"--model={target}")
    if stage == "speculative" and tiny:
        pair = (("target", target), ("draft", None if random_init else paths["draft"]))
        cmd += [f"--{k}={v}" for k, v in pair if v]
        # The transformers baselines need the test extras (torch, transformers).
        if not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
            cmd.append("--notransformers")
    elif stage == "speculative":
        cmd.append(f"--model={target}")
    if stage == "memory" and not tiny and _MODEL.value in ji.models.names():
        # The model itself, beside the 7-8 B presets; formats whose groups divide its widths.
        cmd += [f"--models={_MODEL.value},llama3-8b,qwen2.5-7b", "--weight_formats=bf16,w8,w4g64"]
    return cmd


def run_script_stage(stage: str, workdir: str, paths: dict, tiny: bool, random_init: bool) -> dict:
    """Runs one experiment script as a subprocess; returns its markdown, plots and status."""
    md_name = STAGE_SCRIPTS[(stage, tiny)][1]
    out_dir = os.path.join(workdir, stage)
    os.makedirs(out_dir, exist_ok=True)
    cmd = stage_command(stage, out_dir, paths, tiny, random_init)
    print(f"[{stage}] " + " ".join(cmd[1:]), flush=True)
    load0, t0 = common.load_average(), time.perf_counter()
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path}
    )
    seconds = time.perf_counter() - t0
    with open(os.path.join(out_dir, "log.txt"), "w") as f:
        f.write(proc.stdout + "\n" + proc.stderr)
    md_path = os.path.join(out_dir, md_name)
    md = open(md_path).read() if os.path.exists(md_path) else None
    if proc.returncode != 0 or md is None:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        print(f"[{stage}] FAILED (exit {proc.returncode}); see {out_dir}/log.txt\n{tail}")
    print(f"[{stage}] {seconds:.0f} s", flush=True)
    pngs = sorted(os.path.join(stage, f) for f in os.listdir(out_dir) if f.endswith(".png"))
    shown = ["python", *cmd[1:]]
    command = " ".join(shown).replace(out_dir, f"<workdir>/{stage}")
    return {"title": TITLES[stage], "ok": proc.returncode == 0 and md is not None,
            "seconds": seconds, "load_average": [load0, common.load_average()],
            "markdown": md, "pngs": pngs, "command": command}  # fmt: skip


def write_report(workdir: str, models: dict, results: dict, pngs: list[str]) -> None:
    lines = ["# jaxinfer pipeline report", ""]
    lines += [f"- --model={_MODEL.value} (`{os.path.basename(str(models['target']))}`)"]
    if models.get("draft"):
        lines += [f"- draft: `{os.path.basename(str(models['draft']))}`"]
    lines += [f"- machine: {results['machine']}"]
    lines += [f"- settings: {'--full' if not _quick() else '--quick (the default)'}"]
    lines += [f"- total: {results['seconds']:.0f} s; per stage (s, load average before/after):"]
    lines += [
        f"  - {k}: {v:.0f} s ({results['stage_load'][k]})"
        for k, v in results["stage_seconds"].items()
    ]
    if "quality" in results:
        lines += _quality_section(results)
    for n, stage in enumerate(TITLES, start=2):
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
    common.apply_config(_CONFIG.value)
    workdir = _WORKDIR.value
    common.save_config(workdir)
    target, draft, tok, paths, random_init = _load_models()
    tiny = _is_tiny(tok)
    print(f"models: {paths}")
    results = {"models": paths, "machine": f"{os.cpu_count()} cores, {jax.default_backend()}"}
    results["stage_seconds"], results["stage_load"] = {}, {}
    t0 = time.perf_counter()
    if "quality" in _STAGES.value:
        load0, t1 = common.load_average(), time.perf_counter()
        results["quality"] = stage_quality(target, draft, tok)
        print(json.dumps(results["quality"], indent=2))
        results["samples"] = stage_samples(target, tok)
        print(results["samples"][0]["prompt"] + results["samples"][0]["greedy"])
        results["decode"] = stage_decode(target)
        print(results["decode"])
        results["stage_seconds"]["quality"] = time.perf_counter() - t1
        results["stage_load"]["quality"] = [load0, common.load_average()]
    del target, draft  # the script stages load their own copies
    for stage in TITLES:
        if stage in _STAGES.value:
            results[stage] = run_script_stage(stage, workdir, paths, tiny, random_init)
            results["stage_seconds"][stage] = results[stage]["seconds"]
            results["stage_load"][stage] = results[stage]["load_average"]
    results["seconds"] = time.perf_counter() - t0
    write_report(workdir, paths, results, _loss_curves(paths, workdir))
    common.write_results(workdir, results)
    print(f"wrote {os.path.join(workdir, 'report.md')}")


if __name__ == "__main__":
    app.run(main)
