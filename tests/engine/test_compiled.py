"""The map guard (jaxinfer/engine/compiled.py): it drops the compiled programs before a compilation
could cross vm.max_map_count, only then, and the engine goes on with the same tokens."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.engine import Engine, EngineConfig, compiled
from tests.helpers import random_params

LINUX = sys.platform.startswith("linux")


class _Fake:
    """Scripted map counts and compilation counter; records reads and drops."""

    def __init__(self, maps: int, compiles: int = 0):
        self.maps, self.n, self.reads, self.drops = maps, compiles, 0, 0

    def count(self):
        self.reads += 1
        return self.maps

    def compiles(self):
        return self.n

    def drop(self):
        self.drops += 1
        self.maps = 1_000


def _guard(fake: _Fake, limit: int | None = 80_000) -> compiled.MapGuard:
    return compiled.MapGuard(limit, count=fake.count, compiles=fake.compiles, drop=fake.drop)


def test_guard_reads_the_maps_only_after_a_compilation():
    fake = _Fake(maps=10_000)
    guard = _guard(fake)
    reads = fake.reads
    fake.maps = 79_999  # past any reserve, but nothing compiled: not even read
    assert not guard.check() and fake.reads == reads and fake.drops == 0


def test_guard_drops_when_the_headroom_is_below_the_reserve():
    fake = _Fake(maps=10_000)
    guard = _guard(fake, limit=121_000)
    assert guard.reserve == 121_000 // 8  # no step seen: 1/8 of the limit
    fake.n, fake.maps = 1, 13_000  # a step that compiled 3,000 maps' worth
    assert not guard.check() and guard.step_growth == 3_000
    fake.n, fake.maps = 2, 40_000  # the largest step so far: 27,000 maps
    assert not guard.check() and guard.step_growth == 27_000
    assert guard.reserve == 54_000
    fake.n, fake.maps = 3, 121_000 - 54_000  # exactly the reserve left: kept
    assert not guard.check() and fake.drops == 0
    fake.n, fake.maps = 4, 121_000 - 54_000 + 1  # one map less: dropped
    assert guard.check() and fake.drops == 1 and guard.drops == 1
    assert guard.last_maps == 1_000  # re-read after the drop
    fake.n, fake.maps = 5, 2_000  # a compilation after the drop, far below: kept
    assert not guard.check() and fake.drops == 1


def test_guard_does_nothing_without_a_limit_and_refuses_a_bad_one(monkeypatch):
    monkeypatch.setattr(compiled, "map_limit", lambda: None)  # no /proc (not Linux)
    fake = _Fake(maps=10**9)
    guard = _guard(fake, limit=None)
    fake.n = 1
    assert not guard.check() and fake.reads == 0 and fake.drops == 0
    with pytest.raises(ValueError, match="limit must be > 0, got 0"):
        _guard(_Fake(maps=1), limit=0)


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_limit_and_count_are_read_from_proc():
    with open("/proc/sys/vm/max_map_count") as f:
        assert compiled.map_limit() == int(f.read())
    with open("/proc/self/maps") as f:
        independent = len(f.readlines())
    assert independent > 100 and abs(compiled.map_count() - independent) <= 8


CFG = ji.preset("tiny-llama").replace(eos_token_id=None)
ECFG = EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, backend="reference")


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_engine_goes_on_with_the_same_tokens_after_its_programs_are_dropped(monkeypatch):
    """A limit just above the maps in use: every compiling step leaves less headroom than the
    reserve, so the guard drops the engine's programs (for real: jax.clear_caches) mid-run."""
    params = random_params(CFG, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in (5, 11, 3)]
    sp = ji.SamplingParams(temperature=0, max_tokens=5)
    want = [o.token_ids for o in ji.generate(CFG, params, prompts, sp)]

    jax.clear_caches()
    maps = compiled.map_count()
    guard = compiled.MapGuard(limit=maps * 8 // 7 + 8)  # less than 1/8 of the limit left: drop
    monkeypatch.setattr(compiled, "GUARD", guard)
    before = compiled.engine_compiles()
    engine = Engine(CFG, params, ECFG)
    got = [o.token_ids for o in engine.generate(prompts, sp)]
    assert got == want
    assert guard.drops >= 1  # the programs were dropped at least once, and recompiled
    assert compiled.engine_compiles() > before  # monotonic: dropped compilations still count

    # Dropping really unmaps: the step's kernels go away with jax.clear_caches().
    compiled_maps = compiled.map_count()
    compiled.clear()
    assert compiled.map_count() < compiled_maps
    assert sum(f._cache_size() for f in compiled._JITS) == 0
