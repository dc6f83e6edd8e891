"""jaxinfer: efficient LLM inference as pure, testable JAX functions.

    import jaxinfer as ji
    cfg, params = ji.load_checkpoint(path)
    outs = ji.generate(cfg, params, prompts, ji.SamplingParams(temperature=0, max_tokens=32))

The public API is re-exported below under banners, in reading order.
"""

import importlib

# ---------------------------------------------------------------- config & model
from jaxinfer.config import ModelConfig, RopeScaling, from_hf_config, preset, to_hf_config
from jaxinfer.model import cpu_layout, forward, forward_dense, inference_layout, init_params

# ---------------------------------------------------------------- cache
from jaxinfer.cache.metadata import BatchMetadata, SeqChunk, build_metadata
from jaxinfer.cache.paged import PagedKVCache, init_cache

# ---------------------------------------------------------------- checkpoints
from jaxinfer.checkpoint import load_checkpoint, load_tokenizer, save_checkpoint
from jaxinfer.chat import apply_chat_template
from jaxinfer.tokenizer import Tokenizer

# ---------------------------------------------------------------- sampling & generation
from jaxinfer.sampling import SamplingParams
from jaxinfer.requests import GenerationOutput
from jaxinfer.generate import generate
from jaxinfer.scoring import score

# ---------------------------------------------------------------- compiled programs on disk
from jaxinfer.compilation_cache import disable as disable_compilation_cache
from jaxinfer.compilation_cache import enable as enable_compilation_cache

# ---------------------------------------------------------------- subpackages (lazy)
# Imported on first use so `import jaxinfer` stays light: ji.quant, ji.speculative, ...
_LAZY = (
    "quant", "speculative", "engine", "eval", "models", "data", "memory", "ops", "server",
    "distributed",
)  # fmt: skip


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"jaxinfer.{name}")
    if name in ("Engine", "EngineConfig", "SpeculativeConfig"):
        return getattr(importlib.import_module("jaxinfer.engine"), name)
    if name == "shard_params":  # scale-out; lazy because flax (which it uses) loads Pallas
        return importlib.import_module("jaxinfer.distributed").shard_params
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")


__all__ = [
    "apply_chat_template",
    "BatchMetadata",
    "GenerationOutput",
    "ModelConfig",
    "PagedKVCache",
    "RopeScaling",
    "SamplingParams",
    "SeqChunk",
    "Tokenizer",
    "build_metadata",
    "cpu_layout",
    "disable_compilation_cache",
    "enable_compilation_cache",
    "forward",
    "forward_dense",
    "from_hf_config",
    "generate",
    "init_cache",
    "inference_layout",
    "init_params",
    "load_checkpoint",
    "load_tokenizer",
    "preset",
    "save_checkpoint",
    "score",
    "shard_params",
    "to_hf_config",
]
