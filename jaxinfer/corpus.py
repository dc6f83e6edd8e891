"""The corpus: Python source files of the standard library, their splits, the shipped splits.

The corpus is Python source code: the standard library of the running interpreter, which exists on
every machine, so training needs no download. Test suites, `site-packages`, files that are not valid
UTF-8 and generated tables over `MAX_FILE_BYTES` are left out (see `stdlib_files`).

Splits are a pure function of a file's path relative to the stdlib root (`split_of`): the sha1 of
the path picks one of 100 buckets, 90 for train, 5 for validation, 5 for test. A file keeps its
split on every Python version that has it. The calibration split (`calibration_paths`) is a
deterministic ~360 kB subset of train.

Quality figures must be reproducible on any Python version, so the test and calibration splits are
shipped inside the package (`assets/data/{test,calib}.json.xz`, built by
`experiments/build_corpus.py`); train and validation are read from the local standard library.

Host-side code only: no JAX.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import platform
import sysconfig
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

SPLITS = ("train", "validation", "test", "calib")
LOCAL_SPLITS = ("train", "validation")  # read from the running interpreter's stdlib
SHIPPED_SPLITS = ("test", "calib")  # read from assets/data, identical on every machine

MAX_FILE_BYTES = 200_000  # larger stdlib files are generated tables (pydoc topics, ...)
SPLIT_SALT = "jaxinfer-split-v1:"  # changing it reshuffles every split
CALIB_SALT = "jaxinfer-calib-v1:"
NUM_BUCKETS = 100
TRAIN_BUCKETS = 90  # buckets [0, 90) train, [90, 95) validation, [95, 100) test
VALIDATION_BUCKETS = 5
CALIB_TARGET_BYTES = 360_000  # stop adding calibration files once this much text is in
CALIB_MAX_BYTES = 400_000  # never exceed this
CALIB_MAX_FILE_BYTES = 40_000  # many mid-sized files rather than a few big ones

# Folders that hold no library source: test suites, installed packages, bytecode.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "idle_test", "tests"})

SHIPPED_FORMAT = "jaxinfer-corpus-v1"
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DATA_DIR = ASSETS_DIR / "data"


# ---------------------------------------------------------------------------------------------
# Corpus and splits
# ---------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    """Returns the running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded(rel_path: str) -> bool:
    """Whether a stdlib-relative path is left out of the corpus regardless of its content.

    Left out: anything under a folder named `test*`, `tests`, `idle_test`, `site-packages`,
    `dist-packages` or `__pycache__`; files named `test_*.py`; non-`.py` files; and the
    build-machine-generated `_sysconfigdata_*.py`.

    Args:
      rel_path: path relative to the stdlib root, with `/` separators.

    Returns:
      True when the file is not part of the corpus.
    """
    *folders, name = rel_path.split("/")
    if any(_is_excluded_dir(folder) for folder in folders):
        return True
    return (
        not name.endswith(".py") or name.startswith("test_") or name.startswith("_sysconfigdata_")
    )


def _is_excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIRS or name.startswith("test")


