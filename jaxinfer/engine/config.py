"""`EngineConfig`: the KV pool, scheduling limits and device settings of an `Engine`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.cache.paged import KV_FORMATS
from jaxinfer.checks import as_int, check_int
from jaxinfer.engine.buckets import check_buckets
from jaxinfer.engine.scheduler import SchedulerConfig
from jaxinfer.ops.attention import BACKENDS
from jaxinfer.speculative.config import SpeculativeConfig

TOKEN_BUCKETS = ("measured", "pow2")
LAYOUTS = ("auto", "stacked")


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
      min_token_bucket: smallest padded T (1: a decode step of one request runs one row).
      token_buckets: how T is padded up to 16: "measured" keeps the powers of two from
        min_token_bucket to 16 that a cost table timed at construction says are worth their
        compilation (`jaxinfer/engine/buckets.py`); "pow2" keeps all of them; a sequence of
        increasing powers of two (the first >= min_token_bucket) is kept as given, e.g.
        another engine's `Engine.token_buckets`, so that two engines step alike (a measured
        table can come out differently in two processes). Past the largest bucket (or
        min_token_bucket, if larger), powers of two.
      layout: params layout the step runs on: "auto" takes `inference_layout` on a CPU without a
        TP mesh (a `lax.scan` over stacked weights copies every layer's weights each step there:
        ~2x the step of SmolLM2-135M at one request), the params as given elsewhere; "stacked":
        as given.
        The layout is a copy: while the caller keeps its stacked params, the weights are held
        twice (plus a tied model's `lm_head`); "stacked" when memory is short.
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
    min_token_bucket: int = 1
    token_buckets: str | tuple[int, ...] = "measured"
    layout: str = "auto"
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
        if isinstance(self.token_buckets, str):
            if self.token_buckets not in TOKEN_BUCKETS:
                raise ValueError(
                    f"EngineConfig.token_buckets={self.token_buckets!r}: expected one of "
                    f"{TOKEN_BUCKETS} or increasing powers of two"
                )
        else:
            buckets = check_buckets(self.token_buckets, "EngineConfig.token_buckets")
            if buckets[0] < self.min_token_bucket:
                raise ValueError(
                    f"EngineConfig.token_buckets={buckets!r} starts below min_token_bucket="
                    f"{self.min_token_bucket}"
                )
            object.__setattr__(self, "token_buckets", buckets)
        if self.layout not in LAYOUTS:
            raise ValueError(f"EngineConfig.layout={self.layout!r}: expected one of {LAYOUTS}")
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
