"""Hugging Face checkpoint layout: tensor names and the safetensors files that hold them.

One table for every reader of an HF directory (the dense loader in `jaxinfer.checkpoint`, the
GPTQ / AWQ importers in `jaxinfer.quant.importers`), and one reader, which refuses pickle
checkpoints: unpickling runs arbitrary code from the file.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors import safe_open

from jaxinfer.config import ModelConfig

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

# jaxinfer layer leaf -> (HF name inside `model.layers.{i}.`, transposed?)
LAYER_NAMES = {
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
}
# Buffers some exporters write that carry no parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def tensor_files(path: str) -> dict[str, str]:
    """Maps every tensor name to the safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, fname) for name, fname in weight_map.items()}
    if os.path.exists(single):
        with safe_open(single, framework="numpy") as f:
            return {name: single for name in f.keys()}
    pickles = [f for f in sorted(os.listdir(path)) if f.endswith((".bin", ".pt", ".pth"))]
    if pickles:
        raise ValueError(
            f"{path} holds only pickle checkpoints ({', '.join(pickles)}); jaxinfer refuses to "
            "load them because unpickling can run arbitrary code. Convert them to safetensors "
            "first, e.g. in a sandbox: AutoModelForCausalLM.from_pretrained(dir)"
            ".save_pretrained(out_dir, safe_serialization=True)."
        )
    raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def hf_names(cfg: ModelConfig) -> dict[tuple, tuple[str, bool]]:
    """(jaxinfer path) -> (HF tensor name, transposed?) for every expected tensor."""
    names: dict[tuple, tuple[str, bool]] = {
        ("embed",): (EMBED, False),
        ("final_norm",): (FINAL_NORM, False),
    }
    if not cfg.tie_word_embeddings:
        names[("lm_head",)] = (LM_HEAD, True)
    for leaf, (hf, tr) in LAYER_NAMES.items():
        if leaf in ("bq", "bk", "bv") and not cfg.attention_bias:
            continue
        for i in range(cfg.num_layers):
            names[("layers", leaf, i)] = (layer_name(i, hf), tr)
    return names


def layer_name(layer: int, name: str) -> str:
    """The full HF name of `name` (a `LAYER_NAMES` value, or a module) in decoder layer `layer`."""
    return f"model.layers.{layer}.{name}"


def read_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors checkpoint directory `path`, by HF name (numpy).

    Raises ValueError for a directory without safetensors weights, and for pickle-only ones.
    """
    by_file: dict[str, list[str]] = {}
    for name, file in tensor_files(path).items():
        by_file.setdefault(file, []).append(name)
    tensors = {}
    for file, names in sorted(by_file.items()):
        with safe_open(file, framework="numpy") as f:
            for name in names:
                tensors[name] = f.get_tensor(name)
    return tensors
