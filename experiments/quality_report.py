r"""Quantization quality report: every method and format on one model, against its float original.

    python -m experiments.quality_report --workdir=/tmp/jaxinfer_runs/quality
    python -m experiments.quality_report --quick --workdir=/tmp/jaxinfer_runs/quality_quick
    python -m experiments.quality_report --model=path/to/hf_dir --workdir=...

Rows: the float32 baseline; RTN, GPTQ, GPTQ with act order and AWQ at w4g128, w3g128 and w4
per channel (G = in); RTN int8 per channel (W8A16); naive W8A8 (the same int8 weights with
dynamic per-token int8 activations, no smoothing) next to SmoothQuant W8A8; int8 and fp8 KV
caches with float weights, scored through the paged forward (serving numerics,
`eval.compare_to_reference`). Columns: perplexity, Δppl (absolute and %), mean per-token
KL(baseline ‖ variant), top-1 agreement with the baseline, bits per weight of the decoder
linears, bytes of the params pytree (sum of leaf nbytes) and of the saved artifact on disk
(`quant.save`), calibration seconds. Also the share of RTN's perplexity gap to the baseline that
GPTQ and AWQ close, (ppl_RTN − ppl_method) / (ppl_RTN − ppl_base). GPTQ rows calibrate every
linear of a layer on the float layer's inputs; --gptq_true_sequential recomputes them through the
layer's already quantized linears (`QuantConfig.true_sequential`).

Calibration: the shipped calibration split (`data.calibration_batch`); quality: the standard
test windows (`eval.standard_windows`, 65,280 predicted tokens; --quick: 8,192, with 32
calibration sequences). Writes into --workdir: config.json, results.json, quality.md,
quality.png (perplexity against bits per weight) and memory.md (`memory_table`).

`run(model_dir, workdir, quick)` and `markdown(results)` are the quality stage of
`experiments/pipeline.py`; flags are defined only when this file runs as a script, so importing
it next to another absl script defines nothing.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from absl import logging as absl_logging

from experiments import common
from jaxinfer import data, memory, models, quant
from jaxinfer import eval as ji_eval
from jaxinfer.checkpoint import load_checkpoint, load_tokenizer
from jaxinfer.config import ModelConfig, preset
from jaxinfer.model.params import LINEAR_NAMES
from jaxinfer.qtensor import Int8Weight, is_quantized

QUICK_EVAL_TOKENS = 32 * ji_eval.EVAL_SEQ_LEN + 1  # 32 windows: 8,192 predicted tokens
QUICK_CALIB_SEQUENCES = 32
CALIB_SEQUENCES = 128  # x 256 tokens: 32 Ki calibration tokens, as experiments/quantize.py
SCHEMES = {"w4g128": (4, 128), "w3g128": (3, 128), "w4": (4, None)}  # name -> (bits, G)
GAP_SCHEMES = ("w3g128", "w4")  # where the goals ask GPTQ (act order) and AWQ to close >= 50%
GOALS = {"gap_closed": 0.5, "smoothquant_dppl_pct": 1.0, "int8_kv_dppl_pct": 0.5}
MEMORY_MODELS = ("llama2-7b", "llama3-8b", "mistral-7b", "qwen2.5-7b")
MEMORY_WEIGHTS = ("bf16", "w8", "w4g128", "w3g128")
MEMORY_KV = ("bf16", "int8", "fp8")
MEMORY_GPUS = {"80 GB": 80.0, "H200 141 GB": 141.0}  # GiB given to memory.memory_report
MEMORY_SEQ_LENS = (2048, 8192)


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    """The resolved settings of one report (written to config.json)."""

    model: str  # HF checkpoint directory
    quick: bool = False  # small budget: QUICK_EVAL_TOKENS, QUICK_CALIB_SEQUENCES
    calib_sequences: int = CALIB_SEQUENCES
    calib_seq_len: int = 256  # the shipped models' training window
    eval_tokens: int = ji_eval.EVAL_TOKENS  # test-stream budget of the standard windows
    seed: int = 0  # calibration draw
    block_size: int = 16  # KV block size of the paged (KV-format) rows
    gptq_true_sequential: bool = False  # GPTQ rows: QuantConfig.true_sequential


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row: how the model is changed before it is scored."""

    name: str  # row label
    family: str  # baseline | rtn | gptq | gptq-act | awq | rtn-w8 | naive-w8a8 | smoothquant | kv
    scheme: str  # w4g128 | w3g128 | w4 | w8 | w8a8 | fp32 | int8-kv | fp8-kv
    qcfg: quant.QuantConfig | None = None
    kv_format: str | None = None  # scored through the paged forward with this cache


