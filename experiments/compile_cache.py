r"""A server's start with and without the persistent cache of compiled programs.

    python -m experiments.compile_cache --workdir=runs/compile_cache
    python -m experiments.compile_cache --speculative=none --max_num_seqs=4
    python -m experiments.compile_cache --baseline=../old   # and a worktree of an older commit

Each start is a fresh process that does what `experiments/serve.py` does before it serves: load
--model, build the engine of `serve.engine_config` (the hybrid drafter, --ngram_first=2 over
--head with γ = auto up to --max_gamma, for --speculative=hybrid; no speculation for none) and run
`serve.warmup` (one prompt per token bucket, then the γ controller's step-time table at every
batch bucket up to --max_num_seqs). Then it serves --requests greedy test-split prompts of
--prompt_len tokens, --max_tokens each, all at once, and prints their tokens. Three kinds of
start: `off` (no cache), `cold` (an empty cache folder, which it fills) and `warm` (the folder
the cold start of the same round filled); with --baseline, also `base`: --baseline's code
(another checkout) started without a cache. Each round runs them all (off's place rotates); the
table gives each kind's median seconds (load, warm-up, serve) and the cache's size. Tokens of
every start must be identical.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

from absl import app, flags

from experiments import common

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "A ji.models name or a path.")
_SPECULATIVE = flags.DEFINE_enum("speculative", "hybrid", ["hybrid", "none"], "The drafter.")
_HEAD = flags.DEFINE_string("head", "smollm2-135m-eagle", "--speculative=hybrid: the head.")
_MAX_GAMMA = flags.DEFINE_integer("max_gamma", 4, "γ cap of the auto engine.", lower_bound=1)
_MAX_NUM_SEQS = flags.DEFINE_integer(
    "max_num_seqs", 2, "Sequences per step (warm-up times batch buckets up to it).", lower_bound=1
)
_MAX_BATCHED = flags.DEFINE_integer(
    "max_num_batched_tokens", 64, "Token budget per step (warm-up compiles each bucket to it).",
    lower_bound=1,
)  # fmt: skip
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 64, "KV blocks.", lower_bound=2)
_REQUESTS = flags.DEFINE_integer("requests", 2, "Requests served after the warm-up.", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 48, "Prompt tokens.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "Tokens per request.", lower_bound=1)
_MIN_SECS = flags.DEFINE_float(
    "min_compile_secs", 0.5, "Programs compiled faster are not cached.", lower_bound=0
)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds of off, cold, warm.", lower_bound=1)
_BASELINE = flags.DEFINE_string(
    "baseline", None, "Another checkout (e.g. a `git worktree` of an older commit): each round "
    "also starts it without a cache (`base`), its tokens checked against ours.",
)  # fmt: skip
_WORKDIR = flags.DEFINE_string("workdir", "runs/compile_cache", "Results and the cache folders.")
_CONFIG = common.config_flag()
flags.register_validator(
    "baseline", lambda v: v is None or os.path.isdir(os.path.join(v, "jaxinfer")),
    "--baseline must be a jaxinfer checkout (a folder holding jaxinfer/)",
)  # fmt: skip

_CHILD = """
import dataclasses, json, sys, time
t0 = time.perf_counter()
import jaxinfer as ji
from experiments import common, serve
args = json.loads(sys.argv[1])
if args["cache"]:
    ji.enable_compilation_cache(args["cache"], min_compile_secs=args["min_compile_secs"])
cfg, params = ji.load_checkpoint(args["path"])
spec = None
if args["head"]:
    head = dataclasses.replace(ji.speculative.heads.load_head(args["head"], cfg), ngram_first=2)
    spec = ji.SpeculativeConfig(drafter=head, num_speculative_tokens="auto",
                                max_gamma=args["max_gamma"])
ecfg = serve.engine_config(cfg, 16, args["num_blocks"], args["max_num_seqs"],
                           args["max_batched"], True, "auto", None, speculative=spec)
engine = ji.Engine(cfg, params, ecfg)
t1 = time.perf_counter()
serve.warmup(engine)
t2 = time.perf_counter()
tok = ji.load_tokenizer(args["path"])
windows = common.test_windows(tok, cfg, 10**7, args["prompt_len"])
prompts = windows[: args["requests"], : args["prompt_len"]].tolist()
outs = engine.generate(prompts, ji.SamplingParams(temperature=0, max_tokens=args["max_tokens"]))
t3 = time.perf_counter()
print("RESULT" + json.dumps({"load_s": t1 - t0, "warmup_s": t2 - t1, "serve_s": t3 - t2,
                             "tokens": [list(o.token_ids) for o in outs]}))
"""


def _start(args: dict, checkout: str) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        capture_output=True, text=True, cwd=checkout, env=env,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"a start failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT") :])


def _size_mb(folder: str) -> tuple[float, int]:
    names = os.listdir(folder)
    return sum(os.path.getsize(os.path.join(folder, n)) for n in names) / 2**20, len(names)


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    path = common.resolve_model(_MODEL.value)
    hybrid = _SPECULATIVE.value == "hybrid"
    head = common.resolve_model(_HEAD.value) if hybrid else ""
    common.save_config(_WORKDIR.value, resolved={"model": path})
    base = {
        "path": path, "head": head, "max_gamma": _MAX_GAMMA.value,
        "max_num_seqs": _MAX_NUM_SEQS.value, "max_batched": _MAX_BATCHED.value,
        "num_blocks": _NUM_BLOCKS.value, "requests": _REQUESTS.value,
        "prompt_len": _PROMPT_LEN.value, "max_tokens": _MAX_TOKENS.value,
        "min_compile_secs": _MIN_SECS.value,
    }  # fmt: skip
    kinds = ["off", "cold", "warm"] + (["base"] if _BASELINE.value else [])
    starts, sizes, tokens = {k: [] for k in kinds}, [], None
    here = os.getcwd()
    for r in range(_ROUNDS.value):
        folder = os.path.abspath(os.path.join(_WORKDIR.value, f"xla_{r}"))
        shutil.rmtree(folder, ignore_errors=True)
        order = kinds if r % 2 == 0 else ["cold", "warm"] + kinds[3:] + ["off"]
        for kind in order:
            cache = folder if kind in ("cold", "warm") else ""
            res = _start({**base, "cache": cache}, _BASELINE.value if kind == "base" else here)
            if tokens is None:
                tokens = res["tokens"]
            if res.pop("tokens") != tokens:
                raise RuntimeError(f"round {r}: the {kind} start's tokens differ from the first's")
            starts[kind].append(res)
            print(f"round {r} {kind}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
        sizes.append(_size_mb(folder))
    print(f"\n{_SPECULATIVE.value}, max_num_seqs {_MAX_NUM_SEQS.value}: median s over rounds")
    print("| start | load | warm-up | serve | warm-up / off's |")
    print("|---|---|---|---|---|")
    off_w = statistics.median(s["warmup_s"] for s in starts["off"])
    table = {}
    for kind, runs in starts.items():
        med = {k: statistics.median(s[k] for s in runs) for k in runs[0]}
        table[kind] = {**med, "runs": runs}
        print(
            f"| {kind} | {med['load_s']:.1f} | {med['warmup_s']:.1f} | {med['serve_s']:.1f} "
            f"| {med['warmup_s'] / off_w:.2f} |"
        )
    mb, files = sizes[-1]
    print(f"cache: {mb:.0f} MB in {files} files; tokens identical across all starts")
    common.write_results(
        _WORKDIR.value, {"starts": table, "cache_mb": mb, "cache_files": files, **base}
    )


if __name__ == "__main__":
    app.run(main)
