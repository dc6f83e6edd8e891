"""The persistent compilation cache: a second process loads the engine's programs, same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxinfer as ji
from jaxinfer import compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def restore_cache():
    before = compilation_cache.directory()
    yield
    if before is None:
        compilation_cache.disable()
    else:
        compilation_cache.enable(before)


def test_enable_makes_a_private_folder_and_disable_stops(tmp_path, restore_cache):
    path = ji.enable_compilation_cache(str(tmp_path / "a" / "xla"), min_compile_secs=0)
    assert path == str(tmp_path / "a" / "xla") and os.path.isdir(path)
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert compilation_cache.directory() == path
    ji.disable_compilation_cache()
    assert compilation_cache.directory() is None


def test_bad_arguments_name_the_value(tmp_path, restore_cache):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="file.*not a folder"):
        ji.enable_compilation_cache(str(f))
    with pytest.raises(ValueError, match="min_compile_secs is -1"):
        ji.enable_compilation_cache(str(tmp_path / "c"), min_compile_secs=-1)
    assert not (tmp_path / "c").exists()  # refused before anything was made
    for bad in (0, -1, True, 1.5, "1G"):
        with pytest.raises(ValueError, match=f"max_size_bytes is {bad!r}"):
            ji.enable_compilation_cache(str(tmp_path / "c"), max_size_bytes=bad)
    assert not (tmp_path / "c").exists()


def _entries(folder) -> set[str]:
    return {n for n in os.listdir(folder) if n.endswith("-cache")}


def test_a_bounded_folder_drops_the_least_recently_used(tmp_path, restore_cache):
    """Entries written without a bound, then a bound below their total: the next program evicts
    the oldest until the folder fits, and keeps the rest."""
    folder = tmp_path / "xla"
    ji.enable_compilation_cache(str(folder), min_compile_secs=0, max_size_bytes=None)
    x = jnp.arange(64.0)
    written = []  # the entries of each program, in the order they were written
    for k in range(4):
        before = _entries(folder)
        jax.jit(lambda v, k=k: jnp.sin(v) * (k + 2.0))(x).block_until_ready()
        written.append(sorted(_entries(folder) - before))
        assert written[-1], "every program was written"
    assert not [n for n in os.listdir(folder) if n.endswith("-atime")]  # unbounded: no last use
    bound = compilation_cache.size_bytes(str(folder)) - 1
    ji.enable_compilation_cache(str(folder), min_compile_secs=0, max_size_bytes=bound)
    before = _entries(folder)
    jax.jit(lambda v: jnp.cos(v) * 7.0)(x).block_until_ready()
    new = _entries(folder) - before
    assert new and compilation_cache.size_bytes(str(folder)) <= bound
    kept = [bool(set(w) & _entries(folder)) for w in written]
    assert kept[0] is False  # the oldest went first
    assert kept == sorted(kept)  # and only a prefix of the oldest went
    for e in _entries(folder):  # every entry has its last use now
        assert os.path.exists(folder / (e[: -len("-cache")] + "-atime"))


def test_default_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "mine"))
    assert compilation_cache.default_dir() == str(tmp_path / "mine" / "xla")
    monkeypatch.delenv(compilation_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation_cache.default_dir() == str(tmp_path / "xdg" / "jaxinfer" / "xla")


_CHILD = """
import json, sys
from jax import monitoring
import jaxinfer as ji
events = {"hits": 0, "requests": 0}
def listen(name, **kw):
    if name == "/jax/compilation_cache/cache_hits":
        events["hits"] += 1
    if name == "/jax/compilation_cache/compile_requests_use_cache":
        events["requests"] += 1
monitoring.register_event_listener(listen)
cfg, params = ji.load_checkpoint(ji.models.path("target"))  # before: its programs are not cached
ji.enable_compilation_cache(sys.argv[1], min_compile_secs=0)
# Fixed T buckets: "measured" ones follow this process's timings, and so can the step shapes.
ecfg = ji.EngineConfig(num_blocks=32, max_num_batched_tokens=32, token_buckets="pow2")
engine = ji.Engine(cfg, params, ecfg)
outs = engine.generate([[5, 6, 7] * 5, [9] * 20], ji.SamplingParams(temperature=0, max_tokens=8))
print("RESULT" + json.dumps({**events, "tokens": [list(o.token_ids) for o in outs]}))
"""


def _run(folder) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT") :])


def test_a_second_process_loads_every_engine_program(tmp_path):
    folder = tmp_path / "xla"
    first = _run(folder)
    entries = [n for n in os.listdir(folder) if n.endswith("-cache")]
    assert first["hits"] == 0 and first["requests"] >= 3  # the engine's step, sampling, ...
    assert len(entries) == first["requests"]  # every program compiled was written
    second = _run(folder)
    assert second["requests"] == first["requests"]
    assert second["hits"] == second["requests"]  # none compiled again
    assert second["tokens"] == first["tokens"] and all(len(t) == 8 for t in first["tokens"])
