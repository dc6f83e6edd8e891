"""Memory report: weight bytes, KV bytes per token and how many sequences fit on a GPU.

Everything is computed from shapes, allocating nothing: the dense params come from
`jax.eval_shape` of the model's `init_params` (`model.param_shapes`), and a quantized format's
params from `jax.eval_shape` of the same RTN quantizer that builds real artifacts, so the figures
are the byte counts of the artifact's arrays (scales and zero points included).

Weight formats: "fp32", "bf16", "fp16" (dense), "w8" (int8 per output channel, W8A16),
"w8a8" (the same bytes, SmoothQuant), "wB" (B = 2, 3, 4 bits per output channel) and "wBgG"
(groups of G input rows), e.g. "w4g128". Int4Weight stores 2/3/4-bit codes in 4-bit containers
and int32 zero points, so "w3g128" takes the bytes of "w4g128": the report is of the stored
layout, not of an ideal bit count. Embeddings and the LM head stay in the model dtype.
KV formats: "fp32", "bf16", "fp16", "int8", "fp8" (the last two with a float32 scale per
(token, head) for K and for V).

`memory_table` builds the table of every model x weight format x KV format, with the
sequences that fit per GPU and length, and `markdown_table` prints it; `tree_bytes` and
`bits_per_weight` measure a real params pytree the same way.

Sizes: GB = 1e9 bytes, GiB = 2**30 bytes. A 7e9-parameter model in BF16 is 14.0 GB = 13.04 GiB;
llama2-7b has 6.74e9 parameters: 13.48 GB = 12.55 GiB.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp

from jaxinfer.cache.kv_formats import kv_bytes_per_token as _kv_bytes
from jaxinfer.config import ModelConfig
from jaxinfer.model.params import LINEAR_NAMES, param_shapes
from jaxinfer.qtensor import Int4Weight, Int8Weight, resolve_group_size
from jaxinfer.quant.rtn import quantize_int8, rtn_quantize

GB = 10**9
GIB = 2**30
MIB = 2**20
DENSE_FORMATS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
KV_FORMATS = ("fp32", "bf16", "fp16", "int8", "fp8")
_QUANT_RE = re.compile(r"^w([2348])(?:a8)?(?:g(\d+))?$")


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """A parsed weight format name."""

    name: str
    bits: int  # 32/16 for dense, 8, 4, 3 or 2
    group_size: int | None  # None: per output channel
    act_quant: bool = False  # w8a8

    @property
    def dense(self) -> bool:
        return self.name in DENSE_FORMATS


def parse_weight_format(name: str) -> WeightFormat:
    """Parses "bf16", "w8", "w8a8", "w4g128", ...; ValueError names the expected forms."""
    if name in DENSE_FORMATS:
        return WeightFormat(name, 32 if name == "fp32" else 16, None)
    m = _QUANT_RE.match(name)
    if not m or (m.group(1) == "8" and m.group(2)) or ("a8" in name and m.group(1) != "8"):
        raise ValueError(
            f"weight format {name!r}; expected one of {sorted(DENSE_FORMATS)}, 'w8', 'w8a8', "
            f"'wB' or 'wBgG' with B in 2, 3, 4 (e.g. 'w4g128')"
        )
    bits = int(m.group(1))
    group = int(m.group(2)) if m.group(2) else None
    return WeightFormat(name, bits, group, act_quant=name == "w8a8")


def quantized_param_shapes(cfg: ModelConfig, weight_format: str, lm_head: bool = False):
    """The params pytree of `weight_format` as `jax.ShapeDtypeStruct`s (nothing allocated).

    Args:
      cfg: the model config; its dtype is the activation dtype of quantized formats.
      weight_format: see the module docstring.
      lm_head: quantize the LM head too (never for tied embeddings).

    Returns:
      The abstract params, with `Int4Weight` / `Int8Weight` nodes for quantized linears.
    """
    fmt = parse_weight_format(weight_format)
    if fmt.dense:
        return param_shapes(cfg.replace(dtype=DENSE_FORMATS[fmt.name]))
    dense = param_shapes(cfg)

    def quantize(w):
        if fmt.bits == 8:
            return quantize_int8(w, act_quant=fmt.act_quant)
        g = resolve_group_size(fmt.group_size, w.shape[-2])
        return rtn_quantize(w, bits=fmt.bits, group_size=g, scale_dtype=cfg.dtype)

    def build(p):
        p = dict(p, layers=dict(p["layers"]))
        for name in LINEAR_NAMES:
            p["layers"][name] = quantize(p["layers"][name])
        if lm_head and "lm_head" in p:
            p["lm_head"] = quantize(p["lm_head"])
        return p

    return jax.eval_shape(build, dense)


def tree_bytes(tree) -> int:
    """Total bytes of the array (or ShapeDtypeStruct) leaves of a pytree."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def bits_per_weight(params: dict) -> dict:
    """Bits per weight of the decoder linears, as stored and as an ideal packing would need.

    Stored: 8 · nbytes of every leaf of the linears (codes in 4-bit containers, scales, int32
    zero points, act-order perm). Ideal: `bits` per code plus, per group, one scale in its stored
    dtype and one zero point of `bits` bits (int8: one float32 scale per output channel).

    Args:
      params: a params pytree, dense or with `Int4Weight` / `Int8Weight` linears.

    Returns:
      {"weights": count, "bpw_stored": float, "bpw_ideal": float}.
    """
    n, stored, ideal = 0, 0, 0
    for name in LINEAR_NAMES:
        w = params["layers"][name]
        if isinstance(w, Int4Weight):
            k = math.prod(w.packed.shape[:-2]) * w.shape[0] * w.shape[1]  # L · in · out
            groups = w.scales.size  # [(L,) in/G, out]
            ideal += k * w.bits + groups * (8 * w.scales.dtype.itemsize + w.bits)
        elif isinstance(w, Int8Weight):
            k = w.q.size
            ideal += 8 * k + 8 * tree_bytes(w.scales)
        else:
            k = w.size
            ideal += 8 * w.size * w.dtype.itemsize
        n += k
        stored += 8 * tree_bytes(w)
    return {"weights": n, "bpw_stored": stored / n, "bpw_ideal": ideal / n}


