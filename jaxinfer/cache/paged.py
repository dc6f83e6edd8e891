"""The paged KV cache: one pool of fixed-size blocks per layer, addressed through block tables.

`k`, `v` are `[L, num_blocks, K, S, D]`: a block of one layer is one contiguous slice, so
copy-on-write, swap and transfer move whole blocks. Block 0 is the null block (padding writes
land there; it is never read inside a live context). Quantized formats ("int8", "fp8") store
per-(token, head) float32 scales beside the values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.cache.kv_formats import quantize_kv as _quantize_kv
from jaxinfer.checks import as_int
from jaxinfer.config import ModelConfig

KV_FORMATS = ("float", "int8", "fp8")
_STORE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}  # storage dtype of a quantized format


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Device KV storage for every layer."""

    k: jax.Array  # [L, num_blocks, K, S, D] cache dtype (float, int8 or float8_e4m3fn)
    v: jax.Array  # [L, num_blocks, K, S, D]
    k_scale: jax.Array | None  # [L, num_blocks, K, S] float32, quantized formats only
    v_scale: jax.Array | None  # [L, num_blocks, K, S] float32
    kv_format: str = dataclasses.field(default="float", metadata=dict(static=True))
    # The platform the cache lives on ("cpu", "gpu", ...), fixed by `init_cache`: it decides how
    # float8 pages are indexed (`take_pages`), so no traced code reads the platform.
    platform: str = dataclasses.field(default="cpu", metadata=dict(static=True))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        leaves = jax.tree_util.tree_leaves(self)
        return sum(x.size * x.dtype.itemsize for x in leaves)


def check_block_size(block_size) -> int:
    """`block_size` as an int, or ValueError naming it: the boundary check of every entry point.

    Any S >= 1 is valid for the XLA and reference backends; the Pallas kernel also needs a
    power of two (it says so itself).
    """
    size = as_int(block_size)
    if size is None or size < 1:
        raise ValueError(f"block_size={block_size!r} is invalid: expected an int >= 1")
    return size


