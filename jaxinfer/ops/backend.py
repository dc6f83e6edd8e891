"""Backend names of the ops and their resolution.

"xla" is the CPU default, "reference" the oracle, "pallas" the Triton kernels (the GPU default)
and "pallas-interpret" the kernels in interpret mode (tests on a CPU). "auto" reads the platform
once: the model's entry points (`forward`, `forward_dense`) resolve it before tracing their
layers, so no layer reads the platform inside a trace.
"""

from __future__ import annotations

import jax

BACKENDS = ("auto", "xla", "reference", "pallas", "pallas-interpret")


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """ "auto" -> "pallas" on GPU, "xla" elsewhere; validates the name.

    Args:
      backend: one of `BACKENDS`.
      platform: the platform "auto" resolves for; default `jax.default_backend()`.

    Returns:
      A concrete backend (never "auto").
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        platform = platform or jax.default_backend()
        return "pallas" if platform == "gpu" else "xla"
    return backend


def is_pallas(backend: str) -> bool:
    """Whether a resolved backend runs the Pallas kernels."""
    return backend.startswith("pallas")
