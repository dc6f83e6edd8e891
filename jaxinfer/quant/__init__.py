"""Quantization: weight formats, RTN / GPTQ / AWQ / SmoothQuant, KV-cache formats, artifacts.

    qcfg = ji.quant.QuantConfig(method="gptq", bits=4, group_size=128, act_order=True)
    qparams = ji.quant.quantize(cfg, params, qcfg, calib_tokens)      # [N, S] int32
    ji.quant.save(path, cfg, qparams, qcfg); cfg, qparams, qcfg = ji.quant.load(path)

The weight formats and the per-layer math import eagerly. The calibration driver, artifacts and
importers use the model, whose `ops.linear` imports `quant.formats`: they load on first use
(PEP 562), so `import jaxinfer.quant` never sits inside an import cycle.
"""

import importlib

# Eager: the weight formats, the per-weight methods and the KV-cache formats.
from jaxinfer.quant.awq import awq_clip_search, awq_scales, awq_search, scaled_quant_loss
from jaxinfer.quant.formats import (
    Int4Weight,
    Int8Weight,
    dequantize,
    dequantize_rows,
    is_quantized,
    make_int4,
    pack_int4,
    quantize_per_token,
    unpack_int4,
)
from jaxinfer.quant.gptq import gptq_quantize, hessian
from jaxinfer.quant.kv import dequantize_kv, kv_bytes_per_token, quantize_kv
from jaxinfer.quant.rtn import quantize_int8, rtn_quantize
from jaxinfer.quant.smoothquant import smooth_scales, smoothquant_weight

# Lazy: the calibration driver, artifacts and importers (they import the model).
_LAZY = {
    "QuantConfig": "calibrate",
    "QuantReport": "calibrate",
    "quantize_with_report": "calibrate",
    "quantize": "calibrate",
    "save": "artifact",
    "load": "artifact",
    "FORMAT_VERSION": "artifact",
    "import_gptq_linear": "importers",
    "import_awq_linear": "importers",
    "load_community_checkpoint": "importers",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"jaxinfer.quant.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jaxinfer.quant' has no attribute {name!r}")


__all__ = [
    "Int4Weight",
    "Int8Weight",
    "awq_clip_search",
    "awq_scales",
    "awq_search",
    "dequantize",
    "dequantize_kv",
    "dequantize_rows",
    "gptq_quantize",
    "hessian",
    "is_quantized",
    "kv_bytes_per_token",
    "make_int4",
    "pack_int4",
    "quantize_int8",
    "quantize_kv",
    "quantize_per_token",
    "rtn_quantize",
    "scaled_quant_loss",
    "smooth_scales",
    "smoothquant_weight",
    "unpack_int4",
    *_LAZY,
]
