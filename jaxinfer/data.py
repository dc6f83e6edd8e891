"""The shipped tokenizer, token streams and calibration batches.

The corpus and its splits live in `jaxinfer.corpus`; its names are re-exported here.

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
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxinfer.checks import as_int
from jaxinfer.corpus import (
    ASSETS_DIR,
    CALIB_MAX_BYTES,
    CALIB_MAX_FILE_BYTES,
    CALIB_SALT,
    CALIB_TARGET_BYTES,
    DATA_DIR,
    LOCAL_SPLITS,
    MAX_FILE_BYTES,
    NUM_BUCKETS,
    SHIPPED_FORMAT,
    SHIPPED_SPLITS,
    SPLIT_SALT,
    SPLITS,
    TRAIN_BUCKETS,
    VALIDATION_BUCKETS,
    calibration_paths,
    is_excluded,
    load_split,
    local_split_files,
    read_shipped_split,
    shipped_path,
    split_of,
    stdlib_files,
    stdlib_root,
    write_shipped_split,
)

# The corpus names are re-exported: `data.load_split` and the split constants predate
# `jaxinfer.corpus`.
__all__ = [
    "ASSETS_DIR",
    "BOS_ID",
    "BOS_TOKEN",
    "CALIB_MAX_BYTES",
    "CALIB_MAX_FILE_BYTES",
    "CALIB_SALT",
    "CALIB_TARGET_BYTES",
    "DATA_DIR",
    "DEFAULT_VOCAB_SIZE",
    "EOS_ID",
    "EOS_TOKEN",
    "LOCAL_SPLITS",
    "MAX_FILE_BYTES",
    "MIN_VOCAB_SIZE",
    "NUM_BUCKETS",
    "PAD_ID",
    "PAD_TOKEN",
    "SHIPPED_FORMAT",
    "SHIPPED_SPLITS",
    "SPECIAL_TOKENS",
    "SPLITS",
    "SPLIT_SALT",
    "TOKENIZER_PATH",
    "TRAIN_BUCKETS",
    "VALIDATION_BUCKETS",
    "calibration_batch",
    "calibration_paths",
    "eval_windows",
    "is_excluded",
    "load_split",
    "load_tokenizer",
    "local_split_files",
    "random_windows",
    "read_shipped_split",
    "shipped_path",
    "split_of",
    "stdlib_files",
    "stdlib_root",
    "token_stream",
    "tokenize_documents",
    "tokenizer_fingerprint",
    "train_tokenizer",
    "write_shipped_split",
]

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

TOKENIZER_PATH = ASSETS_DIR / "tokenizer" / "tokenizer.json"


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
            "build it with `python -m experiments.build_corpus`"
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
    if as_int(value) is None or value < 1:
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