def variants(gptq_true_sequential: bool = False) -> list[Variant]:
    """The rows of the report, in table order (GPTQ rows with the given true_sequential)."""
    out = [Variant("baseline (fp32)", "baseline", "fp32")]
    q = quant.QuantConfig
    seq = {"true_sequential": gptq_true_sequential}
    for scheme, (bits, g) in SCHEMES.items():
        out += [
            Variant(f"RTN {scheme}", "rtn", scheme, q("rtn", bits, g)),
            Variant(f"GPTQ {scheme}", "gptq", scheme, q("gptq", bits, g, **seq)),
            Variant(
                f"GPTQ act-order {scheme}",
                "gptq-act",
                scheme,
                q("gptq", bits, g, act_order=True, **seq),
            ),
            Variant(f"AWQ {scheme}", "awq", scheme, q("awq", bits, g)),
        ]
    w8 = q("rtn", 8, None)
    out += [
        Variant("RTN w8 (W8A16)", "rtn-w8", "w8", w8),
        Variant("naive W8A8 (RTN, no smoothing)", "naive-w8a8", "w8a8", w8),
        Variant("SmoothQuant W8A8", "smoothquant", "w8a8", q("smoothquant", 8, None)),
        Variant("int8 KV (fp32 weights)", "kv", "int8-kv", kv_format="int8"),
        Variant("fp8 KV (fp32 weights)", "kv", "fp8-kv", kv_format="fp8"),
    ]
    return out


# --------------------------------------------------------------------------------------------
# Measurements that are not perplexity
# --------------------------------------------------------------------------------------------


def with_dynamic_activations(qparams: dict) -> dict:
    """Every `Int8Weight` switched to W8A8 (dynamic per-token int8 activations), unsmoothed."""
    return jax.tree.map(
        lambda w: dataclasses.replace(w, act_quant=True) if isinstance(w, Int8Weight) else w,
        qparams,
        is_leaf=is_quantized,
    )


def artifact_disk_bytes(cfg: ModelConfig, qparams: dict, qcfg: quant.QuantConfig) -> int:
    """Bytes on disk of `quant.save(qparams)` (an orbax directory), written to a temp dir."""
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every step of a save at INFO
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "artifact")
            quant.save(path, cfg, qparams, qcfg)
            return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    finally:
        absl_logging.set_verbosity(verbosity)


def _mean_layer_error(report: quant.QuantReport) -> dict[str, float]:
    """Mean over layers of each linear's relative output error ‖X(W − Ŵ)‖² / ‖XW‖²."""
    names = list(report.errors[0])
    return {n: float(np.mean([e[n] for e in report.errors])) for n in names}


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def resolve_config(
    model_dir: str | None = None,
    quick: bool = False,
    calib_sequences: int | None = None,
    calib_seq_len: int = 256,
    eval_tokens: int | None = None,
    seed: int = 0,
    gptq_true_sequential: bool = False,
) -> ReportConfig:
    """A ReportConfig from optional settings: the shipped target and the standard budgets."""
    model_dir = model_dir or models.path("target")
    if not os.path.isdir(model_dir):
        model_dir = models.path(model_dir)  # a shipped model's name
    default_calib = QUICK_CALIB_SEQUENCES if quick else CALIB_SEQUENCES
    default_eval = QUICK_EVAL_TOKENS if quick else ji_eval.EVAL_TOKENS
    return ReportConfig(
        model=str(model_dir),
        quick=quick,
        calib_sequences=calib_sequences or default_calib,
        calib_seq_len=calib_seq_len,
        eval_tokens=eval_tokens or default_eval,
        seed=seed,
        gptq_true_sequential=gptq_true_sequential,
    )


def gap_closed(ppl_base: float, ppl_rtn: float, ppl_method: float) -> float | None:
    """(ppl_RTN − ppl_method) / (ppl_RTN − ppl_base); None when RTN has no gap to close."""
    gap = ppl_rtn - ppl_base
    return None if gap <= 0 else (ppl_rtn - ppl_method) / gap


