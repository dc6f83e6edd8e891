"""The engine's compiled programs against the process's limit on memory maps (Linux).

XLA's CPU backend loads every kernel of a compiled program as an object of its own, three memory
maps each (code, constants, data). One SmolLM2 step program has ~600-700 kernels, so every step
shape the engine compiles holds ~1,700-2,100 of the process's maps, and the engine compiles one
per shape its traffic meets (token bucket; with speculation, also logits rows and γ). Linux refuses
maps past `vm.max_map_count` (65,530 by default); the compilation that crosses it fails inside
LLVM ("Cannot allocate memory") and the process dies with a segmentation fault. Measured: the
hybrid drafter's server held 34 k maps after its warm-up and 52 k after twenty minutes of mixed
traffic; an experiment with three speculative engines in one process died at the limit.

`MapGuard.check` runs before every engine step. When the engine's jitted functions compiled
something since it last looked, it reads the process's map count; with less headroom left than
twice the most maps one step has added (and at least 1/8 of the limit), it drops every compiled
program (`jax.clear_caches()`, which unmaps their kernels) and logs a warning. What is used again
recompiles; the process lives. Raising the limit (`sysctl -w vm.max_map_count=262144`, as
Elasticsearch's install asks) keeps programs compiled. Where /proc is absent the guard does nothing.

    GUARD.check()        # the engine's call, before each step
    engine_compiles()    # compilations so far, those the guard dropped included
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax

from jaxinfer.engine import head_drafting, speculation, step

_log = logging.getLogger(__name__)

_JITS = (
    step._step, step._step_logprobs, step._copy,
    speculation._verify, speculation._draft_ngram, speculation._draft_model, speculation._mirror,
    speculation._ngram_rows, speculation._take_ngram,
    head_drafting._draft, head_drafting._observe,
)  # fmt: skip
_dropped = 0  # compilations dropped by clear() (engine_compiles counts them)


def engine_compiles() -> int:
    """Compilations so far of the engine's jitted functions (step, verify, drafts, mirror, heads),
    those dropped by `clear` included: a benchmark compares it before and after a timed run to
    tell one that compiled."""
    return _dropped + sum(f._cache_size() for f in _JITS)


def clear() -> None:
    """Drops every compiled program of the process (`jax.clear_caches()`), counting the engine's."""
    global _dropped
    _dropped = engine_compiles()
    jax.clear_caches()


def map_limit() -> int | None:
    """`vm.max_map_count`, or None where it cannot be read (not Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def map_count() -> int | None:
    """Memory maps the process holds now, or None where /proc/self/maps cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


class MapGuard:
    """Drops the compiled programs before a compilation could cross the map limit (see above)."""

    def __init__(
        self,
        limit: int | None = None,
        count: Callable[[], int | None] = map_count,
        compiles: Callable[[], int] = engine_compiles,
        drop: Callable[[], None] = clear,
    ):
        self.limit = map_limit() if limit is None else limit
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"MapGuard: limit must be > 0, got {self.limit}")
        self._count, self._compiles, self._drop = count, compiles, drop
        self.seen_compiles = compiles()
        self.last_maps = count() if self.limit is not None else None
        self.step_growth = 0  # the most maps one step's compilations added
        self.drops = 0

    @property
    def reserve(self) -> int:
        """Headroom kept free: two of the largest step's compilations, at least 1/8 the limit."""
        return max(2 * self.step_growth, self.limit // 8)

    def check(self) -> bool:
        """Checks the headroom if anything compiled since the last check; drops the compiled
        programs (True) if it is low."""
        n = self._compiles()
        if self.limit is None or n == self.seen_compiles:
            return False
        self.seen_compiles = n
        maps = self._count()
        if maps is None:
            return False
        if self.last_maps is not None:
            self.step_growth = max(self.step_growth, maps - self.last_maps)
        self.last_maps = maps
        if maps <= self.limit - self.reserve:
            return False
        _log.warning(
            "%d of the process's %d memory maps (vm.max_map_count) are in use, most by XLA's "
            "compiled kernels; dropping every compiled program so that the next compilation "
            "cannot cross the limit (programs used again recompile). "
            "`sysctl -w vm.max_map_count=262144` keeps them.",
            maps, self.limit,
        )  # fmt: skip
        self._drop()
        self.drops += 1
        self.seen_compiles = self._compiles()
        self.last_maps = self._count()
        return True


GUARD = MapGuard()  # the process's; every engine's step checks it
