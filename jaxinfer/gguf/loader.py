"""GGUF files (llama.cpp's format) -> (ModelConfig, params), for the `llama` and `qwen2` families.

    cfg, params = ji.load_checkpoint("model.gguf")                      # dense, in cfg.dtype
    cfg, params = ji.load_checkpoint("model.gguf", keep_quantized=True)  # Q4_0/Q4_1/Q8_0 as stored

Parsing and the reference dequantization are ggml-org's own `gguf` library (`GGUFReader`,
`gguf.quants.dequantize`): every tensor type that library can dequantize loads, bit for bit
equal to it before the cast to the requested dtype.

Layout. A ggml tensor of shape `ne = [ne0, ne1]` is a row-major numpy array `(ne1, ne0)`, and a
linear weight is stored like an HF one, `[out, in]` with quantization blocks of 32 along `in`.
jaxinfer's linears are `[in, out]` stacked over layers (see `jaxinfer/model/params.py`), so
loading transposes and stacks. `convert_hf_to_gguf.py` permutes the rows of the `llama` q and k
projections (weights and biases) from HF's rotate-half RoPE layout to ggml's interleaved one;
loading undoes it. `qwen2` is converted without the permutation.

keep_quantized. Q4_0 (`w = (q - 8) · d`), Q4_1 (`w = q · d + m`) and Q8_0 (`w = q · d`), each in
blocks of 32 consecutive inputs with float16 `d` (and `m`), map exactly onto jaxinfer's
`Int4Weight` (group 32, zero point 8, or zero 0 plus `mins`) and a grouped `Int8Weight`: no
re-quantization, and dequantizing them gives the gguf library's float32 values bit for bit. A
leaf whose layers are not all one of these types (K-quants, Q5, F16, ...) is dequantized to
float. The embedding gather uses a dequantized copy; a tied model's head then becomes its own
quantized `lm_head` built from the same blocks.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import tensor_checks
from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.gguf.blocks import stacked_quantized, unpermute_rows

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_MAGIC = b"GGUF"

# jaxinfer layer leaf -> GGUF tensor name inside `blk.{i}.`
_LAYER_NAMES = {
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
    "attn_norm": "attn_norm.weight",
    "mlp_norm": "ffn_norm.weight",
}
_LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


# --------------------------------------------------------------------------------------------
# Finding and opening a file
# --------------------------------------------------------------------------------------------


def find_gguf(path: str) -> str | None:
    """The GGUF file `path` names: the file itself, or the single `.gguf` in a directory.

    A directory with a `config.json` is an HF checkpoint (None). Raises ValueError for a
    directory without config.json that holds several `.gguf` files.
    """
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(
            f"{path} holds several GGUF files ({', '.join(found)}); pass the file to load"
        )
    return os.path.join(path, found[0]) if found else None


def open_gguf(path: str):
    """A `gguf.GGUFReader` over `path`, or ValueError for a non-GGUF or truncated file."""
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader fails on a cut header with numpy/struct errors
        raise ValueError(f"{path} is not a readable GGUF file (truncated?): {e}") from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(
                f"{path} is truncated: tensor {t.name} needs bytes {t.data_offset} to "
                f"{t.data_offset + t.n_bytes}, the file has {size}"
            )
    return reader


def _field(reader, key: str, default=None, *, required: bool = False):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return f.contents()


# --------------------------------------------------------------------------------------------
# Metadata -> ModelConfig
# --------------------------------------------------------------------------------------------


def config_from_gguf(reader, dtype: str | None = None) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata (and tensor list) describes.

    Args:
      reader: a `gguf.GGUFReader`.
      dtype: parameter dtype name; default "float32" (GGUF blocks dequantize to float32).

    Returns:
      The config. Raises ValueError naming an unsupported architecture or rope scaling.
    """
    arch = _field(reader, "general.architecture", required=True)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; expected one of {sorted(ARCHITECTURES)}"
        )
    names = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            "GGUF tensor rope_freqs.weight (llama3-style per-frequency RoPE factors) is not "
            "supported; ModelConfig expresses llama3 scaling by its parameters only"
        )

    def get(key, default=None, required=False):
        return _field(reader, f"{arch}.{key}", default, required=required)

    hidden = int(get("embedding_length", required=True))
    num_heads = int(get("attention.head_count", required=True))
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads
    vocab = get("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else names["token_embd.weight"].shape[1]
    rope_scaling = None
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        rope_scaling = RopeScaling("linear", float(get("rope.scaling.factor", 1.0)))
    elif kind not in ("none", None):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (none or linear)")
    bias = "blk.0.attn_q.bias" in names
    if arch == "qwen2" and not bias:
        raise ValueError("GGUF qwen2 model has no attn_q.bias; qwen2 always has qkv biases")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(get("block_count", required=True)),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv") or num_heads),
        head_dim=int(head_dim),
        intermediate_size=int(get("feed_forward_length", required=True)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=bias,
        dtype=dtype or "float32",
        architecture=ARCHITECTURES[arch],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


def gguf_names(cfg: ModelConfig) -> dict[tuple, str]:
    """(jaxinfer path) -> GGUF tensor name, for every tensor `cfg` implies."""
    names = {("embed",): "token_embd.weight", ("final_norm",): "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names[("lm_head",)] = "output.weight"
    for leaf, name in _LAYER_NAMES.items():
        if leaf in ("bq", "bk", "bv") and not cfg.attention_bias:
            continue
        for i in range(cfg.num_layers):
            names[("layers", leaf, i)] = f"blk.{i}.{name}"
    return names


def _ggml_shape(cfg: ModelConfig, key: tuple) -> tuple[int, ...]:
    """The `ne` a tensor must have: a linear `[in, out]` is stored as ne = (in, out)."""
    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    leaf = key[1] if key[0] == "layers" else key[0]
    return {
        "embed": (e, v),
        "lm_head": (e, v),
        "final_norm": (e,),
        "attn_norm": (e,),
        "mlp_norm": (e,),
        "wq": (e, hd),
        "wk": (e, kd),
        "wv": (e, kd),
        "wo": (hd, e),
        "bq": (hd,),
        "bk": (kd,),
        "bv": (kd,),
        "w_gate": (e, f),
        "w_up": (e, f),
        "w_down": (f, e),
    }[leaf]


def dequantize_tensor(t) -> np.ndarray:
    """A reader tensor as float32 numpy `(ne[-1], ..., ne[0])`, by `gguf.quants.dequantize`."""
    from gguf import quants

    try:
        arr = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"GGUF tensor {t.name} has type {t.tensor_type.name}, which the gguf library cannot "
            "dequantize"
        ) from e
    return np.asarray(arr, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))


def _permute_heads(cfg: ModelConfig, arch: str, key: tuple) -> int | None:
    """The head count to unpermute a q/k tensor with (llama only), else None."""
    leaf = key[1] if key[0] == "layers" else key[0]
    if arch != "llama" or leaf not in ("wq", "wk", "bq", "bk"):
        return None
    return cfg.num_heads if leaf in ("wq", "bq") else cfg.num_kv_heads


def _dense(t, cfg: ModelConfig, arch: str, key: tuple) -> np.ndarray:
    """The float32 jaxinfer-layout array of one tensor (q/k unpermuted, linears transposed)."""
    arr = dequantize_tensor(t)  # (ne1, ne0): [out, in] for a linear
    heads = _permute_heads(cfg, arch, key)
    if heads is not None:
        arr = unpermute_rows(arr, heads)
    leaf = key[1] if key[0] == "layers" else key[0]
    return arr.T if leaf in (*_LINEARS, "lm_head") else arr


def load_gguf(
    path: str, dtype=None, keep_quantized: bool = False, *, check_finite: bool = True
) -> tuple[ModelConfig, dict]:
    """Loads a `llama` or `qwen2` GGUF file.

    Args:
      path: a `.gguf` file.
      dtype: parameter dtype (e.g. jnp.float32); default float32.
      keep_quantized: keep Q4_0 / Q4_1 / Q8_0 linears (and a tied head) in jaxinfer's int4 /
        int8 formats as stored, instead of dequantizing them.
      check_finite: refuse a tensor that holds a NaN or Inf (after the cast to `dtype`; a kept
        weight's scales and offsets), naming it; False loads it anyway.

    Returns:
      (cfg, params). Raises ValueError for a non-GGUF or truncated file, an unsupported
      architecture or tensor type (named), and a missing, unexpected or mis-shaped tensor (named).
    """
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, None if dtype is None else jnp.dtype(dtype).name)
    arch = _field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    expected = gguf_names(cfg)
    wanted = set(expected.values())
    extra = sorted(n for n in tensors if n not in wanted)
    if extra:
        raise ValueError(f"unexpected GGUF tensor(s) in {path}: {', '.join(extra[:5])}")
    missing = sorted(n for n in wanted if n not in tensors)
    if missing:
        raise ValueError(f"missing GGUF tensor(s) in {path}: {', '.join(missing[:5])}")
    for key, name in expected.items():
        got, want = tuple(int(n) for n in tensors[name].shape), _ggml_shape(cfg, key)
        if got != want:
            raise ValueError(
                f"GGUF tensor {name} has shape {got} (ggml ne order), expected {want} from the "
                f"{arch} metadata"
            )

    dt = cfg.jnp_dtype
    params: dict = {"layers": {}}
    for key, name in expected.items():
        if key[0] != "layers":
            params[key[0]] = jnp.asarray(_dense(tensors[name], cfg, arch, key), dt)
    by_leaf: dict[str, list] = {}
    for key, name in expected.items():
        if key[0] == "layers":
            by_leaf.setdefault(key[1], []).append((key, tensors[name]))
    for leaf, items in by_leaf.items():
        qw = None
        if keep_quantized and leaf in _LINEARS:
            qw = stacked_quantized(
                [t for _, t in items], dt, _permute_heads(cfg, arch, items[0][0])
            )
        if qw is None:
            qw = jnp.asarray(np.stack([_dense(t, cfg, arch, k) for k, t in items]), dt)
        params["layers"][leaf] = qw
    if keep_quantized:
        head = tensors["output.weight" if "lm_head" in params else "token_embd.weight"]
        qhead = stacked_quantized([head], dt, None, stacked=False)
        if qhead is not None:
            params["lm_head"] = qhead
    if check_finite:
        leaves = jax.tree_util.tree_leaves_with_path(params)
        named = [
            (jax.tree_util.keystr(p), a) for p, a in leaves if jnp.issubdtype(a.dtype, jnp.floating)
        ]
        tensor_checks.check_finite(named, path)
    return cfg, params
