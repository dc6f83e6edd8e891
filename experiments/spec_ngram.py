r"""Speculative decoding with the n-gram (prompt-lookup) drafter on any model, vs plain decoding.

    python -m experiments.spec_ngram --workdir=runs/spec_ngram --quick          # SmolLM2, ~2 min
    python -m experiments.spec_ngram --workdir=runs/spec_ngram --gammas=2,4,6 --batch_sizes=1,8
    python -m experiments.spec_ngram --config=runs/spec_ngram/config.json --workdir=runs/again

experiments/spec_bench.py needs a draft model with the target's vocabulary; no learned drafter
exists for SmolLM2 yet, so this bench runs `ji.speculative.generate(target, "ngram", ...)` only.
Prompts are windows of the shipped test split (Python source: code repeats itself, which is what
prompt lookup exploits) tokenized by the model's own tokenizer. Greedy decoding, so the output
must be token-identical to `ji.generate`; the bench checks it. Each time is the median of
--repeats calls, plain and speculative interleaved, after a compiling call of each.
Writes config.json, results.json and spec_ngram.md into --workdir.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer import data, memory

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "A ji.models name or a checkpoint path.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/spec_ngram", "Output directory.")
_CONFIG = common.config_flag()
_QUICK = flags.DEFINE_bool("quick", False, "gamma 4, batch 1 and 8, 2 repeats, 64 tokens.")
_GAMMAS = flags.DEFINE_list("gammas", ["2", "4", "6"], "Drafted tokens per cycle.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "New tokens per request.", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (median).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Prompt selection.", lower_bound=0)
flag_checks.int_list(_GAMMAS, min_value=1)
flag_checks.int_list(_BATCH_SIZES, min_value=1)


def test_prompts(tok, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` windows of `length` tokens from distinct test documents."""
    docs = data.load_split("test")
    rng = np.random.RandomState(seed)
    out = []
    for d in rng.permutation(len(docs)):
        ids = tok.encode(docs[d], add_special_tokens=False).ids
        if len(ids) >= length:
            start = int(rng.randint(0, len(ids) - length + 1))
            out.append(ids[start : start + length])
        if len(out) == n:
            return out
    raise ValueError(f"the test split has fewer than {n} documents of >= {length} tokens")


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    quick = _QUICK.value
    gammas = [4] if quick else [int(g) for g in _GAMMAS.value]
    batches = [int(b) for b in _BATCH_SIZES.value]
    n_new = 64 if quick else _MAX_TOKENS.value
    repeats = 2 if quick else _REPEATS.value
    path = common.resolve_model(_MODEL.value)
    common.save_config(_WORKDIR.value, resolved={"model": path})
    load0, t0 = common.load_average(), time.perf_counter()
    cfg, params, path = common.load_model(path)
    nbytes = memory.tree_bytes(params)  # the target's weights, read once a step or a cycle
    tok = ji.load_tokenizer(path)
    target = (cfg, params)
    sp = ji.SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    rows = []
    for b in batches:
        prompts = test_prompts(tok, b, _PROMPT_LEN.value, _SEED.value)
        plain = ji.generate(cfg, params, prompts, sp)  # compile
        for g in gammas:
            spec = ji.speculative.generate(target, "ngram", prompts, sp, gamma=g)  # compile
            same = all(p.token_ids == s.token_ids for p, s in zip(plain, spec))
            run_plain = lambda p=prompts: ji.generate(cfg, params, p, sp)  # noqa: E731
            run_spec = lambda p=prompts, g=g: ji.speculative.generate(  # noqa: E731
                target, "ngram", p, sp, gamma=g
            )
            t_plain, t_spec = [], []
            for _ in range(repeats):  # interleaved: both see the same machine load
                t_plain += common.times(run_plain, 1)
                t_spec += common.times(run_spec, 1)
            acc = sum(s.num_accepted for s in spec) / max(sum(s.num_proposed for s in spec), 1)
            cycles = sum(s.num_cycles for s in spec)
            passes = 1 + max(s.num_cycles for s in spec)  # prefill, then one pass a cycle
            tp, ts = statistics.median(t_plain), statistics.median(t_spec)
            row = {
                "batch": b, "gamma": g, "token_identical": same,
                "plain_tok_s": b * n_new / tp, "spec_tok_s": b * n_new / ts, "speedup": tp / ts,
                "plain_gb_s": common.gb_per_s(nbytes, n_new, tp),
                "spec_gb_s": common.gb_per_s(nbytes, passes, ts),
                "plain_s": common.spread(t_plain), "spec_s": common.spread(t_spec),
                "acceptance": acc, "tokens_per_cycle": b * (n_new - 1) / max(cycles, 1),
            }  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    res = {
        "model": _MODEL.value,
        "checkpoint": os.path.basename(path),
        "prompt_len": _PROMPT_LEN.value,
        "new_tokens": n_new,
        "weight_bytes": nbytes,
        "repeats": repeats,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "load_average": [load0, common.load_average()],
        "machine": f"{os.cpu_count()} cores",
    }
    lines = [
        f"Model `{res['model']}`, n-gram drafter, greedy, {res['prompt_len']}-token test-split "
        f"prompts, {n_new} new tokens, median of {repeats} interleaved runs; load average "
        f"{res['load_average'][0]:.1f} -> {res['load_average'][1]:.1f}; {res['seconds']:.0f} s.",
        "",
        "| batch | γ | plain tok/s | plain GB/s | n-gram tok/s | n-gram GB/s | speedup "
        "| acceptance | tokens/cycle | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['gamma']} | {r['plain_tok_s']:.1f} | {r['plain_gb_s']:.2f} | "
            f"{r['spec_tok_s']:.1f} | {r['spec_gb_s']:.2f} | "
            f"{r['speedup']:.2f}x | {100 * r['acceptance']:.0f}% | {r['tokens_per_cycle']:.2f} | "
            f"{'yes' if r['token_identical'] else 'NO'} |"
        )
    md = "\n".join(lines) + "\n"
    with open(os.path.join(_WORKDIR.value, "spec_ngram.md"), "w") as f:
        f.write(md)
    print(md)
    common.write_results(_WORKDIR.value, res)


if __name__ == "__main__":
    app.run(main)