def stdlib_files(root: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """The corpus: every eligible `.py` file of a standard library, sorted by relative path.

    A file is eligible when `is_excluded` is false, it is at most `MAX_FILE_BYTES` bytes, it is
    valid UTF-8 and it holds more than whitespace. Text is returned exactly as stored (no newline
    translation), so a file's text is the same on every operating system.

    Args:
      root: the stdlib folder; None for the running interpreter's (`stdlib_root()`).

    Returns:
      A list of (relative path with `/` separators, text), sorted by path.
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"stdlib root {str(root)!r} is not a directory")
    return list(_stdlib_files_cached(str(root.resolve())))


@lru_cache(maxsize=4)
def _stdlib_files_cached(root: str) -> tuple[tuple[str, str], ...]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _is_excluded_dir(d))  # prune in place
        for name in filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if is_excluded(rel) or path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip():
                files.append((rel, text))
    return tuple(sorted(files))


def _bucket(salt: str, rel_path: str, num_buckets: int) -> int:
    digest = hashlib.sha1((salt + rel_path).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % num_buckets


def split_of(rel_path: str) -> str:
    """The split a file belongs to, from its stdlib-relative path alone.

    Args:
      rel_path: path relative to the stdlib root with `/` separators, e.g. "json/decoder.py".

    Returns:
      "train", "validation" or "test". Calibration files are a subset of "train"
      (`calibration_paths`).
    """
    if not isinstance(rel_path, str) or not rel_path:
        raise ValueError(f"rel_path must be a non-empty string, got {rel_path!r}")
    if rel_path.startswith("/") or "\\" in rel_path:
        raise ValueError(f"rel_path must be relative with '/' separators, got {rel_path!r}")
    bucket = _bucket(SPLIT_SALT, rel_path, NUM_BUCKETS)
    if bucket < TRAIN_BUCKETS:
        return "train"
    if bucket < TRAIN_BUCKETS + VALIDATION_BUCKETS:
        return "validation"
    return "test"


def calibration_paths(files: Sequence[tuple[str, str]]) -> list[str]:
    """The calibration subset of the train files, ~`CALIB_TARGET_BYTES` of text.

    Train files are visited in the order of a second, salted sha1 of their path; a file is taken
    when it is at most `CALIB_MAX_FILE_BYTES` and keeps the total within `CALIB_MAX_BYTES`; the walk
    stops once the total reaches `CALIB_TARGET_BYTES`. The choice depends only on which files exist.

    Args:
      files: (relative path, text) pairs, e.g. `stdlib_files()`.

    Returns:
      The chosen relative paths, sorted.
    """
    train = [(p, t) for p, t in files if split_of(p) == "train"]
    train.sort(key=lambda f: hashlib.sha1((CALIB_SALT + f[0]).encode("utf-8")).digest())
    chosen, total = [], 0
    for path, text in train:
        size = len(text.encode("utf-8"))
        if size > CALIB_MAX_FILE_BYTES or total + size > CALIB_MAX_BYTES:
            continue
        chosen.append(path)
        total += size
        if total >= CALIB_TARGET_BYTES:
            break
    return sorted(chosen)


def local_split_files(
    name: str, files: Sequence[tuple[str, str]] | None = None
) -> list[tuple[str, str]]:
    """The (path, text) pairs of a split computed from a local standard library.

    Args:
      name: one of `SPLITS`.
      files: the corpus to split; None for `stdlib_files()`.

    Returns:
      The split's (relative path, text) pairs, sorted by path.
    """
    _check_split(name, SPLITS)
    files = stdlib_files() if files is None else list(files)
    if name == "calib":
        keep = set(calibration_paths(files))
        return [f for f in files if f[0] in keep]
    return [f for f in files if split_of(f[0]) == name]


def _check_split(name: str, allowed: Sequence[str]) -> None:
    if name not in allowed:
        raise ValueError(f"split must be one of {tuple(allowed)}, got {name!r}")


# ---------------------------------------------------------------------------------------------
# Shipped splits
# ---------------------------------------------------------------------------------------------


def shipped_path(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    """Where a shipped split lives: `<data_dir>/<name>.json.xz` (default: the package assets)."""
    _check_split(name, SHIPPED_SPLITS)
    return Path(data_dir if data_dir is not None else DATA_DIR) / f"{name}.json.xz"


def write_shipped_split(
    name: str, files: Sequence[tuple[str, str]], data_dir: str | os.PathLike | None = None
) -> Path:
    """Writes a split as xz-compressed JSON, byte-identical for identical input.

    The JSON object is {"format", "split", "python_version", "documents": [{"path", "text"}]}.

    Args:
      name: "test" or "calib".
      files: the split's (relative path, text) pairs.
      data_dir: output folder; None for the package assets.

    Returns:
      The written path.
    """
    path = shipped_path(name, data_dir)
    payload = {
        "format": SHIPPED_FORMAT,
        "split": name,
        "python_version": platform.python_version(),
        "documents": [{"path": p, "text": t} for p, t in sorted(files)],
    }
    raw = json.dumps(payload, ensure_ascii=False, indent=0).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    return path


def read_shipped_split(name: str, data_dir: str | os.PathLike | None = None) -> dict:
    """Reads a shipped split.

    Args:
      name: "test" or "calib".
      data_dir: folder holding the files; None for the package assets.

    Returns:
      The JSON object written by `write_shipped_split`: "python_version" is the interpreter the
      files came from, "documents" a list of {"path", "text"} sorted by path.
    """
    path = shipped_path(name, data_dir)
    if not path.is_file():
        raise ValueError(
            f"shipped split {name!r} not found at {str(path)!r}; "
            "build it with `python -m experiments.build_corpus`"
        )
    payload = json.loads(lzma.decompress(path.read_bytes()).decode("utf-8"))
    if payload.get("format") != SHIPPED_FORMAT or payload.get("split") != name:
        raise ValueError(
            f"{str(path)!r} holds format={payload.get('format')!r} split={payload.get('split')!r}, "
            f"expected format={SHIPPED_FORMAT!r} split={name!r}"
        )
    return payload


def load_split(name: str) -> list[str]:
    """The documents (file texts) of a split, sorted by path.

    Args:
      name: "train" or "validation" (from the local standard library), "test" or "calib" (from
        the files shipped in the package, identical on every machine).

    Returns:
      A list of document texts.
    """
    _check_split(name, SPLITS)
    if name in LOCAL_SPLITS:
        return [text for _, text in local_split_files(name)]
    return [doc["text"] for doc in read_shipped_split(name)["documents"]]
