"""Hugging Face checkpoints: safetensors directories <-> (ModelConfig, params), and tokenizers.

A directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. HF linear weights are `[out, in]`; jaxinfer's are `[in, out]`
stacked over layers, so loading transposes and stacks. Pickle `.bin` checkpoints are refused:
unpickling runs arbitrary code from the file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxinfer import tensor_checks
from jaxinfer.config import ModelConfig, from_hf_config, to_hf_config
from jaxinfer.gguf import find_gguf, load_gguf
from jaxinfer.hf_names import IGNORED_SUFFIXES as _IGNORED_SUFFIXES
from jaxinfer.hf_names import hf_names as _hf_names
from jaxinfer.hf_names import tensor_files as _tensor_files
from jaxinfer.model.params import check_params, param_shapes
from jaxinfer.tokenizer import load_tokenizer as load_tokenizer  # re-exported: ji.load_tokenizer
from jaxinfer.tokenizer import save_tokenizer


def read_hf_config(path: str) -> dict:
    """The parsed `config.json` of the directory `path`, with errors that name the file."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"no config.json in {path}: not a Hugging Face checkpoint directory")
    try:
        with open(file) as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"config.json in {path} is not valid JSON: {e}") from e
    return hf


def load_checkpoint(
    path: str, dtype=None, keep_quantized: bool = False, *, check_finite: bool = True
) -> tuple[ModelConfig, dict]:
    """Loads an HF Llama / Mistral / Qwen2 safetensors directory, or a GGUF file.

    Args:
      path: directory with config.json and safetensors weights; or a `.gguf` file, or a
        directory without config.json holding exactly one (see `jaxinfer.gguf`).
      dtype: parameter dtype (e.g. jnp.float32); default: the checkpoint's `torch_dtype`
        (float32 for GGUF).
      keep_quantized: GGUF only: keep Q4_0 / Q4_1 / Q8_0 tensors as jaxinfer int4 / int8
        weights, as stored, instead of dequantizing them.
      check_finite: refuse a checkpoint holding a NaN or Inf weight, naming the first such
        tensor (also after conversion to `dtype`, which may overflow float16). False loads it
        anyway, for studying broken weights.

    Returns:
      (cfg, params). Raises ValueError naming the file and field for a missing or corrupt
      config.json; naming the tensor for a missing, unexpected, mis-shaped, non-float or
      non-finite tensor; and for pickle-only directories.
    """
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return load_gguf(
            gguf_file, dtype=dtype, keep_quantized=keep_quantized, check_finite=check_finite
        )
    if keep_quantized:
        raise ValueError("keep_quantized=True applies to GGUF files only")
    hf = read_hf_config(path)
    dtype_name = None if dtype is None else jnp.dtype(dtype).name
    cfg = from_hf_config(hf, dtype=dtype_name, source=f"config.json in {path}")
    files = _tensor_files(path)
    expected = _hf_names(cfg)
    wanted = {hf_name for hf_name, _ in expected.values()}
    extra = [
        n
        for n in files
        if n not in wanted
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if extra:
        raise ValueError(f"unexpected tensor(s) in {path}: {', '.join(sorted(extra)[:5])}")
    missing = sorted(n for n in wanted if n not in files)
    if missing:
        raise ValueError(f"missing tensor(s) in {path}: {', '.join(missing[:5])}")

    shapes = param_shapes(cfg)
    handles: dict[str, object] = {}
    try:
        tensors: dict[tuple, np.ndarray] = {}
        for key, (hf_name, transposed) in expected.items():
            fname = files[hf_name]
            if fname not in handles:
                handles[fname] = safe_open(fname, framework="numpy").__enter__()
            arr = handles[fname].get_tensor(hf_name)
            tensors[key] = arr.T if transposed else arr
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    by_name = {hf_name: tensors[key] for key, (hf_name, _) in expected.items()}
    # Refused, not cast: an int32 "weight" is a broken or mislabelled file.
    tensor_checks.check_float_dtype(by_name, path)
    if check_finite:
        tensor_checks.check_finite(by_name, path)

    def check(name: str, arr: np.ndarray, want: tuple) -> None:
        if tuple(arr.shape) != tuple(want):
            raise ValueError(
                f"tensor {name} has shape {tuple(arr.shape)} (as [in, out]), expected "
                f"{tuple(want)} from config.json"
            )

    dt = cfg.jnp_dtype
    params: dict = {"layers": {}}
    for key, (hf_name, _) in expected.items():
        if key[0] != "layers":
            want = shapes[key[0]].shape
            check(hf_name, tensors[key], want)
            params[key[0]] = jnp.asarray(tensors[key].astype(np.float32), dt)
    for leaf in shapes["layers"]:
        want = shapes["layers"][leaf].shape[1:]
        per_layer = []
        for i in range(cfg.num_layers):
            hf_name = expected[("layers", leaf, i)][0]
            check(hf_name, tensors[("layers", leaf, i)], want)
            per_layer.append(tensors[("layers", leaf, i)].astype(np.float32))
        params["layers"][leaf] = jnp.asarray(np.stack(per_layer), dt)
    if check_finite and dt == jnp.float16:  # float16's range ends at 65504: the cast can overflow
        leaves = jax.tree_util.tree_leaves_with_path(params)
        named = [(jax.tree_util.keystr(p), a) for p, a in leaves]
        tensor_checks.check_finite(named, f"{path} after conversion to float16")
    return cfg, params


# Files a checkpoint directory may hold that `save_checkpoint` writes or that would contradict
# what it writes (another checkpoint's shards, index, pickles, tokenizer).
_CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
_CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _checkpoint_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return []
    return sorted(
        f for f in os.listdir(path) if f in _CHECKPOINT_FILES or f.endswith(_CHECKPOINT_SUFFIXES)
    )


def save_checkpoint(
    path: str,
    cfg: ModelConfig,
    params: Mapping,
    tokenizer=None,
    generation_config: Mapping | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """Writes an HF-compatible directory (config.json, model.safetensors, tokenizer.json).

    The result loads with `transformers.AutoModelForCausalLM.from_pretrained(path)`. Everything
    is written into a temporary directory beside `path` and renamed into place, so a failure at
    any point leaves `path` as it was: never a weights file without its config.

    Args:
      path: output directory (created).
      cfg: model config.
      params: dense params pytree (quantized weights are saved with `jaxinfer.quant.save`).
      tokenizer: optional `jaxinfer.tokenizer.Tokenizer` (tokenizer.json and
        tokenizer_config.json with its chat template) or `tokenizers.Tokenizer` (tokenizer.json).
      generation_config: optional extra fields for generation_config.json.
      overwrite: replace the checkpoint files `path` already holds (config.json, safetensors
        shards and index, tokenizer files, ...). Without it such a directory is refused, since a
        stale index or shard would be read with the new weights. Other files there are kept.
    """
    for leaf in jax.tree_util.tree_leaves(params):
        if not isinstance(leaf, jax.Array | np.ndarray) or not jnp.issubdtype(
            leaf.dtype, jnp.floating
        ):
            raise ValueError(
                "save_checkpoint writes dense float params only; use jaxinfer.quant.save for "
                f"quantized params (found a leaf of dtype {getattr(leaf, 'dtype', type(leaf))})"
            )
    # Checked against cfg before anything is written: a params pytree of another config would
    # otherwise leave a directory whose weights contradict its config.json.
    check_params(cfg, params)
    if not isinstance(params["layers"], dict) or (cfg.tie_word_embeddings and "lm_head" in params):
        raise ValueError(
            "save_checkpoint writes the stored params layout (stacked layers; a tied model "
            "without its own lm_head), not ji.inference_layout's"
        )
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a directory")
    if os.path.isdir(path) and not os.access(path, os.W_OK):
        # The rename would replace it anyway (only the parent's permission counts): refuse, as
        # writing into it would have.
        raise PermissionError(f"{path} is not writable; save_checkpoint leaves it as it is")
    stale = _checkpoint_files(path)
    if stale and not overwrite:
        raise ValueError(
            f"{path} already holds checkpoint files ({', '.join(stale[:5])}); pass "
            "overwrite=True to replace them (other files there are kept)"
        )
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.saving-", dir=parent)
    try:
        _write_checkpoint(tmp, cfg, params, tokenizer, generation_config)
        _install(tmp, path, keep_from_old=lambda f: f not in stale)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_checkpoint(path, cfg, params, tokenizer, generation_config) -> None:
    out: dict[str, np.ndarray] = {}
    for key, (hf_name, transposed) in _hf_names(cfg).items():
        arr = params[key[0]] if key[0] != "layers" else params["layers"][key[1]][key[2]]
        arr = np.asarray(jax.device_get(arr))
        out[hf_name] = np.ascontiguousarray(arr.T if transposed else arr)
    weights = os.path.join(path, "model.safetensors")
    save_file(out, weights, metadata={"format": "pt"})
    os.chmod(weights, 0o644)  # safetensors writes 0600; a checkpoint is meant to be shared
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg), f, indent=2)
    gen = {"_from_model_config": True}
    if cfg.bos_token_id is not None:
        gen["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        gen["eos_token_id"] = cfg.eos_token_id
    gen.update(generation_config or {})
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    if tokenizer is not None:
        save_tokenizer(tokenizer, path)


def _install(tmp: str, path: str, keep_from_old) -> None:
    """Moves the finished directory `tmp` to `path`.

    A missing or empty `path` is replaced by one rename. Otherwise the files of the old directory
    that `keep_from_old` selects are first copied into `tmp` (a failure there leaves `path`
    untouched), then the old directory is renamed aside, `tmp` renamed into place and the old
    one removed; if the second rename fails, the first is undone.
    """
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    if os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)
    if not os.path.exists(path):
        os.rename(tmp, path)
        return
    for name in sorted(os.listdir(path)):
        if keep_from_old(name):
            src, dst = os.path.join(path, name), os.path.join(tmp, name)
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True)
            else:
                shutil.copy2(src, dst, follow_symlinks=False)
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=os.path.dirname(path))
    os.rmdir(old)
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