def build_variants(
    cfg: ModelConfig,
    params: dict,
    calib: np.ndarray,
    base_disk: int | None,
    progress: bool,
    gptq_true_sequential: bool = False,
) -> tuple[list[dict], dict]:
    """Quantizes the model for every row of `variants(gptq_true_sequential)`.

    Returns:
      (rows without quality figures: bytes, bits per weight, calibration seconds and per-linear
      errors; candidates name -> (cfg, params, kv_format) for `eval.compare_to_reference`).
    """
    rows, candidates, rtn_w8 = [], {}, None
    for v in variants(gptq_true_sequential):
        cpu0 = time.process_time()
        row = {"name": v.name, "family": v.family, "scheme": v.scheme, "kv_format": v.kv_format}
        row["quant_config"] = None if v.qcfg is None else v.qcfg.to_dict()
        if v.qcfg is None:  # baseline and KV rows: float weights
            qparams, seconds, errors, notes, disk = params, 0.0, None, [], base_disk
        elif v.family == "naive-w8a8":  # RTN int8 weights reused, activations made dynamic
            qparams, seconds, errors, notes = with_dynamic_activations(rtn_w8[0]), *rtn_w8[1:]
            disk = artifact_disk_bytes(cfg, qparams, v.qcfg)
        else:
            qparams, rep = quant.quantize_with_report(cfg, params, v.qcfg, calib)
            seconds, errors, notes = rep.seconds, _mean_layer_error(rep), rep.notes
            disk = artifact_disk_bytes(cfg, qparams, v.qcfg)
            if v.family == "rtn-w8":
                rtn_w8 = (qparams, seconds, errors, notes)
        row.update(
            calib_seconds=seconds,
            build_cpu_seconds=time.process_time() - cpu0,  # calibration + save, all threads
            mean_layer_error=errors,
            notes=notes,
            param_bytes=memory.tree_bytes(qparams),
            linear_bytes=memory.tree_bytes({n: qparams["layers"][n] for n in LINEAR_NAMES}),
            artifact_disk_bytes=disk,
            **memory.bits_per_weight(qparams),
        )
        rows.append(row)
        if v.family != "baseline":
            candidates[v.name] = (cfg, qparams, v.kv_format)
        if progress:
            print(f"built {v.name}: calibration {seconds:.1f} s", flush=True)
    return rows, candidates


def gaps_and_goals(rows: list[dict], ppl_base: float) -> tuple[dict, dict, dict]:
    """(ppl gap closed, KL gap closed, goals) from the scored rows."""
    by = {(r["family"], r["scheme"]): r for r in rows}
    gaps, kl_gaps = {}, {}
    for scheme in SCHEMES:
        rtn = by[("rtn", scheme)]
        for fam in ("gptq", "gptq-act", "awq"):
            m = by[(fam, scheme)]
            gaps[f"{fam} {scheme}"] = gap_closed(ppl_base, rtn["ppl"], m["ppl"])
            kl_gaps[f"{fam} {scheme}"] = gap_closed(0.0, rtn["kl"], m["kl"])
    goals = {}
    for scheme in GAP_SCHEMES:
        for fam in ("gptq-act", "awq"):
            g = gaps[f"{fam} {scheme}"]
            goals[f"{fam} {scheme} closes >= 50% of RTN's gap"] = {
                "value": g,
                "met": g is not None and g >= GOALS["gap_closed"],
            }
    sq = by[("smoothquant", "w8a8")]["dppl_pct"]
    goals["SmoothQuant W8A8 within 1% of baseline ppl"] = {
        "value": sq,
        "met": abs(sq) <= GOALS["smoothquant_dppl_pct"],
    }
    kv8 = by[("kv", "int8-kv")]["dppl_pct"]
    goals["int8 KV within 0.5% of baseline ppl"] = {
        "value": kv8,
        "met": abs(kv8) <= GOALS["int8_kv_dppl_pct"],
    }
    return gaps, kl_gaps, goals