def init_cache(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype=None,
    kv_format: str = "float",
    platform: str | None = None,
) -> PagedKVCache:
    """A zeroed cache of `num_blocks` blocks (block 0 included) of `block_size` tokens.

    Args:
      cfg: model config (layers, kv heads, head dim).
      num_blocks: blocks per layer, including the null block 0.
      block_size: S, tokens per block.
      dtype: storage dtype of a "float" cache; defaults to cfg.dtype.
      kv_format: "float", "int8" or "fp8" (e4m3 with per-(token, head) scales).
      platform: the platform the cache is for. None: the platform of the device the zeroed
        pages were allocated on (a host call only; under `jit` the caller passes the platform it
        resolved at its boundary, `ops.backend.resolve_platform`).
    """
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format={kv_format!r}; expected one of {KV_FORMATS}")
    block_size = check_block_size(block_size)
    if num_blocks < 2:
        raise ValueError(f"num_blocks={num_blocks!r} is invalid: need >= 2 (block 0 is reserved)")
    shape = (cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
    store = jnp.dtype(dtype or cfg.dtype) if kv_format == "float" else _STORE[kv_format]
    k, v = jnp.zeros(shape, store), jnp.zeros(shape, store)
    platform = _platform_of(k) if platform is None else platform
    if kv_format == "float":
        return PagedKVCache(k, v, None, None, platform=platform)
    # Two scale arrays, not one twice: the engine donates the cache, and XLA refuses to donate
    # one buffer as two arguments.
    k_scale, v_scale = jnp.ones(shape[:-1], jnp.float32), jnp.ones(shape[:-1], jnp.float32)
    return PagedKVCache(k, v, k_scale, v_scale, kv_format, platform)


def _platform_of(pages: jax.Array) -> str:
    """The platform of the device(s) holding concrete `pages`; ValueError under a trace."""
    if isinstance(pages, jax.core.Tracer):
        raise ValueError(
            "init_cache(platform=None) inside a traced function: pass the platform resolved at "
            "the entry point (jaxinfer.ops.backend.resolve_platform()), e.g. platform='cpu'"
        )
    (platform,) = {d.platform for d in pages.devices()}
    return platform


def quantize_kv(x: jax.Array, kv_format: str) -> tuple[jax.Array, jax.Array | None]:
    """`x [..., D]` -> (stored values, per-vector scale [...]) for a cache format."""
    if kv_format == "float":
        return x, None
    return _quantize_kv(x, kv_format)


def write_kv(
    cache: PagedKVCache,
    layer: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
) -> PagedKVCache:
    """Writes one layer's new keys/values `[T, K, D]` into flat slots `[T]` of `layer`."""
    s = cache.block_size
    blk, off = slot_mapping // s, slot_mapping % s  # [T], [T]
    kq, ks = quantize_kv(k_new, cache.kv_format)
    vq, vs = quantize_kv(v_new, cache.kv_format)
    # Advanced indices (blk, off) around a slice: the indexed view is [T, K, D].
    k = _scatter(cache.k, (layer, blk, slice(None), off), kq, cache.platform)
    v = _scatter(cache.v, (layer, blk, slice(None), off), vq, cache.platform)
    k_scale, v_scale = cache.k_scale, cache.v_scale
    if ks is not None:
        k_scale = k_scale.at[layer, blk, :, off].set(ks)
        v_scale = v_scale.at[layer, blk, :, off].set(vs)
    return dataclasses.replace(cache, k=k, v=v, k_scale=k_scale, v_scale=v_scale)


def _through_bytes(dtype, platform: str) -> bool:
    """Whether `take_pages` / `_scatter` index a float8 pool through a uint8 view: on a CPU only
    (a GPU has float8 loads and stores; there the plain ops are kept, unmeasured)."""
    narrow_float = jnp.dtype(dtype).itemsize == 1 and not jnp.issubdtype(dtype, jnp.integer)
    return narrow_float and platform == "cpu"


def take_pages(pages: jax.Array, index, platform: str) -> jax.Array:
    """`pages[index]`, reading only the indexed bytes for every cache dtype on `platform`.

    XLA's CPU backend has no float8 arithmetic and widens float8 arrays around gathers and
    scatters inside the model's step, converting the whole pool at every call: a step over an
    8193-block fp8 pool took ~345 ms against ~7 ms for int8 (experiments/attention_bench.py
    --kv_formats=int8,fp8). Indexing the same bytes through a uint8 view is exact and brought
    it to ~70 ms; what remains is XLA materialising the whole-pool view for each scatter.
    """
    if not _through_bytes(pages.dtype, platform):
        return pages[index]
    bits = jax.lax.bitcast_convert_type(pages, jnp.uint8)[index]
    return jax.lax.bitcast_convert_type(bits, pages.dtype)


def _scatter(pages: jax.Array, index: tuple, values: jax.Array, platform: str) -> jax.Array:
    """`pages.at[index].set(values)` in place for every cache dtype (uint8 view for float8,
    as in `take_pages`)."""
    if not _through_bytes(pages.dtype, platform):
        return pages.at[index].set(values.astype(pages.dtype))
    bits = jax.lax.bitcast_convert_type(pages, jnp.uint8)
    new = jax.lax.bitcast_convert_type(values.astype(pages.dtype), jnp.uint8)
    return jax.lax.bitcast_convert_type(bits.at[index].set(new), pages.dtype)


def copy_blocks(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """Copies whole blocks `src [n] -> dst [n]` in every layer (copy-on-write, defragmenting)."""

    def cp(x):
        if x is None:
            return None
        src_blocks = take_pages(x, (slice(None), src), cache.platform)
        return _scatter(x, (slice(None), dst), src_blocks, cache.platform)

    return dataclasses.replace(
        cache,
        k=cp(cache.k),
        v=cp(cache.v),
        k_scale=cp(cache.k_scale),
        v_scale=cp(cache.v_scale),
    )
