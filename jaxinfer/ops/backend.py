"""Backend names of the ops and their resolution.

"xla" is the CPU default, "reference" the oracle, "pallas" the Triton kernels (the GPU default)
and "pallas-interpret" the kernels in interpret mode (tests on a CPU). "auto" reads the platform
once: the model's entry points (`forward`, `forward_dense`) resolve it before tracing their
layers, so no layer reads the platform inside a trace.

`resolve_platform` is the one reader of the default platform. The public entry points
(`ji.generate`, the speculative loop, `ji.Engine`, `ji.score`, the eval windows) call it once on
the host and pass the platform and a concrete backend down as static arguments, so no jitted
function reads global platform state (`forward` resolves against `cache.platform`).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

BACKENDS = ("auto", "xla", "reference", "pallas", "pallas-interpret")


# Set only while tracing for a GPU lowering on a machine without one (kernel_compile_check).
_GPU_LOWERING = contextvars.ContextVar("jaxinfer_gpu_lowering", default=False)


@contextlib.contextmanager
def lowering_for_gpu():
    """Lets `backend="pallas"` trace on a CPU host, for code lowered with `lowering_platforms`
    `("cuda",)` and never run here (experiments/kernel_compile_check.py)."""
    token = _GPU_LOWERING.set(True)
    try:
        yield
    finally:
        _GPU_LOWERING.reset(token)


def resolve_platform(platform: str | None = None) -> str:
    """`platform` checked, or, if None, the default device's platform ("cpu", "gpu", "tpu").

    Called on the host at a public boundary; the result travels down as a static value.
    """
    if platform is None:
        return jax.default_backend()
    if not isinstance(platform, str) or not platform:
        raise ValueError(f"platform={platform!r}; expected a platform name such as 'cpu' or 'gpu'")
    return platform


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """ "auto" -> "pallas" on GPU, "xla" elsewhere; validates the name.

    Args:
      backend: one of `BACKENDS`.
      platform: the platform "auto" resolves for (and "pallas" is checked against); None:
        `resolve_platform()`, read only for those two names.

    Returns:
      A concrete backend (never "auto").

    Raises:
      ValueError: for an unknown name, and for "pallas" on a CPU: the compiled kernels need a GPU
        (JAX would otherwise fail inside the lowering with an internal message).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "pallas" if resolve_platform(platform) == "gpu" else "xla"
    if backend == "pallas" and resolve_platform(platform) == "cpu" and not _GPU_LOWERING.get():
        raise ValueError(
            'backend="pallas" runs the compiled Pallas kernels, which need a GPU, and this JAX '
            'runs on a CPU; use backend="pallas-interpret" to run the same kernels on a CPU '
            '(slow, for tests), or "xla" / "auto" for the fast CPU path'
        )
    return backend


def is_pallas(backend: str) -> bool:
    """Whether a resolved backend runs the Pallas kernels."""
    return backend.startswith("pallas")