def weight_bytes(cfg: ModelConfig, weight_format: str, lm_head: bool = False) -> int:
    """Bytes of all parameters in `weight_format` (scales and zero points counted)."""
    return tree_bytes(quantized_param_shapes(cfg, weight_format, lm_head))


def kv_bytes_per_token(cfg: ModelConfig, kv_format: str) -> int:
    """2 · layers · kv_heads · head_dim · bytes (+ 2 · layers · kv_heads · 4 for int8 / fp8)."""
    if kv_format in DENSE_FORMATS:
        itemsize = jnp.dtype(DENSE_FORMATS[kv_format]).itemsize
        return _kv_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float", itemsize)
    if kv_format not in KV_FORMATS:
        raise ValueError(f"KV format {kv_format!r}; expected one of {KV_FORMATS}")
    return _kv_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_format)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """One row of the memory table."""

    model: str
    weight_format: str
    kv_format: str
    num_params: int
    weight_bytes: int
    weight_gb: float  # 1e9 bytes
    weight_gib: float  # 2**30 bytes
    kv_bytes_per_token: int
    seq_len: int
    kv_bytes_per_sequence: int  # seq_len rounded up to whole KV blocks
    gpu_gib: float
    reserve_gib: float  # workspace kept free (activations, compiler scratch)
    max_sequences: int  # sequences of seq_len whose KV fits beside the weights and reserve

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def memory_report(
    cfg: ModelConfig,
    weight_format: str = "bf16",
    kv_format: str = "bf16",
    *,
    seq_len: int = 4096,
    gpu_gib: float = 80.0,
    reserve_gib: float = 2.0,
    block_size: int = 16,
    model: str = "",
) -> MemoryReport:
    """Weight and KV memory of a config, and how many sequences fit in a GPU.

    Args:
      cfg: the model config (a real preset or a tiny one).
      weight_format: e.g. "bf16", "w8", "w4g128" (see the module docstring).
      kv_format: "bf16", "fp16", "fp32", "int8" or "fp8".
      seq_len: tokens per sequence (prompt + output).
      gpu_gib: GPU memory in GiB.
      reserve_gib: workspace reserve in GiB kept out of the KV budget.
      block_size: KV block size; a sequence holds whole blocks.
      model: a display name.

    Returns:
      The `MemoryReport`; max_sequences is 0 when the weights and reserve do not fit.
    """
    if seq_len < 1 or block_size < 1 or gpu_gib <= 0 or reserve_gib < 0:
        raise ValueError(
            f"seq_len={seq_len}, block_size={block_size} must be >= 1, gpu_gib={gpu_gib} > 0 "
            f"and reserve_gib={reserve_gib} >= 0"
        )
    wbytes = weight_bytes(cfg, weight_format)
    per_tok = kv_bytes_per_token(cfg, kv_format)
    per_seq = per_tok * (-(-seq_len // block_size) * block_size)
    free = int(gpu_gib * GIB) - wbytes - int(reserve_gib * GIB)
    return MemoryReport(
        model=model,
        weight_format=weight_format,
        kv_format=kv_format,
        num_params=cfg.num_params(),
        weight_bytes=wbytes,
        weight_gb=wbytes / GB,
        weight_gib=wbytes / GIB,
        kv_bytes_per_token=per_tok,
        seq_len=seq_len,
        kv_bytes_per_sequence=per_seq,
        gpu_gib=gpu_gib,
        reserve_gib=reserve_gib,
        max_sequences=max(0, free // per_seq),
    )


def memory_table(
    models: dict[str, ModelConfig],
    weight_formats: tuple[str, ...] = ("bf16", "w8", "w4g128", "w3g128"),
    kv_formats: tuple[str, ...] = ("bf16", "int8", "fp8"),
    *,
    seq_lens: tuple[int, ...] = (4096,),
    gpus: dict[str, float] | None = None,
    reserve_gib: float = 2.0,
    block_size: int = 16,
) -> list[dict]:
    """The memory table: one row per model x weight format x KV format (`memory_report`).

    Args:
      models: display name -> config, in row order.
      weight_formats, kv_formats: see the module docstring.
      seq_lens: tokens per sequence, one "fits" column per GPU and length.
      gpus: column name -> GPU memory in GiB; default {"80 GiB": 80.0}.
      reserve_gib, block_size: as `memory_report`.

    Returns:
      Rows {"model", "weight_format", "kv_format", "num_params", "weight_bytes", "weight_gb",
      "weight_gib", "kv_bytes_per_token", "fits": {"<gpu> @ <seq_len>": sequences that fit}}.
    """
    gpus = {"80 GiB": 80.0} if gpus is None else gpus
    if not models or not weight_formats or not kv_formats or not seq_lens or not gpus:
        raise ValueError(
            f"empty table: models={list(models)}, weight_formats={weight_formats}, "
            f"kv_formats={kv_formats}, seq_lens={seq_lens}, gpus={gpus}"
        )
    rows = []
    for model, cfg in models.items():
        for wf in weight_formats:
            for kv in kv_formats:
                fits = {}
                for gpu, gib in gpus.items():
                    for n in seq_lens:
                        r = memory_report(
                            cfg, wf, kv, seq_len=n, gpu_gib=gib, reserve_gib=reserve_gib,
                            block_size=block_size, model=model,
                        )  # fmt: skip
                        fits[f"{gpu} @ {n}"] = r.max_sequences
                rows.append({
                    "model": model, "weight_format": wf, "kv_format": kv,
                    "num_params": r.num_params, "weight_bytes": r.weight_bytes,
                    "weight_gb": r.weight_gb, "weight_gib": r.weight_gib,
                    "kv_bytes_per_token": r.kv_bytes_per_token, "fits": fits,
                })  # fmt: skip
    return rows


def markdown_table(rows: list[dict]) -> str:
    """`memory_table` rows as a markdown table (sequences that fit: one column per GPU, length)."""
    fits = list(rows[0]["fits"])
    lines = [
        "| model | weights | KV | params | weights GB | weights GiB | KV bytes/token | "
        + " | ".join(f"seqs {k}" for k in fits) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(fits),
    ]  # fmt: skip
    for r in rows:
        cells = " | ".join(f"{r['fits'][k]:,}" for k in fits)
        lines.append(
            f"| {r['model']} | {r['weight_format']} | {r['kv_format']} | "
            f"{r['num_params'] / 1e9:.3f} B | {r['weight_gb']:.3f} | {r['weight_gib']:.3f} | "
            f"{r['kv_bytes_per_token']:,} | {cells} |"
        )
    return "\n".join(lines) + "\n"
