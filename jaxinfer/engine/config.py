"""`EngineConfig`: the KV pool, scheduling limits and device settings of an `Engine`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.cache.paged import KV_FORMATS
from jaxinfer.checks import as_int, check_int
from jaxinfer.engine.scheduler import SchedulerConfig
from jaxinfer.ops.attention import BACKENDS
from jaxinfer.speculative.config import SpeculativeConfig


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """KV pool, scheduling limits and device settings of an `Engine`.

    Attributes:
      block_size: S, token slots per KV block.
      num_blocks: KV blocks in the pool, the null block 0 included; the KV memory is
        `(num_blocks - 1) * block_size` token slots.
      max_num_seqs: sequences running at once (batch rows of a step).
      max_num_batched_tokens: tokens computed per step over all sequences.
      enable_prefix_caching: reuse the K/V of full blocks shared by prompts.
      enable_chunked_prefill: split prompts across steps and mix them with decodes.
      long_prefill_threshold: with chunked prefill, at most this many prompt tokens of one
        sequence per step; None: no cap.
      backend: attention backend ("auto", "xla", "reference", "pallas", "pallas-interpret").
      kv_format: KV-cache storage ("float", "int8", "fp8").
      kv_dtype: storage dtype of a "float" cache; None: the model's dtype.
      min_token_bucket: smallest padded T, so the many tiny decode steps share one compilation.
      min_block_bucket: smallest padded M (blocks per sequence), for the same reason.
      min_seq_bucket: smallest padded B; `max_num_seqs` fixes B, leaving T and M to vary.
      speculative: speculative decoding (`ji.SpeculativeConfig`); None: plain decoding.
      cycle_log: path of a JSONL file with one record per request per step (speculation on):
        γ, proposed and committed ids, accepted count, draft / verify ms, the controller's
        choice (see `jaxinfer/engine/cycles.py`); None: no log.
      mesh: tensor parallelism: a `jax.sharding.Mesh` (its devices, in order, form the TP group;
        it may span processes under `jax.distributed`) or a degree n (the first n devices);
        params and KV cache are sharded at construction (`jaxinfer/distributed/engine_mesh.py`).
        None: one device, or the mesh of params placed by `ji.shard_params`.
    """

    block_size: int = 16
    num_blocks: int = 512
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_threshold: int | None = None
    backend: str = "auto"
    kv_format: str = "float"
    kv_dtype: str | None = None
    min_token_bucket: int = 16
    min_block_bucket: int = 8
    min_seq_bucket: int = 1
    speculative: SpeculativeConfig | None = None
    cycle_log: str | None = None
    mesh: Mesh | int | None = None

    def __post_init__(self):
        # One int policy (jaxinfer.checks): numpy / jax ints are normalized to Python ints,
        # bools and floats refused.
        for name, lo in (
            ("block_size", 1),
            ("num_blocks", 2),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("min_token_bucket", 1),
            ("min_block_bucket", 1),
            ("min_seq_bucket", 1),
        ):
            object.__setattr__(
                self, name, check_int(f"EngineConfig.{name}", getattr(self, name), lo)
            )
        if self.long_prefill_threshold is not None:
            t = check_int("EngineConfig.long_prefill_threshold", self.long_prefill_threshold, 1)
            object.__setattr__(self, "long_prefill_threshold", t)
        if self.backend not in BACKENDS:
            raise ValueError(f"EngineConfig.backend={self.backend!r}: expected one of {BACKENDS}")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(
                f"EngineConfig.kv_format={self.kv_format!r}: expected one of {KV_FORMATS}"
            )
        if self.kv_dtype is not None:
            try:
                dtype = jnp.dtype(self.kv_dtype)
            except TypeError:
                raise ValueError(
                    f"EngineConfig.kv_dtype={self.kv_dtype!r}: expected None or a dtype name"
                ) from None
            # An integer store would truncate K/V; quantized storage is kv_format's business.
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(
                    f"EngineConfig.kv_dtype={self.kv_dtype!r} is not a floating dtype: a "
                    f"{dtype} store would truncate K/V; expected a floating dtype (float32, "
                    f"bfloat16, ...) or kv_format in {KV_FORMATS[1:]} for a quantized cache"
                )
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r}: expected a bool")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(
                f"EngineConfig.speculative={self.speculative!r}: expected a SpeculativeConfig "
                "or None"
            )
        if self.cycle_log is not None and not isinstance(self.cycle_log, str):
            raise ValueError(f"EngineConfig.cycle_log={self.cycle_log!r}: expected a path or None")
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            degree = as_int(self.mesh)
            if degree is None or degree < 1:
                raise ValueError(
                    f"EngineConfig.mesh={self.mesh!r}: expected None, a jax.sharding.Mesh or a "
                    "tensor-parallel degree (an int >= 1)"
                )
            object.__setattr__(self, "mesh", degree)
        self.scheduler_config()  # validates long_prefill_threshold against chunked prefill

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=int(self.max_num_seqs),
            max_num_batched_tokens=int(self.max_num_batched_tokens),
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_threshold=self.long_prefill_threshold,
        )

    @property
    def kv_slots(self) -> int:
        """Usable KV token slots of the pool (the null block excluded)."""
        return (self.num_blocks - 1) * self.block_size
