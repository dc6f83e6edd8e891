"""Boundary checks of numbers: which values count as an int or a real number, in one place.

The policy, used by `SamplingParams`, the engine's `Request` and `EngineConfig`:

- an int is a Python int, a numpy integer scalar, or a 0-d numpy / jax array of an integer
  dtype; a float is any of those or a Python float, numpy floating scalar or 0-d floating array;
- bools (`True`, `np.bool_`) are never numbers here, though Python treats them as ints;
- a float is never an int, even when whole (`3.0`): an int field asks for a count, an id or a
  seed, and a float there is more likely a mistake than a spelling;
- accepted values come back as Python `int` / `float`, so the containers that keep them hash,
  compare and print as if the user had written Python numbers.

Values travel to the device as int32, so `INT32_MAX` bounds every int field that does.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

INT32_MAX = 2**31 - 1


def _scalar(value: Any) -> Any:
    """A numpy scalar or Python number for a number-like 0-d value, else None."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | float | np.generic):
        return value
    if getattr(value, "shape", None) != () or not hasattr(value, "dtype"):
        return None  # not an array, or not 0-d
    try:
        return np.asarray(value)[()]  # a 0-d jax or numpy array (a tracer raises)
    except Exception:
        return None


def as_int(value: Any) -> int | None:
    """`value` as a Python int if it is an int by the policy above, else None."""
    x = _scalar(value)
    if isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_):
        return int(x)
    return None


def as_float(value: Any) -> float | None:
    """`value` as a Python float if it is a real number by the policy above, else None."""
    x = _scalar(value)
    if isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_):
        return float(x)
    return None


def is_int(value: Any) -> bool:
    return as_int(value) is not None


def check_int(name: str, value: Any, lo: int = 0, hi: int = INT32_MAX) -> int:
    """`value` as a Python int in `[lo, hi]`; otherwise ValueError naming `name` and the value."""
    v = as_int(value)
    if v is None or not lo <= v <= hi:
        hi_text = "2**31 - 1" if hi == INT32_MAX else str(hi)
        raise ValueError(f"{name}={value!r} is invalid: expected an int in [{lo}, {hi_text}]")
    return v
