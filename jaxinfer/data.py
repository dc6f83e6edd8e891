"""Corpora, the shipped tokenizer, token streams and calibration batches.

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

The tokenizer is a byte-level BPE (vocabulary 4096) trained on the train split, shipped as
`assets/tokenizer/tokenizer.json`. Its special tokens have fixed ids:

    <|bos|> = 0   begins every document in a token stream
    <|eos|> = 1   ends every document in a token stream
    <|pad|> = 2   padding; never produced by `encode`

The tokenizer has no post-processor: `encode` returns the text's tokens only, and the documents of
a stream are wrapped in bos/eos by `tokenize_documents`. Host-side code only: numpy, no JAX.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import platform
import sysconfig
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# ---------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # in id order: the trainer adds them first
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
DEFAULT_VOCAB_SIZE = 4096  # small enough for a tiny embedded model's embedding table
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256  # specials + the 256 byte-level symbols

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
TOKENIZER_PATH = ASSETS_DIR / "tokenizer" / "tokenizer.json"


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
            "build it with `python experiments/build_corpus.py`"
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


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(
    docs: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE, *, min_frequency: int = 2
) -> Tokenizer:
    """Trains a byte-level BPE tokenizer with the fixed special tokens.

    Byte-level pre-tokenizer (no prefix space) and decoder, no normalizer: decode(encode(x)) == x
    for any text. Specials get ids 0, 1, 2 (`BOS_ID`, `EOS_ID`, `PAD_ID`); every byte is in the
    vocabulary, so no text is unknown. Deterministic for identical docs.

    Args:
      docs: training documents.
      vocab_size: total vocabulary, specials and the 256 byte symbols included.
      min_frequency: a pair must occur this often to be merged.

    Returns:
      The trained `tokenizers.Tokenizer`.
    """
    if isinstance(docs, str):
        raise ValueError("docs must be a sequence of strings, got a single str")
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB_SIZE}, got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = list(docs)
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    _check_specials(tokenizer)
    return tokenizer


def _check_specials(tokenizer: Tokenizer) -> None:
    for token, expected in zip(SPECIAL_TOKENS, (BOS_ID, EOS_ID, PAD_ID)):
        got = tokenizer.token_to_id(token)
        if got != expected:
            raise ValueError(f"special token {token!r} has id {got!r}, expected {expected}")


def load_tokenizer() -> Tokenizer:
    """The tokenizer shipped with the package (`assets/tokenizer/tokenizer.json`).

    It also loads in transformers with
    `PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_PATH))` and encodes identically there.

    Returns:
      A `tokenizers.Tokenizer` whose specials have ids `BOS_ID`, `EOS_ID`, `PAD_ID`.
    """
    if not TOKENIZER_PATH.is_file():
        raise ValueError(
            f"shipped tokenizer not found at {str(TOKENIZER_PATH)!r}; "
            "build it with `python experiments/build_corpus.py`"
        )
    tokenizer = Tokenizer.from_file(str(TOKENIZER_PATH))
    _check_specials(tokenizer)
    return tokenizer


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A sha1 hex digest of the tokenizer's serialized form, for cache keys."""
    return hashlib.sha1(tokenizer.to_str().encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------
# Token streams and windows
# ---------------------------------------------------------------------------------------------


def tokenize_documents(
    tokenizer: Tokenizer,
    docs: Sequence[str],
    *,
    add_bos: bool = True,
    add_eos: bool = True,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> np.ndarray:
    """Tokenizes documents into one flat stream, each document wrapped in bos/eos.

    Args:
      tokenizer: a `tokenizers.Tokenizer`; its post-processor is bypassed.
      docs: document texts, concatenated in order.
      add_bos: put the bos id before every document.
      add_eos: put the eos id after every document.
      bos_id: the bos id; None looks up `BOS_TOKEN` in the tokenizer.
      eos_id: the eos id; None looks up `EOS_TOKEN` in the tokenizer.

    Returns:
      [sum of document lengths (+ 1 per bos/eos)] int32.
    """
    if isinstance(docs, str):
        raise ValueError("docs must be a sequence of strings, got a single str")
    docs = list(docs)
    bad = [type(d).__name__ for d in docs if not isinstance(d, str)]
    if bad:
        raise ValueError(f"docs must all be str, got {bad[0]}")
    bos = [_special_id(tokenizer, BOS_TOKEN, bos_id)] if add_bos else []
    eos = [_special_id(tokenizer, EOS_TOKEN, eos_id)] if add_eos else []
    encodings = tokenizer.encode_batch(docs, add_special_tokens=False)
    pieces = [np.asarray(bos + enc.ids + eos, dtype=np.int32) for enc in encodings]  # [len_i + 2]
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def _special_id(tokenizer: Tokenizer, token: str, given: int | None) -> int:
    if given is not None:
        return int(given)
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ValueError(f"tokenizer has no {token!r}; pass its id explicitly")
    return found


def token_stream(
    split: str, tokenizer: Tokenizer, cache_dir: str | os.PathLike | None = None
) -> np.ndarray:
    """A split tokenized into one flat stream (`tokenize_documents` with bos and eos).

    Args:
      split: one of `SPLITS`.
      tokenizer: the tokenizer.
      cache_dir: when given, the stream is cached there as `<split>-<key>.npy`, where the key hashes
        the tokenizer and the documents, so a changed stdlib or tokenizer never hits a stale file.

    Returns:
      [num_tokens] int32.
    """
    docs = load_split(split)
    if cache_dir is None:
        return tokenize_documents(tokenizer, docs)
    key = hashlib.sha1(tokenizer_fingerprint(tokenizer).encode("utf-8"))
    for doc in docs:
        key.update(hashlib.sha1(doc.encode("utf-8")).digest())
    path = Path(cache_dir) / f"{split}-{key.hexdigest()[:16]}.npy"
    if path.is_file():
        return np.load(path)
    stream = tokenize_documents(tokenizer, docs)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy.tmp")
    with os.fdopen(fd, "wb") as f:
        np.save(f, stream)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    return stream


def _check_stream(stream: np.ndarray, min_len: int) -> np.ndarray:
    stream = np.asarray(stream)
    if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
        raise ValueError(f"stream must be a 1-D integer array, got {stream.dtype} {stream.shape}")
    if stream.shape[0] < min_len:
        raise ValueError(f"stream has {stream.shape[0]} tokens, need at least {min_len}")
    return stream


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def random_windows(
    stream: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator
) -> np.ndarray:
    """Random windows for next-token training: inputs `w[:, :-1]`, targets `w[:, 1:]`.

    Args:
      stream: [N] integer token stream.
      batch_size: number of windows.
      seq_len: tokens per input sequence.
      rng: numpy generator that picks the start of each window uniformly.

    Returns:
      [batch_size, seq_len + 1] int32.
    """
    _check_positive("batch_size", batch_size)
    _check_positive("seq_len", seq_len)
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    stream = _check_stream(stream, seq_len + 1)
    starts = rng.integers(0, stream.shape[0] - seq_len, size=batch_size)  # [B], start + seq_len < N
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]  # [B, seq_len + 1]
    return stream[index].astype(np.int32)


def eval_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """Deterministic windows over the first `max_tokens` tokens, for perplexity at a fixed budget.

    Window i is `stream[i * seq_len : i * seq_len + seq_len + 1]`: consecutive windows share one
    boundary token, so their targets (`w[:, 1:]`) do not overlap and every token after the first,
    up to `num_windows * seq_len + 1 <= max_tokens`, is predicted exactly once.

    Args:
      stream: [N] integer token stream.
      seq_len: tokens per input sequence.
      max_tokens: the token budget; windows read only `stream[:max_tokens]`.

    Returns:
      [num_windows, seq_len + 1] int32, num_windows = (min(max_tokens, N) - 1) // seq_len.
    """
    _check_positive("seq_len", seq_len)
    _check_positive("max_tokens", max_tokens)
    if max_tokens < seq_len + 1:
        raise ValueError(f"max_tokens={max_tokens} is below one window of seq_len + 1 tokens")
    stream = _check_stream(stream, seq_len + 1)
    usable = min(int(max_tokens), stream.shape[0])
    num_windows = (usable - 1) // seq_len
    starts = np.arange(num_windows) * seq_len  # [num_windows]
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]  # [num_windows, seq_len + 1]
    return stream[index].astype(np.int32)


