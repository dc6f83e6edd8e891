"""Community quantized checkpoints (AutoGPTQ / GPTQModel, AutoAWQ GEMM) -> `Int4Weight`.

GPTQ (AutoGPTQ, GPTQModel), per linear `<module>.{qweight, qzeros, scales, g_idx}`:

  qweight int32 [in·b/32, out]   packed along input rows: row (32/b)·r + j is bits b·j.. of word r
  qzeros  int32 [n_g, out·b/32]  packed along output columns the same way
  scales  fp16  [n_g, out]
  g_idx   int32 [in]             group of each input row (act order: any order)
  w[k, n] = (q[k, n] − z[g_idx[k], n]) · s[g_idx[k], n]

  Zero points: checkpoint_format "gptq" (v1, the legacy default) stores z − 1; "gptq_v2" stores
  z. v1 is read as (stored + 1) mod 2**b. An arbitrary g_idx becomes a row permutation: perm =
  stable argsort(g_idx) puts each group's rows together (every group must have G rows), stored
  row k is input row perm[k], and the weight keeps `perm` (see `qtensor.Int4Weight`).

AWQ GEMM (AutoAWQ), per linear `<module>.{qweight, qzeros, scales}`:

  qweight int32 [in, out/8]      packed along output columns; nibble i of word c holds column
                                 8c + ORDER[i], ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
  qzeros  int32 [in/G, out/8]    same packing, exact zero points
  scales  fp16  [in/G, out]

Supported widths: GPTQ 2 and 4 bits (3-bit words straddle rows; 8 bits does not fit the 4-bit
containers), AWQ 4 bits. The importers run on the host with numpy.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig, from_hf_config
from jaxinfer.hf_names import EMBED, FINAL_NORM, LAYER_NAMES, LM_HEAD, layer_name, read_tensors
from jaxinfer.model.params import LINEAR_NAMES
from jaxinfer.qtensor import Int4Weight, check_int4_static, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8c + AWQ_ORDER[i]
GPTQ_BITS = (2, 4)
GPTQ_FORMATS = ("gptq", "gptq_v2")
# jaxinfer linear -> HF module inside `model.layers.{i}.`; the dense leaves keep their HF names.
MODULES = {
    leaf: name.removesuffix(".weight")
    for leaf, (name, _) in LAYER_NAMES.items()
    if leaf in LINEAR_NAMES
}
_DENSE = {leaf: name for leaf, (name, _) in LAYER_NAMES.items() if leaf not in MODULES}


def _unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Splits int32 words into `32 / bits` codes along `axis`, lowest bits first."""
    per = 32 // bits
    u = np.asarray(words).astype(np.int64) & 0xFFFFFFFF  # reinterpret int32 as unsigned
    shifts = bits * np.arange(per)
    codes = (u[..., None] >> shifts) & (2**bits - 1)  # [..., per]
    codes = np.moveaxis(codes, -1, axis + 1 if axis >= 0 else axis)  # code index after `axis`
    shape = list(words.shape)
    shape[axis] *= per
    return codes.reshape(shape).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class _HostInt4:
    """An imported weight still on the host (numpy), before packing: layers stack here."""

    q: np.ndarray  # [(L,) in, out] int codes, rows in stored order
    scales: np.ndarray  # [(L,) in/G, out] float
    zeros: np.ndarray  # [(L,) in/G, out] int
    perm: np.ndarray | None  # [(L,) in] int32
    bits: int
    group_size: int

    def to_int4(self, dtype=None) -> Int4Weight:
        d_in, d_out = self.q.shape[-2:]
        return Int4Weight(
            packed=pack_int4(jnp.asarray(self.q)),  # [(L,) in/8, out] uint32
            scales=jnp.asarray(self.scales, dtype or self.scales.dtype),
            zeros=jnp.asarray(self.zeros, jnp.int32),
            perm=None if self.perm is None else jnp.asarray(self.perm, jnp.int32),
            group_size=self.group_size,
            bits=self.bits,
            shape=(d_in, d_out),
        )


def _check_shape(name: str, arr: np.ndarray, want: tuple) -> None:
    if tuple(arr.shape) != tuple(want):
        raise ValueError(f"{name} has shape {tuple(arr.shape)}; expected {tuple(want)}")