def run(
    model_dir: str | None = None,
    workdir: str | None = None,
    quick: bool = False,
    *,
    config: ReportConfig | None = None,
    progress: bool = True,
) -> dict:
    """Quantizes the model every way of `variants()`, scores every row, writes the report.

    Args:
      model_dir: HF checkpoint directory or shipped model name; None: the shipped target.
      workdir: where config.json, results.json, quality.md, quality.png, memory.md go; None
        writes nothing. (Inside the pipeline give it a subdirectory: the names are generic.)
      quick: the small budget (8,192 predicted tokens, 32 calibration sequences).
      config: full settings (overrides model_dir and quick).
      progress: print each row as it is built and show progress bars.

    Returns:
      The results dict (see results.json): "config", "rows", "gap_closed", "kl_gap_closed",
      "goals", "gptq_seconds", "seconds", "machine", ...
    """
    cfg_r = config or resolve_config(model_dir, quick)
    if workdir:  # the run's config.json first, and no results.json of an earlier run beside it
        common.save_config(workdir, resolved=dataclasses.asdict(cfg_r), script="quality_report")
    start, cpu_start = time.perf_counter(), time.process_time()
    cfg, params = load_checkpoint(cfg_r.model, dtype=jnp.float32)
    tok = load_tokenizer(cfg_r.model)
    calib = data.calibration_batch(tok, cfg_r.calib_sequences, cfg_r.calib_seq_len, cfg_r.seed)
    windows = ji_eval.standard_windows(tok, max_tokens=cfg_r.eval_tokens)

    safetensors = Path(cfg_r.model) / "model.safetensors"
    base_disk = safetensors.stat().st_size if safetensors.is_file() else None
    rows, candidates = build_variants(
        cfg, params, calib, base_disk, progress, cfg_r.gptq_true_sequential
    )
    ref, stats = ji_eval.compare_to_reference(
        (cfg, params), candidates, windows, block_size=cfg_r.block_size, progress=progress
    )
    ppl_base = ref.perplexity
    for row in rows:
        s = ref if row["family"] == "baseline" else stats[row["name"]]
        row.update(
            ppl=s.perplexity,
            nll=s.nll,
            top1_accuracy=s.accuracy,
            dppl=s.perplexity - ppl_base,
            dppl_pct=100.0 * (s.perplexity - ppl_base) / ppl_base,
            kl=s.kl,
            top1_agreement=s.agreement,
        )
    gaps, kl_gaps, goals = gaps_and_goals(rows, ppl_base)
    gptq_rows = [r for r in rows if r["family"] in ("gptq", "gptq-act")]
    results = {
        "config": dataclasses.asdict(cfg_r),
        "model_config": {"num_params": cfg.num_params(), **_cfg_summary(cfg)},
        "eval_windows": list(windows.shape),
        "eval_tokens": int(windows[:, 1:].size),
        "calib_tokens": list(calib.shape),
        "baseline_ppl": ppl_base,
        "rows": rows,
        "gap_closed": gaps,
        "kl_gap_closed": kl_gaps,
        "goals": goals,
        "gptq_seconds": {f"{r['family']} {r['scheme']}": r["calib_seconds"] for r in gptq_rows},
        "gptq_build_cpu_seconds": {
            f"{r['family']} {r['scheme']}": r["build_cpu_seconds"] for r in gptq_rows
        },
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "machine": f"{os.cpu_count()} cores, {jax.default_backend()}",
    }
    if workdir:
        write_outputs(workdir, results, cfg)
    return results


def _cfg_summary(cfg: ModelConfig) -> dict:
    keys = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads")
    return {k: getattr(cfg, k) for k in keys}


def write_outputs(workdir: str, results: dict, cfg: ModelConfig | None = None) -> None:
    """quality.md, quality.png, (with cfg) memory.md, and last results.json (atomically)."""
    os.makedirs(workdir, exist_ok=True)
    plot(results, os.path.join(workdir, "quality.png"))
    with open(os.path.join(workdir, "quality.md"), "w") as f:
        f.write(markdown(results, plot_file="quality.png"))
    if cfg is not None:
        with open(os.path.join(workdir, "memory.md"), "w") as f:
            f.write(memory_table(cfg))
    common.write_results(workdir, results)