def calibration_batch(
    tokenizer: Tokenizer, num_sequences: int, seq_len: int, seed: int = 0
) -> np.ndarray:
    """Calibration sequences (GPTQ, AWQ, SmoothQuant) from the shipped calibration split.

    The calibration stream is cut into consecutive, non-overlapping chunks of `seq_len` tokens and
    `num_sequences` distinct chunks are drawn with `numpy.random.default_rng(seed)`.

    Args:
      tokenizer: the tokenizer.
      num_sequences: number of sequences.
      seq_len: tokens per sequence.
      seed: the draw's seed; equal seeds give equal batches.

    Returns:
      [num_sequences, seq_len] int32.
    """
    _check_positive("num_sequences", num_sequences)
    _check_positive("seq_len", seq_len)
    stream = tokenize_documents(tokenizer, load_split("calib"))  # [N]
    num_chunks = stream.shape[0] // seq_len
    if num_sequences > num_chunks:
        raise ValueError(
            f"num_sequences={num_sequences} exceeds the {num_chunks} chunks of seq_len={seq_len} "
            f"in the calibration split ({stream.shape[0]} tokens)"
        )
    chunks = stream[: num_chunks * seq_len].reshape(num_chunks, seq_len)  # [num_chunks, seq_len]
    pick = np.random.default_rng(seed).choice(num_chunks, size=num_sequences, replace=False)
    return chunks[pick].astype(np.int32)
