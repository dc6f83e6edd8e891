r"""Perplexity and top-1 accuracy of a model on the shipped test split, with baselines.

The fixed budget is `jaxinfer.eval.EVAL_TOKENS` (the first 65,536 tokens of the test stream) in
windows of 256 (255 windows, 65,280 predicted tokens). Also reports the add-one smoothed unigram
baseline (frequencies from the train split) on the same tokens and, with --draft, the draft's own
figures plus its greedy agreement with, and KL from, the model.

    python -m experiments.eval_ppl --workdir=/tmp/jaxinfer_runs/eval
    python -m experiments.eval_ppl --model=jaxinfer/assets/models/target \
        --draft=jaxinfer/assets/models/draft --workdir=/tmp/jaxinfer_runs/eval

Writes `<workdir>/config.json` (the flags) and `<workdir>/results.json`, and prints a table.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax.numpy as jnp
from absl import app, flags

from experiments import common
from jaxinfer import data
from jaxinfer import eval as jeval
from jaxinfer.checkpoint import load_checkpoint

_MODEL = flags.DEFINE_string("model", "", "HF dir of the model; empty: the shipped target.")
_DRAFT = flags.DEFINE_string("draft", "", "Optional HF dir of a draft model to compare.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json and results.json go.")
_MAX_TOKENS = flags.DEFINE_integer(
    "max_tokens", jeval.EVAL_TOKENS, "Test-stream token budget.", lower_bound=1
)
_SEQ_LEN = flags.DEFINE_integer("seq_len", jeval.EVAL_SEQ_LEN, "Window length.", lower_bound=2)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", jeval.EVAL_BATCH_SIZE, "Windows per forward.", lower_bound=1
)
_CACHE_DIR = flags.DEFINE_string(
    "cache_dir", "", "Cache for the tokenized train stream (unigram counts); default --workdir."
)
_CONFIG = common.config_flag()
flags.mark_flag_as_required("workdir")


def _row(name: str, stats: jeval.LMStats) -> dict:
    return {
        "name": name,
        "nll": stats.nll,
        "perplexity": stats.perplexity,
        "top1_accuracy": stats.accuracy,
        "num_tokens": stats.num_tokens,
    }


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    workdir = Path(_WORKDIR.value)
    model_dir = common.resolve_model(_MODEL.value or "target")
    draft_dir = common.resolve_model(_DRAFT.value) if _DRAFT.value else None
    common.save_config(str(workdir), resolved={"model": model_dir, "draft": draft_dir})

    tok = data.load_tokenizer()
    windows = jeval.standard_windows(tok, _SEQ_LEN.value, _MAX_TOKENS.value)  # [N, S+1]
    cfg, params = load_checkpoint(model_dir, dtype=jnp.float32)
    t0 = time.perf_counter()
    stats = jeval.lm_stats(cfg, params, windows, batch_size=_BATCH_SIZE.value, progress=True)
    model_s = time.perf_counter() - t0
    train_stream = data.token_stream("train", tok, cache_dir=_CACHE_DIR.value or workdir)
    unigram = jeval.unigram_stats(train_stream, windows, cfg.vocab_size)
    results = {
        "test_windows": list(windows.shape),
        "predicted_tokens": stats.num_tokens,
        "model": {**_row(model_dir, stats), "num_params": cfg.num_params(), "eval_s": model_s},
        "unigram": _row("unigram (train counts, add-one)", unigram),
    }
    if _DRAFT.value:
        dcfg, dparams = load_checkpoint(draft_dir, dtype=jnp.float32)
        dstats = jeval.lm_stats(dcfg, dparams, windows, batch_size=_BATCH_SIZE.value, progress=True)
        pair = jeval.pair_stats(
            (cfg, params), (dcfg, dparams), windows, batch_size=_BATCH_SIZE.value, progress=True
        )
        results["draft"] = {**_row(_DRAFT.value, dstats), "num_params": dcfg.num_params()}
        results["draft_vs_model"] = {"greedy_agreement": pair.agreement, "kl": pair.kl}
    common.write_results(str(workdir), results)

    print(f"test split, first {_MAX_TOKENS.value} tokens, windows {tuple(windows.shape)}")
    print(f"{'':34s} {'ppl':>9s} {'nll':>7s} {'top-1':>7s}")
    rows = [results["model"], results["unigram"]] + ([results["draft"]] if _DRAFT.value else [])
    for r in rows:
        print(
            f"{r['name'][-34:]:34s} {r['perplexity']:9.3f} {r['nll']:7.4f} "
            f"{r['top1_accuracy']:7.4f}"
        )
    if _DRAFT.value:
        dv = results["draft_vs_model"]
        print(
            f"draft greedy agreement {dv['greedy_agreement']:.4f}, KL(model||draft) {dv['kl']:.4f}"
        )


if __name__ == "__main__":
    app.run(main)
