r"""Quantize a model (RTN, GPTQ, AWQ, SmoothQuant) layer by layer and save the artifact.

    python -m experiments.quantize --method=gptq --bits=4 --group_size=128 --act_order \
        --workdir=/tmp/jaxinfer_runs/gptq_w4g128
    python -m experiments.quantize --model=path/to/hf_dir --method=smoothquant --bits=8 \
        --workdir=/tmp/jaxinfer_runs/sq

Calibration sequences come from the shipped calibration split (`data.calibration_batch`).
Writes `<workdir>/config.json` (the flags), `<workdir>/results.json` (calibration seconds,
per-layer relative output errors ‖X(W − Ŵ)‖² / ‖XW‖², notes) and the orbax artifact
`<workdir>/artifact` (load it with `jaxinfer.quant.load`), and prints the per-layer errors.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from absl import app, flags

from experiments import common
from jaxinfer import data, quant
from jaxinfer.checkpoint import load_checkpoint

_MODEL = flags.DEFINE_string("model", "target", "HF dir, or the name of a shipped model.")
_METHOD = flags.DEFINE_enum("method", "gptq", ["rtn", "gptq", "awq", "smoothquant"], "Method.")
_BITS = flags.DEFINE_integer("bits", 4, "2, 3, 4 (int4 containers); 8 for rtn (W8A16) / sq.")
_GROUP = flags.DEFINE_integer("group_size", 128, "Group size G; 0 or -1 for per channel.")
_ACT_ORDER = flags.DEFINE_bool("act_order", False, "GPTQ: sweep inputs by decreasing diag(H).")
_STATIC = flags.DEFINE_bool("static_groups", True, "GPTQ act order: grids from original W.")
_SYM = flags.DEFINE_bool("sym", False, "Symmetric grids.")
_DAMP = flags.DEFINE_float("damp", 0.01, "GPTQ dampening (fraction of mean diag H).")
_ALPHA = flags.DEFINE_float("alpha", 0.5, "SmoothQuant migration strength.")
_LM_HEAD = flags.DEFINE_bool("quantize_lm_head", False, "Quantize the LM head too.")
_SAMPLES = flags.DEFINE_integer("calib_samples", 128, "Calibration sequences.", lower_bound=1)
_LEN = flags.DEFINE_integer("calib_len", 256, "Tokens per calibration sequence.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the calibration draw.", lower_bound=0)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Params.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json, results.json, artifact go.")
_CONFIG = common.config_flag()
flags.mark_flag_as_required("workdir")
_QUANT_FLAGS = (
    "method", "bits", "group_size", "sym", "damp", "act_order", "static_groups", "alpha",
    "quantize_lm_head",
)  # fmt: skip


def quant_config(values: dict) -> quant.QuantConfig:
    """The QuantConfig the quantization flags (name -> value) describe; ValueError if invalid."""
    g = values["group_size"]
    return quant.QuantConfig(
        method=values["method"],
        bits=values["bits"],
        group_size=None if g in (0, -1) else g,
        sym=values["sym"],
        damp=values["damp"],
        act_order=values["act_order"],
        static_groups=values["static_groups"],
        alpha=values["alpha"],
        quantize_lm_head=values["quantize_lm_head"],
    )


def _check_quant_flags(values: dict) -> bool:
    try:
        quant_config(values)
    except ValueError as e:  # QuantConfig names the field; the flag has the same name
        raise flags.ValidationError(f"invalid quantization flags: {e}") from e
    return True


# At parse time, before the workdir is created: QuantConfig validates every field.
flags.register_multi_flags_validator(list(_QUANT_FLAGS), _check_quant_flags)


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    workdir = Path(_WORKDIR.value)
    model_dir = common.resolve_model(_MODEL.value)
    qcfg = quant_config({name: flags.FLAGS[name].value for name in _QUANT_FLAGS})
    resolved = {"model": model_dir, "quant_config": qcfg.to_dict()}
    common.save_config(str(workdir), resolved=resolved)

    cfg, params = load_checkpoint(model_dir, dtype=jnp.dtype(_DTYPE.value))
    calib = data.calibration_batch(data.load_tokenizer(), _SAMPLES.value, _LEN.value, _SEED.value)
    qparams, report = quant.quantize_with_report(cfg, params, qcfg, calib, progress=True)
    quant.save(str(workdir / "artifact"), cfg, qparams, qcfg, overwrite=True)

    names = list(report.errors[0])
    print(f"{qcfg.method} w{qcfg.bits} g{qcfg.group_size}: calibration {report.seconds:.1f} s")
    print("layer " + " ".join(f"{n:>9}" for n in names))
    for i, errs in enumerate(report.errors):
        print(f"{i:>5} " + " ".join(f"{errs[n]:>9.2e}" for n in names))
    if report.lm_head_error is not None:
        print(f"lm_head {report.lm_head_error:.2e}")
    for note in report.notes:
        print(f"note: {note}")
    results = {
        "calibration_seconds": report.seconds,
        "calib_tokens": list(calib.shape),
        "report": report.to_dict(),
        "artifact": str(workdir / "artifact"),
    }
    common.write_results(str(workdir), results)


if __name__ == "__main__":
    app.run(main)
