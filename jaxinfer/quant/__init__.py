"""Quantization: weight formats, RTN / GPTQ / AWQ / SmoothQuant, KV-cache formats, artifacts.

    qcfg = ji.quant.QuantConfig(method="gptq", bits=4, group_size=128, act_order=True)
    qparams = ji.quant.quantize(cfg, params, qcfg, calib_tokens)      # [N, S] int32
    ji.quant.save(path, cfg, qparams, qcfg); cfg, qparams, qcfg = ji.quant.load(path)

The weight formats live in `jaxinfer.qtensor` and the KV-cache formats in
`jaxinfer.cache.kv_formats` (leaves the model, the ops and the cache import without importing
this package); they are re-exported here.
"""

# Formats (re-exported), per-weight methods, the calibration driver, artifacts and importers.
from jaxinfer.cache.kv_formats import dequantize_kv, kv_bytes_per_token, quantize_kv
from jaxinfer.qtensor import (
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
from jaxinfer.quant.artifact import FORMAT_VERSION, load, save
from jaxinfer.quant.awq import awq_clip_search, awq_scales, awq_search, scaled_quant_loss
from jaxinfer.quant.calibrate import quantize, quantize_with_report
from jaxinfer.quant.config import QuantConfig, QuantReport
from jaxinfer.quant.gptq import gptq_quantize, hessian
from jaxinfer.quant.importers import (
    import_awq_linear,
    import_gptq_linear,
    load_community_checkpoint,
)
from jaxinfer.quant.rtn import quantize_int8, rtn_quantize
from jaxinfer.quant.smoothquant import smooth_scales, smoothquant_weight

__all__ = [
    "FORMAT_VERSION",
    "Int4Weight",
    "Int8Weight",
    "QuantConfig",
    "QuantReport",
    "awq_clip_search",
    "awq_scales",
    "awq_search",
    "dequantize",
    "dequantize_kv",
    "dequantize_rows",
    "gptq_quantize",
    "hessian",
    "import_awq_linear",
    "import_gptq_linear",
    "is_quantized",
    "kv_bytes_per_token",
    "load",
    "load_community_checkpoint",
    "make_int4",
    "pack_int4",
    "quantize",
    "quantize_int8",
    "quantize_kv",
    "quantize_per_token",
    "quantize_with_report",
    "rtn_quantize",
    "save",
    "scaled_quant_loss",
    "smooth_scales",
    "smoothquant_weight",
    "unpack_int4",
]
