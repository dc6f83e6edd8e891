"""ModelConfig: the static shape of a Llama-family decoder, and its round trip with HF config.json.

A ModelConfig is frozen and hashable, so it is a static argument under `jax.jit`: two calls with
equal configs share a compilation. Supported architectures are the three that share one decoder:
LlamaForCausalLM, MistralForCausalLM (sliding window) and Qwen2ForCausalLM (qkv bias).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from jaxinfer.checks import as_int

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
# HF `hidden_act` names of the MLP gate activation, as transformers' ACT2FN reads them: "silu" /
# "swish" x·sigmoid(x); "gelu" the exact (erf) GELU; "gelu_new" / "gelu_pytorch_tanh" the tanh
# approximation. The functions are in jaxinfer.model.layers.ACTIVATIONS.
HIDDEN_ACTS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling`). Hashable so the config stays static."""

    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    # llama3 only: frequencies between the two wavelength bounds are interpolated smoothly.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling rope_type={self.rope_type!r} is not supported; expected one of "
                f"{ROPE_TYPES}"
            )
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"rope_scaling factor={self.factor!r} must be a finite number > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a Llama-family decoder.

    Shapes it implies: embed [V, E]; per layer wq [E, H*D], wk/wv [E, K*D], wo [H*D, E],
    w_gate/w_up [E, F], w_down [F, E]; lm_head [E, V] unless tied.
    """

    vocab_size: int  # V
    hidden_size: int  # E
    num_layers: int  # L
    num_heads: int  # H query heads
    num_kv_heads: int  # K kv heads; H % K == 0 (K == H: MHA, K == 1: MQA)
    head_dim: int  # D; usually E // H, but Qwen/Gemma shapes decouple it
    intermediate_size: int  # F, gated MLP width
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections (not o)
    sliding_window: int | None = None  # Mistral: attend to the last `sliding_window` positions
    dtype: str = "float32"  # parameter and activation dtype; softmax and norms run in float32
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    hidden_act: str = "silu"  # the MLP gate's activation (HIDDEN_ACTS); Llama's is SiLU

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = as_int(getattr(self, name))
            if value is None or value < 1:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r} must be a positive int"
                )
            object.__setattr__(self, name, value)  # numpy ints stored as Python ints
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window is not None:
            window = as_int(self.sliding_window)
            if window is None or window < 1:
                raise ValueError(f"sliding_window={self.sliding_window!r} must be None or >= 1")
            object.__setattr__(self, "sliding_window", window)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; expected one of {DTYPES}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r} is not supported; expected one of "
                f"{ARCHITECTURES}"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not supported; expected one of {HIDDEN_ACTS}"
            )
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(
                f"rms_norm_eps={self.rms_norm_eps!r} and rope_theta={self.rope_theta!r} must be > 0"
            )

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The config as a JSON-ready dict, every field by name (`from_dict` inverts it).

        jaxinfer's own serialisation (artifacts, training runs); HF's config.json is
        `to_hf_config`.
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """The config `to_dict` wrote; a missing field takes its default, an unknown one raises."""
        d = dict(d)
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}")
        if isinstance(d.get("rope_scaling"), dict):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)

    def num_params(self) -> int:
        """Parameter count implied by the shapes (embeddings and head included)."""
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = e * (self.num_heads * d) * 2 + e * (self.num_kv_heads * d) * 2
        if self.attention_bias:
            attn += (self.num_heads + 2 * self.num_kv_heads) * d
        layer = attn + 3 * e * f + 2 * e
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.vocab_size * e + self.num_layers * layer + e + head


# --------------------------------------------------------------------------------------------
# Hugging Face config.json
# --------------------------------------------------------------------------------------------


_MISSING = object()


def _field(hf: dict, key: str, kind, source: str, default=_MISSING):
    """`kind(hf[key])`, or `default` when absent; a ValueError naming `source` and `key` else."""
    value = hf.get(key)
    if value is None:  # absent or null
        if default is _MISSING:
            raise ValueError(f"{source} has no {key!r}")
        return default
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if kind is int and (bad or value != int(value)):
        raise ValueError(f"{source} has {key!r}={value!r}; expected an integer")
    if kind is float and bad:
        raise ValueError(f"{source} has {key!r}={value!r}; expected a number")
    return kind(value)


def _rope_scaling_from_hf(raw: dict | None, source: str = "config.json") -> RopeScaling | None:
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{source} has rope_scaling={raw!r}; expected an object or null")
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; expected one of {ROPE_TYPES}"
        )
    if rope_type == "default":
        return None
    where = f"{source} (rope_scaling)"
    kwargs = {"rope_type": rope_type, "factor": _field(raw, "factor", float, where, 1.0)}
    if rope_type == "llama3":
        kwargs.update(
            low_freq_factor=_field(raw, "low_freq_factor", float, where),
            high_freq_factor=_field(raw, "high_freq_factor", float, where),
            original_max_position_embeddings=_field(
                raw, "original_max_position_embeddings", int, where
            ),
        )
    return RopeScaling(**kwargs)


def from_hf_config(hf: dict, dtype: str | None = None, source: str = "config.json") -> ModelConfig:
    """Builds a ModelConfig from a parsed HF `config.json`.

    Args:
      hf: the JSON object of a LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM config.
      dtype: overrides `torch_dtype` / `dtype` of the file ("float32", "bfloat16", "float16").
      source: what `hf` was read from, for error messages (e.g. "config.json in /path").

    Returns:
      The ModelConfig. Raises ValueError for an unsupported architecture, rope type or
      activation, and naming `source` and the field for a missing or mistyped field.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"{source} holds a {type(hf).__name__}; expected a JSON object")
    archs = hf.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch is None:
        by_type = {v: k for k, v in _MODEL_TYPES.items()}
        arch = by_type.get(hf.get("model_type"))
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{source}: architecture {arch!r} (model_type={hf.get('model_type')!r}) is not "
            f"supported; expected one of {ARCHITECTURES}"
        )
    rope_params = hf.get("rope_scaling")
    rope_theta = _field(hf, "rope_theta", float, source, None)
    # transformers >= 5 may write both into `rope_parameters`.
    if isinstance(hf.get("rope_parameters"), dict):
        rp = hf["rope_parameters"]
        rope_theta = _field(rp, "rope_theta", float, f"{source} (rope_parameters)", rope_theta)
        if rope_params is None and rp.get("rope_type", "default") != "default":
            rope_params = rp
    num_heads = _field(hf, "num_attention_heads", int, source)
    hidden = _field(hf, "hidden_size", int, source)
    head_dim = _field(hf, "head_dim", int, source, None) or hidden // max(num_heads, 1)
    sliding_window = _field(hf, "sliding_window", int, source, None)
    if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
        sliding_window = None
    if arch == "LlamaForCausalLM":
        sliding_window = None
    file_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    act = hf.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise ValueError(
            f"{source} has hidden_act={act!r}, which jaxinfer does not implement; expected one "
            f"of {HIDDEN_ACTS}"
        )
    try:
        return ModelConfig(
            vocab_size=_field(hf, "vocab_size", int, source),
            hidden_size=hidden,
            num_layers=_field(hf, "num_hidden_layers", int, source),
            num_heads=num_heads,
            num_kv_heads=_field(hf, "num_key_value_heads", int, source, None) or num_heads,
            head_dim=head_dim,
            intermediate_size=_field(hf, "intermediate_size", int, source),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=_rope_scaling_from_hf(rope_params, source),
            rms_norm_eps=_field(hf, "rms_norm_eps", float, source, 1e-6),
            max_position_embeddings=_field(hf, "max_position_embeddings", int, source, 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            sliding_window=sliding_window or None,
            dtype=dtype or str(file_dtype),
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            hidden_act=act,
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def to_hf_config(cfg: ModelConfig) -> dict:
    """The HF `config.json` object for `cfg` (readable by transformers.AutoConfig)."""
    hf = {
        "architectures": [cfg.architecture],
        "model_type": _MODEL_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.dtype,
        "initializer_range": 0.02,
        "use_cache": True,
        "attention_dropout": 0.0,
    }
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        hf["rope_scaling"] = {"rope_type": rs.rope_type, "factor": rs.factor}
        if rs.rope_type == "llama3":
            hf["rope_scaling"].update(
                low_freq_factor=rs.low_freq_factor,
                high_freq_factor=rs.high_freq_factor,
                original_max_position_embeddings=rs.original_max_position_embeddings,
            )
    if cfg.architecture == "LlamaForCausalLM":
        hf["attention_bias"] = cfg.attention_bias
        hf["mlp_bias"] = False
    elif cfg.architecture == "MistralForCausalLM":
        hf["sliding_window"] = cfg.sliding_window
        if cfg.attention_bias:
            raise ValueError("MistralForCausalLM has no attention_bias; use LlamaForCausalLM")
    else:  # Qwen2
        hf["use_sliding_window"] = cfg.sliding_window is not None
        hf["sliding_window"] = cfg.sliding_window
        hf["max_window_layers"] = cfg.num_layers
        if not cfg.attention_bias:
            raise ValueError("Qwen2ForCausalLM always has qkv bias; set attention_bias=True")
    # Written even when None, so transformers does not fill in its own defaults (1 and 2).
    hf["bos_token_id"] = cfg.bos_token_id
    hf["eos_token_id"] = cfg.eos_token_id
    return hf


# --------------------------------------------------------------------------------------------
# Presets: the real shapes (for memory reports and GPU benchmarks) and tiny test configs.
# --------------------------------------------------------------------------------------------

# fmt: off
PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
        head_dim=128, intermediate_size=11008, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=4096, dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=14336, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, dtype="bfloat16", bos_token_id=128000,
        eos_token_id=128001,
    ),
    "mistral-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=14336, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=32768, sliding_window=4096, dtype="bfloat16",
        architecture="MistralForCausalLM", bos_token_id=1, eos_token_id=2,
    ),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, intermediate_size=18944, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, attention_bias=True, dtype="bfloat16",
        architecture="Qwen2ForCausalLM", bos_token_id=151643, eos_token_id=151643,
    ),
    # Tiny configs for tests: a few kB of weights, every feature switched on somewhere.
    "tiny-llama": ModelConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
    ),
    "tiny-mistral": ModelConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, sliding_window=24,
        architecture="MistralForCausalLM",
    ),
    "tiny-qwen2": ModelConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, attention_bias=True,
        tie_word_embeddings=True, architecture="Qwen2ForCausalLM",
    ),
    "tiny-mqa": ModelConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16,
        intermediate_size=128, max_position_embeddings=256,
        rope_scaling=RopeScaling("linear", 2.0),
    ),
    # About 5 M parameters (6 layers, hidden 256): the decode benchmark's model.
    "bench-5m": ModelConfig(
        vocab_size=4096, hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=2, head_dim=32,
        intermediate_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5,
    ),
}
# fmt: on


def preset(name: str) -> ModelConfig:
    """A named preset config; raises ValueError listing the names for an unknown one."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]
