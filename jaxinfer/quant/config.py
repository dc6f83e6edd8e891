"""What calibration is asked to do (`QuantConfig`) and what it measured (`QuantReport`).

QuantConfig is the boundary of all calibration code: every field is checked for its kind and
range here (numbers by the policy of `jaxinfer.checks`), and it is saved with every artifact.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.checks import as_float, as_int
from jaxinfer.qtensor import INT4_BITS

METHODS = ("rtn", "gptq", "awq", "smoothquant")
BITS = {"rtn": (2, 3, 4, 8), "gptq": INT4_BITS, "awq": INT4_BITS, "smoothquant": (8,)}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How to quantize a model. Frozen and hashable; saved with every artifact."""

    method: str = "rtn"  # "rtn" | "gptq" | "awq" | "smoothquant"
    bits: int = 4  # 2, 3, 4 (Int4Weight); 8: rtn -> W8A16, smoothquant -> W8A8 (its only choice)
    group_size: int | None = 128  # G, a multiple of 8; None (or -1, stored as None): G = in
    sym: bool = False  # symmetric grids (fixed zero point 2**(bits-1))
    damp: float = 0.01  # GPTQ: dampening in [0, 1], fraction of mean(diag H) (the paper's 1%)
    act_order: bool = False  # GPTQ: sweep inputs by decreasing diag(H)
    static_groups: bool = True  # GPTQ act order: grids from the original weights, no perm
    blocksize: int = 128  # GPTQ: rows per lazy-update block
    # GPTQ: calibrate o, gate/up, down on inputs recomputed through the layer's already quantized
    # earlier linears (AutoGPTQ's default; measured neutral here, so off). RTN ignores statistics;
    # AWQ and SmoothQuant ignore it.
    true_sequential: bool = False
    awq_grid: int = 20  # AWQ: grid points of the scaling exponent in [0, 1)
    awq_clip: bool = True  # AWQ: search a clipping ratio per group
    awq_max_tokens: int = 4096  # AWQ: tokens of the subsample the scale search runs on
    alpha: float = 0.5  # SmoothQuant migration strength
    quantize_lm_head: bool = False  # embeddings always stay dense; the head only when asked
    batch_size: int = 8  # calibration sequences per jitted statistics call

    def __post_init__(self):
        # Every field is checked for its kind and range: QuantConfig is the boundary of all
        # calibration code, and a wrong kind (blocksize=2.5, sym="no") would otherwise run.
        # numpy scalars of the right kind are accepted and stored as Python values (hashable,
        # JSON-serialisable).
        def put(name, value):
            object.__setattr__(self, name, value)

        def check_int(name, lo):
            v = as_int(getattr(self, name))
            if v is None or v < lo:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected an integer >= {lo}")
            put(name, v)

        def check_float(name, lo, hi):
            v = as_float(getattr(self, name))
            if v is None or not lo <= v <= hi:  # NaN fails the comparison
                raise ValueError(
                    f"{name}={getattr(self, name)!r}; expected a number in [{lo}, {hi}]"
                )
            put(name, v)

        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; expected one of {METHODS}")
        for name in (
            "sym",
            "act_order",
            "static_groups",
            "true_sequential",
            "awq_clip",
            "quantize_lm_head",
        ):
            v = getattr(self, name)
            if not isinstance(v, bool | np.bool_):
                raise ValueError(f"{name}={v!r}; expected a bool")
            put(name, bool(v))
        check_int("bits", 1)
        if self.bits not in BITS[self.method]:
            raise ValueError(
                f"bits={self.bits!r} is not supported by {self.method}; expected one of "
                f"{BITS[self.method]}"
            )
        g = self.group_size
        gi = as_int(g)
        if gi == -1:
            put("group_size", None)  # AutoGPTQ / GPTQModel / AWQ spell per channel -1
        elif g is not None:
            if gi is None or gi < 8 or gi % 8:
                raise ValueError(
                    f"group_size={g!r}; expected None or -1 (per channel) or a multiple of 8"
                )
            put("group_size", gi)
        check_float("damp", 0.0, 1.0)  # a fraction of mean(diag H), as AutoGPTQ's damp_percent
        check_float("alpha", 0.0, 1.0)  # SmoothQuant's migration strength
        for name in ("blocksize", "awq_grid", "awq_max_tokens", "batch_size"):
            check_int(name, 1)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown QuantConfig field(s) {unknown}")
        return cls(**d)


@dataclasses.dataclass
class QuantReport:
    """What calibration measured: per-layer relative output errors and wall time."""

    method: str
    seconds: float  # wall time of the whole calibration
    errors: list[dict[str, float]]  # per layer: linear -> ‖X(W − Ŵ)‖² / ‖XW‖² on its inputs
    lm_head_error: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
