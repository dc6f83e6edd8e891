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

from jaxinfer import tensor_checks
from jaxinfer.config import ModelConfig
from jaxinfer.model.params import check_params
from jaxinfer.qtensor import Int4Weight, Int8Weight
from jaxinfer.quant.config import QuantConfig

FORMAT = "jaxinfer-quant"
FORMAT_VERSION = 1
_TYPES = {"Int4Weight": Int4Weight, "Int8Weight": Int8Weight}
_SEP = "__"


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
        "model_config": cfg.to_dict(),
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
    if not os.path.isdir(os.path.join(path, "meta")):
        hint = (
            " (it holds config.json: an HF checkpoint, loaded with ji.load_checkpoint)"
            if os.path.exists(os.path.join(path, "config.json"))
            else ""
        )
        raise ValueError(
            f"{path} is not a jaxinfer quantized artifact: it has no 'meta' item{hint}; "
            "artifacts are written by jaxinfer.quant.save"
        )
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
            meta = ckpt.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax and json raise many kinds; none names the artifact
        raise ValueError(
            f"{path} is not a jaxinfer quantized artifact: its metadata does not read "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        ) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path} is not a jaxinfer quantized artifact (format {got!r})")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path} has artifact format version {version!r}; this jaxinfer reads version "
            f"{FORMAT_VERSION}. Re-run experiments/quantize.py to rebuild it."
        )
    for key in ("model_config", "quant_config", "tree"):
        if not isinstance(meta.get(key), dict):
            raise ValueError(f"the metadata of artifact {path} has no {key!r}: it is corrupt")
    return meta


def _restore_arrays(path: str, abstract: dict) -> dict:
    """Restores the "arrays" item; a failure is named by the first array that does not read."""
    args = ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract))
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
            return ckpt.restore(path, args)["arrays"]
    except Exception as e:  # TensorStore's dump names no array; find them one by one
        error = e
    bad = []
    for name in sorted(abstract):
        one = ocp.args.PyTreeRestore({name: abstract[name]}, partial_restore=True)
        try:
            with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
                ckpt.restore(path, ocp.args.Composite(arrays=one))
        except Exception:
            bad.append(name)
    first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    if not bad:
        raise ValueError(f"the arrays of artifact {path} do not read: {first}") from error
    more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])})" if len(bad) > 1 else ""
    raise ValueError(
        f"array {bad[0]} of artifact {path} is truncated or corrupt{more}: {first}"
    ) from error


def load(path: str, *, check_finite: bool = True) -> tuple[ModelConfig, dict, QuantConfig]:
    """Reads a quantized artifact written by `save`.

    Args:
      path: the artifact directory.
      check_finite: refuse an artifact whose float arrays (scales, embeddings, norms, dense
        weights) hold a NaN or Inf, naming the first; False loads it anyway.

    Returns:
      (cfg, qparams, qcfg). Raises ValueError for a missing directory, a directory that is not an
      artifact, another format, a format version mismatch, a truncated or corrupt array (named),
      non-finite values, or arrays whose shapes disagree with the stored model config.
    """
    meta = read_metadata(path)
    path = os.path.abspath(path)
    try:
        cfg = ModelConfig.from_dict(meta["model_config"])
        qcfg = QuantConfig.from_dict(meta["quant_config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"artifact {path}: {e}") from e
    abstract: dict = {}
    _abstract(meta["tree"], abstract)
    restored = _restore_arrays(path, abstract)
    if check_finite:  # one jitted reduction over the restored arrays
        tensor_checks.check_finite({n: restored[n] for n in sorted(restored)}, f"artifact {path}")
    params = _decode(meta["tree"], restored)
    check_params(cfg, params)
    return cfg, params, qcfg
