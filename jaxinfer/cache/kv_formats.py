"""KV-cache quantization: int8 and fp8 (e4m3) vectors with one float32 scale per (token, head).

  int8  q = round(x / s) in [-127, 127],  s = max|x| / 127
  fp8   q = (x / s) as float8_e4m3fn,     s = max|x| / 448 (the largest finite e4m3 value)

Each scale covers one head vector `[D]`, so the cache stores `[..., D]` values plus `[...]`
scales (2 · K · 4 bytes per token and layer next to 2 · K · D bytes of values). An all-zero
vector gets scale 1 and codes 0. `dequantize_kv(quantize_kv(x))` is within half an int8 step
(s / 2) of x, or within e4m3 rounding (relative 2⁻⁴ for normal values, s · 2⁻¹⁰ near zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KV_QUANT_FORMATS = ("int8", "fp8")
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def kv_storage_dtype(fmt: str):
    """The storage dtype of a quantized KV format ("int8" or "fp8")."""
    _check_format(fmt)
    return jnp.dtype(_STORAGE[fmt])


def _check_format(fmt: str) -> None:
    if fmt not in KV_QUANT_FORMATS:
        raise ValueError(f"KV format {fmt!r} is not supported; expected one of {KV_QUANT_FORMATS}")


def quantize_kv(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """Quantizes key or value vectors.

    Args:
      x: `[..., D]` float keys or values (e.g. `[T, K, D]`).
      fmt: "int8" or "fp8" (float8_e4m3fn).

    Returns:
      (codes `[..., D]` int8 or float8_e4m3fn, scales `[...]` float32).
    """
    _check_format(fmt)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)  # [...]
    top = 127.0 if fmt == "int8" else _FP8_MAX
    scale = jnp.where(amax > 0, amax / top, 1.0)  # [...]
    y = x32 / scale[..., None]  # [..., D] within [-top, top]
    if fmt == "int8":
        return jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), scale
    return jnp.clip(y, -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn), scale


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Inverse of `quantize_kv`: `q [..., D]`, `scale [...]` -> `[..., D]` in `dtype`."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, fmt: str, float_bytes: int = 2
) -> int:
    """Bytes one token occupies in the KV cache: 2 · L · K · D · bytes (+ 2 · L · K · 4 scales).

    Args:
      num_layers, num_kv_heads, head_dim: L, K, D.
      fmt: "float" (values of `float_bytes` each), "int8" or "fp8".
      float_bytes: bytes of a float cache element (2 for bf16/fp16, 4 for fp32).

    Returns:
      The byte count per token.
    """
    vectors = 2 * num_layers * num_kv_heads  # one K and one V vector per layer and kv head
    if fmt == "float":
        return vectors * head_dim * float_bytes
    _check_format(fmt)
    return vectors * (head_dim * 1 + 4)  # 1-byte codes plus one float32 scale per vector
