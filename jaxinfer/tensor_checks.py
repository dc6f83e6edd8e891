"""Checks every weight loader runs on the tensors it reads: finite values and a float dtype.

A checkpoint with one NaN or Inf weight loads fine and then generates token 0 forever; an int32
tensor where a float is expected used to be cast without a word. The loaders (HF safetensors in
`checkpoint.py`, quantized artifacts in `quant/artifact.py`, GGUF files) call these on the tensors
they read, named as the file names them, so the error points at the bad tensor.

Both take `named_arrays`: a mapping (or an iterable of pairs) from a tensor's name to a numpy or
jax array, in the order "first bad tensor" should mean.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

_SHOWN = 3  # bad tensors named in one message; the rest are counted


def _items(named_arrays) -> list[tuple[str, object]]:
    if isinstance(named_arrays, Mapping):
        return list(named_arrays.items())
    return list(named_arrays)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)  # numpy floats, bfloat16, float8 (ml_dtypes)


@jax.jit
def _nonfinite_counts(arrays: list) -> list:
    return [jnp.sum(~jnp.isfinite(a), dtype=jnp.int32) for a in arrays]  # one scalar each


def nonfinite_counts(named_arrays: Mapping | Iterable[tuple[str, object]]) -> dict[str, int]:
    """Number of NaN / Inf values of every float tensor that has any, in the given order.

    Host (numpy) arrays are counted with numpy, so nothing is copied to a device; device arrays
    with one jitted reduction and one transfer of the counts. Integer tensors are skipped (always
    finite).
    """
    items = [(n, a) for n, a in _items(named_arrays) if _is_float(a.dtype)]
    device = [(n, a) for n, a in items if isinstance(a, jax.Array)]
    counts: dict[str, int] = {}
    if device:
        got = jax.device_get(_nonfinite_counts([a for _, a in device]))
        counts.update({n: int(c) for (n, _), c in zip(device, got)})
    for name, arr in items:
        if not isinstance(arr, jax.Array):
            arr = np.asarray(arr)
            if arr.dtype.kind != "f":  # bfloat16 / float8 (ml_dtypes): count in float32
                arr = arr.astype(np.float32)
            counts[name] = int(arr.size - np.count_nonzero(np.isfinite(arr)))
    return {n: counts[n] for n, _ in items if counts[n]}


def check_finite(named_arrays: Mapping | Iterable[tuple[str, object]], where: str) -> None:
    """Raises ValueError naming the first tensor holding a NaN or Inf (and how many others do).

    Args:
      named_arrays: tensor name -> numpy or jax array, in file order.
      where: what was loaded (a path), for the message.

    Raises:
      ValueError: if any float tensor holds a non-finite value. The message names the loader's
        opt-out keyword, `check_finite=False`, for studying broken weights.
    """
    bad = nonfinite_counts(named_arrays)
    if not bad:
        return
    shown = [f"{n} ({c} NaN/Inf values)" for n, c in list(bad.items())[:_SHOWN]]
    more = f" and {len(bad) - _SHOWN} more tensor(s)" if len(bad) > _SHOWN else ""
    raise ValueError(
        f"non-finite weights in {where}: {', '.join(shown)}{more}. A model with NaN or Inf "
        "weights generates garbage; pass check_finite=False to load it anyway (to study it)."
    )


def check_float_dtype(named_arrays: Mapping | Iterable[tuple[str, object]], where: str) -> None:
    """Raises ValueError naming the first tensor whose dtype is not floating point.

    A dense weight stored as int32 / bool is a broken or mislabelled file, and casting it to a
    float would load integers as weights without a word.

    Args:
      named_arrays: tensor name -> array (anything with a `dtype`), in file order.
      where: what was loaded (a path), for the message.
    """
    for name, arr in _items(named_arrays):
        if not _is_float(arr.dtype):
            raise ValueError(
                f"tensor {name} in {where} has dtype {np.dtype(arr.dtype).name}; expected a "
                "floating-point dtype (float32, bfloat16, float16). It is refused rather than cast."
            )
