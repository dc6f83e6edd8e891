"""A persistent cache of compiled programs: a second process loads them instead of compiling.

A SmolLM2 engine step takes seconds to compile on a CPU, and a server compiles one program per step
shape before it serves (`experiments/serve.py --warmup`): with the hybrid drafter and γ = auto
that was nine minutes on 2 cores. JAX can keep compiled executables on disk, keyed by the
program, the compile options, the backend and the jax version (its persistent compilation
cache); a restarted process then deserializes them. vLLM and tpu-inference keep such a cache by
default; JAX does not, so this turns it on.

    path = ji.enable_compilation_cache()          # $JAXINFER_CACHE_DIR/xla, else ~/.cache/...
    ji.enable_compilation_cache("runs/xla")       # a folder of one's own
    ji.disable_compilation_cache()

The folder is bounded: past `max_size_bytes` (1 GiB unless told; None for no bound) the least
recently used programs are deleted as new ones are written (JAX's LRU cache, which takes a file
lock per access with `filelock`, so several processes can share one folder). A server's programs
take ~10 MB (SmolLM2 with the hybrid drafter: 30 programs).

The folder is trusted code (JAX's warning): whoever can write to it can make the process run what
they wrote, so keep it private. A cache entry compiled for other CPU features is refused by
XLA's loader and compiled again; jax #38445 reports CPUs where XLA refuses every entry, so a warm
start there is as slow as a cold one.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

ENV = "JAXINFER_CACHE_DIR"
DEFAULT_MAX_SIZE = 1 << 30  # bytes

# JAX's LRU cache names an entry's files so: the program, and its last use (int64 ns, little end).
_ENTRY, _ATIME = "-cache", "-atime"


def default_dir() -> str:
    """$JAXINFER_CACHE_DIR/xla, else $XDG_CACHE_HOME/jaxinfer/xla, else ~/.cache/jaxinfer/xla."""
    if os.environ.get(ENV):
        return os.path.join(os.environ[ENV], "xla")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfer", "xla")


def enable(
    path: str | None = None,
    *,
    min_compile_secs: float = 0.5,
    max_size_bytes: int | None = DEFAULT_MAX_SIZE,
) -> str:
    """Keeps every program that took at least `min_compile_secs` to compile in `path` (created;
    default `default_dir()`) and loads programs from it from now on; beyond `max_size_bytes` of
    programs the least recently used are deleted (None: no bound). Returns the folder.

    Takes effect for compilations after the call; programs already compiled stay in memory only.
    """
    path = os.path.abspath(os.path.expanduser(default_dir() if path is None else path))
    if min_compile_secs < 0:
        raise ValueError(f"min_compile_secs is {min_compile_secs}, expected >= 0")
    if max_size_bytes is not None and (
        isinstance(max_size_bytes, bool)
        or not isinstance(max_size_bytes, int)
        or max_size_bytes < 1
    ):
        raise ValueError(f"max_size_bytes is {max_size_bytes!r}, expected a positive int or None")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"compilation cache {path!r} exists and is not a folder")
    os.makedirs(path, mode=0o700, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"compilation cache {path!r} is not writable")
    if max_size_bytes is not None:
        _date_unbounded_entries(Path(path))
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_secs))
    jax.config.update(
        "jax_compilation_cache_max_size", -1 if max_size_bytes is None else max_size_bytes
    )
    _jax_cache.set_cache_dir(path)
    _jax_cache.reset_cache()  # JAX opens its cache once; a later folder needs a reset
    return path


def _date_unbounded_entries(folder: Path) -> None:
    """Gives every entry written without a bound (no last-use file) its modification time as
    last use: JAX's eviction reads that file for every entry and fails on the first one lacking
    it, which would stop the folder from taking new programs."""
    for entry in folder.glob(f"*{_ENTRY}"):
        atime = folder / (entry.name[: -len(_ENTRY)] + _ATIME)
        if not atime.exists():
            atime.write_bytes(int(entry.stat().st_mtime_ns).to_bytes(8, "little"))


def size_bytes(path: str) -> int:
    """The bytes of the programs in a cache folder (what `max_size_bytes` bounds)."""
    return sum(e.stat().st_size for e in Path(path).glob(f"*{_ENTRY}"))


def disable() -> None:
    """Stops reading and writing the persistent cache (the files stay)."""
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_max_size", -1)
    _jax_cache.set_cache_dir(None)
    _jax_cache.reset_cache()


def directory() -> str | None:
    """The folder in use, or None when the cache is off."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir
