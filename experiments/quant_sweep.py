r"""A quantization quality sweep on any model, with group sizes that divide its widths.

    python experiments/quant_sweep.py --workdir=runs/quant_sweep --quick      # SmolLM2, ~5 min
    python experiments/quant_sweep.py --workdir=runs/quant_sweep              # + GPTQ act-order,
                                                                              #   AWQ, SmoothQuant
    python experiments/quant_sweep.py --config=runs/quant_sweep/config.json --workdir=runs/again

experiments/quality_report.py is the full report on the tiny pair; its schemes are g128, which
SmolLM2 (hidden 576 = 4.5 x 128) cannot take. This sweep runs on any `--model` (a name of
`ji.models.names()` or a path) with --group_sizes (default 64 and 32, which divide 576 and 1536,
plus per-channel), scores every row against the float32 model in one pass over the test split
(`eval.compare_to_reference`: perplexity, top-1, KL to float, argmax agreement) and writes
config.json, results.json and quant_sweep.md into --workdir.

--quick rows: RTN w4 at each group size and per channel, GPTQ w4 at the first group size, RTN
w8 (W8A16), int8 KV. Without --quick: GPTQ, GPTQ act-order and AWQ at every group size and per
channel, SmoothQuant W8A8 and fp8 KV.
"""

from __future__ import annotations

import os
import time

import jax.numpy as jnp
from absl import app, flags

import jaxinfer as ji
from jaxinfer import eval as ji_eval
from jaxinfer import quant

try:
    from experiments import common, flag_checks
except ImportError:  # run as `python experiments/X.py`: experiments/ itself is on sys.path
    import common
    import flag_checks

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "A ji.models name or a checkpoint path.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/quant_sweep", "Output directory.")
_CONFIG = flags.DEFINE_string("config", None, "Rerun a saved <workdir>/config.json.")
_QUICK = flags.DEFINE_bool("quick", False, "The short row set and budget (see the docstring).")
_GROUPS = flags.DEFINE_list("group_sizes", ["64", "32"], "w4 group sizes (per channel is added).")
_EVAL_TOKENS = flags.DEFINE_integer(
    "eval_tokens", None, "Test tokens; default 4,097 with --quick, else 16,385.", lower_bound=2
)
_CALIB = flags.DEFINE_integer(
    "calib_sequences", None, "Calibration sequences of 256; default 8 quick, 32.", lower_bound=1
)
_SEED = flags.DEFINE_integer("seed", 0, "Calibration draw.", lower_bound=0)
_ROWS = flags.DEFINE_list(
    "rows", [], "Only the rows with these names (see `rows`); default: every row of the set."
)
flag_checks.int_list(_GROUPS, min_value=8)


def rows(quick: bool) -> list[tuple[str, quant.QuantConfig | None, str | None]]:
    """(name, QuantConfig or None for float weights, KV format or None) in table order."""
    q = quant.QuantConfig
    gs = [int(g) for g in _GROUPS.value]
    settings = [(f"g{g}", g) for g in gs] + [("per-channel", None)]
    out = [(f"RTN w4 {n}", q("rtn", 4, g), None) for n, g in settings]
    if quick:
        out += [(f"GPTQ w4 {settings[0][0]}", q("gptq", 4, gs[0]), None)]
    else:  # every calibrated method at every group size
        out += [(f"GPTQ w4 {n}", q("gptq", 4, g), None) for n, g in settings]
        out += [(f"GPTQ act-order w4 {n}", q("gptq", 4, g, act_order=True), None)
                for n, g in settings]  # fmt: skip
        out += [(f"AWQ w4 {n}", q("awq", 4, g), None) for n, g in settings]
    out += [("RTN w8 (W8A16)", q("rtn", 8, None), None)]
    if not quick:
        out += [("SmoothQuant W8A8", q("smoothquant", 8, None), None)]
    out += [("int8 KV (fp32 weights)", None, "int8")]
    if not quick:
        out += [("fp8 KV (fp32 weights)", None, "fp8")]
    return out


def markdown(res: dict) -> str:
    lines = [
        f"Model `{res['model']}`, {res['eval_tokens']} test tokens, "
        f"{res['calib_sequences']} calibration sequences of 256; load average "
        f"{res['load_average'][0]:.1f} -> {res['load_average'][1]:.1f}; {res['seconds']:.0f} s.",
        "",
        "| weights | perplexity | Δppl | top-1 | KL to fp32 | argmax agreement | build s |",
        "|---|---|---|---|---|---|---|",
    ]
    base = res["baseline"]["ppl"]
    lines.append(f"| float32 | {base:.3f} | - | {100 * res['baseline']['top1']:.1f}% | - | - | - |")
    for r in res["rows"]:
        lines.append(
            f"| {r['name']} | {r['ppl']:.3f} | {100 * (r['ppl'] - base) / base:+.1f}% | "
            f"{100 * r['top1']:.1f}% | {r['kl']:.4f} | {100 * r['agreement']:.1f}% | "
            f"{r['build_seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    if _CONFIG.value:
        common.apply_config(_CONFIG.value)
    quick = _QUICK.value
    common.save_config(_WORKDIR.value)
    load0, t0 = common.load_average(), time.perf_counter()
    cfg, params, path = common.load_model(_MODEL.value, dtype=jnp.float32)
    tok = ji.load_tokenizer(path)
    budget = _EVAL_TOKENS.value or (16 * 256 + 1 if quick else 64 * 256 + 1)
    windows = common.test_windows(tok, cfg, budget)  # [N, 257]
    n_calib = _CALIB.value or (8 if quick else 32)
    calib = common.calib_batch(tok, cfg, n_calib, 256, _SEED.value)  # [n_calib, 256]
    todo = rows(quick)
    unknown = set(_ROWS.value) - {r[0] for r in todo}
    if unknown:
        raise ValueError(
            f"--rows has {sorted(unknown)}, not rows of this set: {[r[0] for r in todo]}"
        )
    todo = [r for r in todo if not _ROWS.value or r[0] in _ROWS.value]
    built, candidates = [], {}
    for name, qcfg, kv in todo:
        tb = time.perf_counter()
        qparams = (
            params if qcfg is None else quant.quantize_with_report(cfg, params, qcfg, calib)[0]
        )
        built.append({"name": name, "quant_config": qcfg and qcfg.to_dict(), "kv_format": kv,
                      "build_seconds": time.perf_counter() - tb})  # fmt: skip
        candidates[name] = (cfg, qparams, kv)
        print(f"built {name} in {built[-1]['build_seconds']:.1f} s", flush=True)
    bs = 4  # [4, 256, V] float32 logits per candidate
    ref, stats = ji_eval.compare_to_reference(
        (cfg, params), candidates, windows, batch_size=bs, progress=True
    )
    for r in built:
        s = stats[r["name"]]
        r.update(ppl=s.perplexity, nll=s.nll, top1=s.accuracy, kl=s.kl, agreement=s.agreement)
    res = {
        "model": _MODEL.value,
        "checkpoint": os.path.basename(path),
        "eval_tokens": int(windows[:, 1:].size),
        "calib_sequences": n_calib,
        "baseline": {"ppl": ref.perplexity, "nll": ref.nll, "top1": ref.accuracy},
        "rows": built,
        "seconds": time.perf_counter() - t0,
        "load_average": [load0, common.load_average()],
        "machine": f"{os.cpu_count()} cores",
    }
    common.write_json(_WORKDIR.value, "results.json", res)
    md = markdown(res)
    with open(os.path.join(_WORKDIR.value, "quant_sweep.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    app.run(main)
