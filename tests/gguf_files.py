"""Synthetic GGUF files for tests, written with ggml-org's `gguf.GGUFWriter` the way
`convert_hf_to_gguf.py` writes them (HF `[out, in]` tensors, llama q/k rows permuted)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

from jaxinfer.config import ModelConfig

# Every type the installed gguf library dequantizes (F32/F16 natively, the rest by its traits).
DEQUANTIZABLE = tuple(
    t
    for t in GGMLQuantizationType
    if t in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or t in quants._type_traits
)


def hf_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: HF rotate-half rows -> ggml interleaved rows."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """GGUF name -> float32 HF-layout tensor (llama q/k permuted) for jaxinfer `params`."""
    llama = cfg.architecture == "LlamaForCausalLM"
    out = {
        "token_embd.weight": np.asarray(params["embed"], np.float32),
        "output_norm.weight": np.asarray(params["final_norm"], np.float32),
    }
    if not cfg.tie_word_embeddings:
        out["output.weight"] = np.asarray(params["lm_head"], np.float32).T
    names = {
        "wq": "attn_q.weight",
        "wk": "attn_k.weight",
        "wv": "attn_v.weight",
        "wo": "attn_output.weight",
        "w_gate": "ffn_gate.weight",
        "w_up": "ffn_up.weight",
        "w_down": "ffn_down.weight",
        "bq": "attn_q.bias",
        "bk": "attn_k.bias",
        "bv": "attn_v.bias",
        "attn_norm": "attn_norm.weight",
        "mlp_norm": "ffn_norm.weight",
    }
    for leaf, name in names.items():
        if leaf not in params["layers"]:
            continue
        for i in range(cfg.num_layers):
            arr = np.asarray(params["layers"][leaf][i], np.float32)
            arr = arr.T if leaf.startswith("w") else arr  # [in, out] -> HF [out, in]
            if llama and leaf in ("wq", "bq"):
                arr = hf_permute(arr, cfg.num_heads)
            if llama and leaf in ("wk", "bk"):
                arr = hf_permute(arr, cfg.num_kv_heads)
            out[f"blk.{i}.{name}"] = np.ascontiguousarray(arr)
    return out


def encode(arr: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator):
    """`arr` stored as `qtype`: quantized by the gguf library where it can, else random blocks.

    Random blocks use bytes below 0x78 so every float16/bfloat16/e8m0 field is finite.
    """
    if qtype == GGMLQuantizationType.F32:
        return arr.astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return arr.astype(np.float16)
    try:
        return quants.quantize(arr, qtype)
    except NotImplementedError:
        shape = quants.quant_shape_to_byte_shape(arr.shape, qtype)
        return rng.integers(0, 0x78, shape, dtype=np.uint8)


def block_size(qtype: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def write_gguf(
    path: str,
    cfg: ModelConfig,
    tensors: dict[str, np.ndarray],
    types: dict[str, GGMLQuantizationType] | None = None,
    *,
    arch: str | None = None,
    metadata: dict | None = None,
    seed: int = 0,
) -> None:
    """Writes `tensors` (GGUF name -> float32) with `cfg`'s metadata.

    Args:
      types: GGUF name -> storage type (default F32). 1-D tensors always stay F32.
      arch: the `general.architecture` (default from cfg).
      metadata: overrides of the `{arch}.*` integer fields, e.g. {"feed_forward_length": 64}.
    """
    arch = arch or {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[cfg.architecture]
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, arch)
    fields = {
        "block_count": cfg.num_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_heads,
        "attention.head_count_kv": cfg.num_kv_heads,
        "rope.dimension_count": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
    }
    fields.update(metadata or {})
    for key, value in fields.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, arr in tensors.items():
        qtype = (types or {}).get(name, GGMLQuantizationType.F32)
        if arr.ndim == 1:
            qtype = GGMLQuantizationType.F32
        data = encode(arr, qtype, rng)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