def _gptq_host(
    qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format, force_perm, name
):
    if bits not in GPTQ_BITS:
        raise ValueError(
            f"{name}: GPTQ bits={bits!r} is not supported; expected one of {GPTQ_BITS}"
        )
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"{name}: checkpoint_format={checkpoint_format!r}; expected one of {GPTQ_FORMATS}"
        )
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    per = 32 // bits
    d_in, d_out = qweight.shape[0] * per, qweight.shape[1]
    group_size = d_in if group_size in (None, -1) else int(group_size)
    check_int4_static((d_in, d_out), group_size, 4)
    n_groups = d_in // group_size
    _check_shape(f"{name}.scales", scales, (n_groups, d_out))
    _check_shape(f"{name}.qzeros", qzeros, (n_groups, d_out // per))
    q = _unpack(qweight, bits, axis=0)  # [in, out]
    z = _unpack(qzeros, bits, axis=1)  # [n_groups, out]
    if checkpoint_format == "gptq":
        z = (z + 1) % (2**bits)
    if g_idx is None:
        g_idx = np.arange(d_in) // group_size
    g_idx = np.asarray(g_idx).astype(np.int64)
    _check_shape(f"{name}.g_idx", g_idx, (d_in,))
    counts = np.bincount(g_idx, minlength=n_groups) if g_idx.min() >= 0 else None
    if counts is None or len(counts) != n_groups or np.any(counts != group_size):
        raise ValueError(
            f"{name}: g_idx must give each of the {n_groups} groups exactly {group_size} rows"
        )
    perm = None
    if force_perm or np.any(g_idx != np.arange(d_in) // group_size):
        perm = np.argsort(g_idx, kind="stable").astype(np.int32)  # stored row k = input perm[k]
        q = q[perm]
    return _HostInt4(q, scales, z, perm, bits, group_size)


def import_gptq_linear(
    qweight,
    qzeros,
    scales,
    g_idx=None,
    *,
    bits: int = 4,
    group_size: int,
    checkpoint_format: str = "gptq",
    dtype=None,
    force_perm: bool = False,
    name: str = "linear",
) -> Int4Weight:
    """Converts one AutoGPTQ / GPTQModel linear.

    Args:
      qweight: int32 `[in·bits/32, out]`.
      qzeros: int32 `[n_groups, out·bits/32]`.
      scales: float `[n_groups, out]`.
      g_idx: optional int `[in]` group of each input row (default: row // group_size).
      bits: 2 or 4.
      group_size: G (the checkpoint's `group_size`; -1 means per channel).
      checkpoint_format: "gptq" (v1, stored zero = z − 1) or "gptq_v2" (exact zeros).
      dtype: scale dtype (the activation dtype); default: the scales' dtype.
      force_perm: keep an (identity) `perm` even for a trivial g_idx, so that every layer of a
        stacked model has the same pytree structure.
      name: names the linear in error messages.

    Returns:
      The `Int4Weight` (with `perm` when g_idx is not in row order).
    """
    return _gptq_host(
        qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format, force_perm, name
    ).to_int4(dtype)


def _awq_host(qweight, qzeros, scales, group_size, name):
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    d_in, d_out = qweight.shape[0], qweight.shape[1] * 8
    group_size = d_in if group_size in (None, -1) else int(group_size)
    check_int4_static((d_in, d_out), group_size, 4)
    _check_shape(f"{name}.scales", scales, (d_in // group_size, d_out))
    _check_shape(f"{name}.qzeros", qzeros, (d_in // group_size, d_out // 8))
    inverse = np.argsort(AWQ_ORDER)  # column j of a word sits in nibble inverse[j]

    def cols(words):
        nib = _unpack(words, 4, axis=1).reshape(words.shape[0], -1, 8)  # [rows, out/8, nibble]
        return nib[:, :, inverse].reshape(words.shape[0], -1)  # [rows, out]

    return _HostInt4(cols(qweight), scales, cols(qzeros), None, 4, group_size)


def import_awq_linear(
    qweight, qzeros, scales, *, group_size: int, dtype=None, name: str = "linear"
) -> Int4Weight:
    """Converts one AutoAWQ GEMM linear (4 bits).

    Args:
      qweight: int32 `[in, out/8]`, columns interleaved by `AWQ_ORDER`.
      qzeros: int32 `[in/G, out/8]`, same packing.
      scales: float `[in/G, out]`.
      group_size: G.
      dtype: scale dtype (the activation dtype); default: the scales' dtype.
      name: names the linear in error messages.

    Returns:
      The `Int4Weight`.
    """
    return _awq_host(qweight, qzeros, scales, group_size, name).to_int4(dtype)


# --------------------------------------------------------------------------------------------
# Whole checkpoints
# --------------------------------------------------------------------------------------------


def _quant_config(path: str, hf: dict) -> dict:
    qc = hf.get("quantization_config")
    side = os.path.join(path, "quantize_config.json")  # older AutoGPTQ exports
    if qc is None and os.path.exists(side):
        with open(side) as f:
            qc = dict(json.load(f), quant_method="gptq")
    if not qc or qc.get("quant_method") not in ("gptq", "awq"):
        raise ValueError(f"{path}: no GPTQ or AWQ quantization_config in config.json")
    return qc


def load_community_checkpoint(path: str, dtype=None) -> tuple[ModelConfig, dict]:
    """Loads a GPTQ or AWQ (GEMM) quantized HF checkpoint directory.

    Args:
      path: directory with config.json (with `quantization_config`, or a quantize_config.json
        beside it) and safetensors weights.
      dtype: activation dtype (e.g. jnp.float16); default: the config's `torch_dtype`.

    Returns:
      (cfg, params) with every decoder linear an `Int4Weight` stacked over layers; embeddings,
      norms, biases and the LM head dense. Raises ValueError for unsupported settings or tensors.
    """
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    qc = _quant_config(path, hf)
    cfg = from_hf_config(hf, dtype=None if dtype is None else jnp.dtype(dtype).name)
    dt = cfg.jnp_dtype
    t = read_tensors(path)  # safetensors only: pickle checkpoints are refused

    def get(key):
        if key not in t:
            raise ValueError(f"{path}: missing tensor {key}")
        return t[key]

    def dense(key, transpose=False):
        arr = get(key).astype(np.float32)
        return jnp.asarray(arr.T if transpose else arr, dt)

    layers: dict = {}
    for leaf, module in MODULES.items():
        per_layer = []
        prefixes = [layer_name(i, module) for i in range(cfg.num_layers)]
        if qc["quant_method"] == "gptq":
            g = int(qc.get("group_size", -1))
            d_in = get(f"{prefixes[0]}.qweight").shape[0] * (32 // int(qc.get("bits", 4)))
            gsz = d_in if g == -1 else g
            trivial = all(
                f"{p}.g_idx" not in t or np.array_equal(t[f"{p}.g_idx"], np.arange(d_in) // gsz)
                for p in prefixes
            )
            for p in prefixes:
                per_layer.append(
                    _gptq_host(
                        get(f"{p}.qweight"),
                        get(f"{p}.qzeros"),
                        get(f"{p}.scales"),
                        t.get(f"{p}.g_idx"),
                        int(qc.get("bits", 4)),
                        g,
                        qc.get("checkpoint_format", "gptq"),
                        not trivial,
                        p,
                    )  # fmt: skip
                )
        else:
            if str(qc.get("version", "gemm")).lower() != "gemm" or int(qc.get("bits", 4)) != 4:
                raise ValueError(
                    f"{path}: AWQ version={qc.get('version')!r}, bits={qc.get('bits')!r}; only "
                    f"4-bit GEMM checkpoints are supported"
                )
            group = int(qc.get("group_size", 128))
            for p in prefixes:
                per_layer.append(
                    _awq_host(get(f"{p}.qweight"), get(f"{p}.qzeros"), get(f"{p}.scales"), group, p)
                )
        first = per_layer[0]
        layers[leaf] = _HostInt4(
            np.stack([h.q for h in per_layer]),
            np.stack([h.scales for h in per_layer]),
            np.stack([h.zeros for h in per_layer]),
            None if first.perm is None else np.stack([h.perm for h in per_layer]),
            first.bits,
            first.group_size,
        ).to_int4(dt)  # packed once, on the host, for all layers
    for leaf, hf_name in _DENSE.items():
        if leaf.startswith("b") and not cfg.attention_bias:
            continue
        stacked = np.stack([dense(layer_name(i, hf_name)) for i in range(cfg.num_layers)])
        layers[leaf] = jnp.asarray(stacked, dt)
    params = {
        "embed": jnp.asarray(dense(EMBED), dt),
        "layers": layers,
        "final_norm": jnp.asarray(dense(FINAL_NORM), dt),
    }
    if not cfg.tie_word_embeddings:  # HF [V, E] -> [E, V]
        params["lm_head"] = jnp.asarray(dense(LM_HEAD, transpose=True), dt)
    return cfg, params
