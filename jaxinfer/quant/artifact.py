"""Quantized artifacts: orbax save / load of quantized params with their configs.

An artifact directory is one orbax composite checkpoint with two items:

  arrays  every array leaf of the params pytree, flat, named by its tree path
          ("layers__wq__packed", "embed", ...)
  meta    JSON: {"format": "jaxinfer-quant", "format_version", "model_config", "quant_config",
          "tree"}; "tree" mirrors the params pytree with each array as {"array", "shape",
          "dtype"} and each quantized weight as {"type", its static fields, "fields": {...}}

`load` rebuilds the pytree from "tree", refuses an unknown format version, and checks every
array against the shapes the ModelConfig implies (a quantized leaf by its static `(in, out)`
and leading L), so a mismatched artifact fails with a ValueError naming the leaf.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.model.params import check_params
from jaxinfer.qtensor import Int4Weight, Int8Weight
from jaxinfer.quant.calibrate import QuantConfig

FORMAT = "jaxinfer-quant"
FORMAT_VERSION = 1
_TYPES = {"Int4Weight": Int4Weight, "Int8Weight": Int8Weight}
_SEP = "__"


# --------------------------------------------------------------------------------------------
# Config (de)serialisation
# --------------------------------------------------------------------------------------------


def model_config_to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def model_config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return ModelConfig(**d)


# --------------------------------------------------------------------------------------------
# Tree <-> (flat arrays, JSON skeleton)
# --------------------------------------------------------------------------------------------


def _encode(node, path: tuple[str, ...], flat: dict) -> dict | None:
    if node is None:
        return None
    if isinstance(node, dict):
        return {"dict": {k: _encode(v, (*path, k), flat) for k, v in node.items()}}
    if isinstance(node, Int4Weight | Int8Weight):
        static, fields = {}, {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.metadata.get("static"):
                static[f.name] = list(value) if isinstance(value, tuple) else value
            else:
                fields[f.name] = _encode(value, (*path, f.name), flat)
        return {"type": type(node).__name__, "static": static, "fields": fields}
    if isinstance(node, jax.Array):
        name = _SEP.join(path)
        flat[name] = node
        return {"array": name, "shape": list(node.shape), "dtype": node.dtype.name}
    raise ValueError(f"cannot save leaf {'/'.join(path)} of type {type(node).__name__}")


def _abstract(skel, out: dict) -> None:
    if skel is None:
        return
    if "dict" in skel:
        for v in skel["dict"].values():
            _abstract(v, out)
    elif "type" in skel:
        for v in skel["fields"].values():
            _abstract(v, out)
    else:
        out[skel["array"]] = jax.ShapeDtypeStruct(tuple(skel["shape"]), jnp.dtype(skel["dtype"]))


def _decode(skel, arrays: dict):
    if skel is None:
        return None
    if "dict" in skel:
        return {k: _decode(v, arrays) for k, v in skel["dict"].items()}
    if "type" in skel:
        if skel["type"] not in _TYPES:
            raise ValueError(f"unknown quantized weight type {skel['type']!r} in the artifact")
        static = {k: tuple(v) if isinstance(v, list) else v for k, v in skel["static"].items()}
        fields = {k: _decode(v, arrays) for k, v in skel["fields"].items()}
        return _TYPES[skel["type"]](**fields, **static)
    return arrays[skel["array"]]


# --------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------


def save(
    path: str,
    cfg: ModelConfig,
    qparams: dict,
    qcfg: QuantConfig,
    *,
    overwrite: bool = False,
) -> None:
    """Writes a quantized artifact (an orbax checkpoint directory).

    Args:
      path: the directory to create.
      cfg: the model config.
      qparams: the (quantized) params pytree.
      qcfg: the QuantConfig that produced it.
      overwrite: replace an existing directory.
    """
    check_params(cfg, qparams)
    flat: dict = {}
    tree = _encode(qparams, (), flat)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_config": model_config_to_dict(cfg),
        "quant_config": qcfg.to_dict(),
        "tree": tree,
    }
    args = ocp.args.Composite(arrays=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        ckpt.save(os.path.abspath(path), args, force=overwrite)


def read_metadata(path: str) -> dict:
    """The artifact's JSON metadata, after checking its format and version."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"no quantized artifact at {path}")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        meta = ckpt.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a jaxinfer quantized artifact (format {meta.get('format')!r})"
        )
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path} has artifact format version {version!r}; this jaxinfer reads version "
            f"{FORMAT_VERSION}. Re-run experiments/quantize.py to rebuild it."
        )
    return meta


def load(path: str) -> tuple[ModelConfig, dict, QuantConfig]:
    """Reads a quantized artifact written by `save`.

    Args:
      path: the artifact directory.

    Returns:
      (cfg, qparams, qcfg). Raises ValueError for a missing directory, another format, a format
      version mismatch or arrays whose shapes disagree with the stored model config.
    """
    meta = read_metadata(path)
    cfg = model_config_from_dict(meta["model_config"])
    qcfg = QuantConfig.from_dict(meta["quant_config"])
    abstract: dict = {}
    _abstract(meta["tree"], abstract)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        restored = ckpt.restore(
            os.path.abspath(path), ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract))
        )["arrays"]
    params = _decode(meta["tree"], restored)
    check_params(cfg, params)
    return cfg, params, qcfg