# --------------------------------------------------------------------------------------------
# Presentation
# --------------------------------------------------------------------------------------------


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def markdown(results: dict, plot_file: str | None = None) -> str:
    """The quality table, gap-closed figures, goals and timings as markdown.

    Args:
      results: what `run` returned.
      plot_file: a PNG path to embed (relative to the markdown file), or None.

    Returns:
      Markdown text.
    """
    c = results["config"]
    lines = [
        "## Quantization quality",
        "",
        f"Model `{c['model']}` ({results['model_config']['num_params'] / 1e6:.2f} M params). "
        f"{results['eval_tokens']:,} predicted test tokens ({results['eval_windows'][0]} windows "
        f"of {results['eval_windows'][1] - 1}); calibration {results['calib_tokens'][0]} x "
        f"{results['calib_tokens'][1]} tokens of the calibration split. KL is KL(baseline ‖ "
        "row) in nats/token; agreement is top-1 agreement with the baseline. bpw: bits per "
        "weight of the decoder linears (ideal packing / as stored: 4-bit containers, int32 zero "
        "points). KV rows run through the paged forward with the quantized cache.",
        "",
        "| variant | ppl | Δppl | Δppl % | KL | top-1 agree | bpw ideal / stored | params "
        "bytes | artifact on disk | calib s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['name']} | {r['ppl']:.3f} | {r['dppl']:+.3f} | {r['dppl_pct']:+.2f}% | "
            f"{r['kl']:.2e} | {100 * r['top1_agreement']:.2f}% | {r['bpw_ideal']:.2f} / "
            f"{r['bpw_stored']:.2f} | {_fmt_bytes(r['param_bytes'])} | "
            f"{_fmt_bytes(r['artifact_disk_bytes'])} | {r['calib_seconds']:.1f} |"
        )
    lines += [
        "",
        "Baseline artifact on disk: the float32 `model.safetensors`. Calibration seconds include "
        "jit compilation and, for RTN, the layer-by-layer error report; naive W8A8 reuses the "
        "RTN w8 weights.",
        "",
        "### Share of RTN's gap to the baseline that a method closes",
        "",
        "perplexity: (ppl_RTN − ppl) / (ppl_RTN − ppl_base); KL: (KL_RTN − KL) / KL_RTN. GPTQ "
        + (
            "calibrates true sequentially (each linear on the inputs from the layer's already "
            "quantized linears)."
            if c.get("gptq_true_sequential", False)
            else "calibrates every linear of a layer on the float layer's inputs "
            "(true_sequential=False)."
        ),
        "",
        "| method | " + " | ".join(f"{s} ppl | {s} KL" for s in SCHEMES) + " |",
        "|---|" + "---|---|" * len(SCHEMES),
    ]
    for fam, label in (("gptq", "GPTQ"), ("gptq-act", "GPTQ act-order"), ("awq", "AWQ")):
        cells = []
        for scheme in SCHEMES:
            for key in ("gap_closed", "kl_gap_closed"):
                g = results[key][f"{fam} {scheme}"]
                cells.append("-" if g is None else f"{100 * g:.0f}%")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    notes = sorted({n for r in results["rows"] for n in r["notes"]})
    if notes:
        lines += ["", "Notes from calibration:", ""] + [f"- {n}" for n in notes]
    lines += ["", "### Goals", ""]
    for goal, g in results["goals"].items():
        v = g["value"]
        shown = "-" if v is None else (f"{100 * v:.0f}%" if "gap" in goal else f"{v:+.2f}%")
        lines.append(f"- {'met' if g['met'] else '**NOT MET**'}: {goal} ({shown})")
    gptq = ", ".join(
        f"{k}: {v:.1f} s ({results['gptq_build_cpu_seconds'][k]:.1f} s CPU)"
        for k, v in results["gptq_seconds"].items()
    )
    load = results.get("load_average")
    lines += [
        "",
        f"GPTQ of the whole model, wall (CPU of calibration + artifact save): {gptq}. Report "
        f"wall time {results['seconds']:.0f} s ({results['cpu_seconds']:.0f} s CPU, "
        f"{results['machine']}"
        + ("" if load is None else f", load average {load:.1f} at the end")
        + ").",
    ]
    if plot_file:
        lines += ["", f"![perplexity against bits per weight]({plot_file})"]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    """Perplexity against (ideal) bits per weight, one line per method; baseline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"rtn": "o-", "gptq": "s-", "gptq-act": "^-", "awq": "D-"}
    labels = {"rtn": "RTN", "gptq": "GPTQ", "gptq-act": "GPTQ act-order", "awq": "AWQ"}
    for fam, style in styles.items():
        for per_channel in (False, True):
            pts = sorted(
                (r["bpw_ideal"], r["ppl"])
                for r in rows
                if r["family"] == fam and (r["scheme"] == "w4") == per_channel
            )
            if pts:
                label = labels[fam] + (" (per channel)" if per_channel else " (g128)")
                color = f"C{list(styles).index(fam)}"
                alpha = 0.5 if per_channel else 1.0
                ax.plot(*zip(*pts), style, color=color, alpha=alpha, label=label)
    for fam, marker in (("rtn-w8", "x"), ("naive-w8a8", "v"), ("smoothquant", "*")):
        for r in rows:
            if r["family"] == fam:
                ax.plot(r["bpw_ideal"], r["ppl"], marker, markersize=9, label=r["name"])
    base = next(r for r in rows if r["family"] == "baseline")
    ax.axhline(results["baseline_ppl"], color="k", ls="--", lw=1)
    ax.plot(base["bpw_ideal"], base["ppl"], "k+", markersize=10, label="baseline fp32")
    ax.set_xscale("log", base=2)
    ax.set_xticks([3, 4, 5, 8, 16, 32], ["3", "4", "5", "8", "16", "32"])
    ax.set_xlabel("bits per weight of the decoder linears (codes + scales + zeros)")
    ax.set_ylabel("test perplexity")
    ax.set_title(f"Quantization quality, {results['eval_tokens']:,} test tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def memory_table(cfg: ModelConfig, name: str = "target") -> str:
    """Markdown: weights, KV bytes per token and sequences that fit, for `cfg` and the presets.

    Args:
      cfg: the shipped target's config (any ModelConfig; weight formats must divide its dims).
      name: its display name.

    Returns:
      `memory.markdown_table` of `memory.memory_table`: one row per model x weight format
      (bf16, w8, w4g128, w3g128) x KV format (bf16, int8, fp8), with the sequences of 2048 and
      8192 tokens whose KV fits in an 80 GiB and a 141 GiB (H200) GPU beside the weights and a
      2 GiB reserve, every model deployed in bf16 (embeddings, scales, norms).
    """
    configs = {name: cfg, **{m: preset(m) for m in MEMORY_MODELS}}
    rows = memory.memory_table(
        {m: c.replace(dtype="bfloat16") for m, c in configs.items()}, MEMORY_WEIGHTS, MEMORY_KV,
        seq_lens=MEMORY_SEQ_LENS, gpus=MEMORY_GPUS,
    )  # fmt: skip
    lines = [
        "## Memory: weights, KV cache and sequences that fit",
        "",
        "Computed from shapes (`jaxinfer.memory`): weight bytes of the stored layout (scales and "
        "zero points included; w3 takes w4's 4-bit containers), KV bytes per token (int8 / fp8 "
        "with a float32 scale per token and head), and how many sequences of N tokens fit in "
        "the GPU's memory (GiB) beside the weights and a 2 GiB reserve, KV blocks of 16 tokens.",
        "",
    ]
    return "\n".join(lines) + "\n" + memory.markdown_table(rows)


# --------------------------------------------------------------------------------------------
# Script
# --------------------------------------------------------------------------------------------


_MODEL = flags.DEFINE_string("model", None, "HF dir or shipped model name; default: the target.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the report goes.")
_QUICK = flags.DEFINE_bool("quick", False, "Small budget: 8,192 test tokens, 32 calib sequences.")
_CALIB_SEQUENCES = flags.DEFINE_integer(
    "calib_sequences", None, "Calibration sequences (default 128; quick 32).", lower_bound=1
)
_CALIB_SEQ_LEN = flags.DEFINE_integer(
    "calib_seq_len", 256, "Tokens per calibration sequence.", lower_bound=1
)
_EVAL_TOKENS = flags.DEFINE_integer(
    "eval_tokens", None, "Test-stream token budget (default 65,536).", lower_bound=1
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the calibration draw.", lower_bound=0)
_TRUE_SEQUENTIAL = flags.DEFINE_bool(
    "gptq_true_sequential", False, "GPTQ rows: QuantConfig.true_sequential."
)
_CONFIG = common.config_flag()
flags.mark_flag_as_required("workdir")


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    config = resolve_config(
        _MODEL.value,
        _QUICK.value,
        _CALIB_SEQUENCES.value,
        _CALIB_SEQ_LEN.value,
        _EVAL_TOKENS.value,
        _SEED.value,
        _TRUE_SEQUENTIAL.value,
    )
    results = run(workdir=_WORKDIR.value, config=config)
    print(markdown(results))
    print(f"wrote {_WORKDIR.value}/quality.md, quality.png, memory.md, results.json")


if __name__ == "__main__":
    app.run(main)
