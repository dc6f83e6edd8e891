r"""Builds the shipped corpus splits and trains the shipped tokenizer.

Reads the running interpreter's standard library (`jaxinfer.data.stdlib_files`), writes the test
and calibration splits to `<assets_dir>/data/{test,calib}.json.xz` with the PSF licence and a
README, trains the byte-level BPE tokenizer on the train split, saves it to
`<assets_dir>/tokenizer/tokenizer.json`, and prints documents, bytes and tokens of every split.
The same interpreter and flags give byte-identical files.

    python -m experiments.build_corpus                      # rebuild the package assets
    python -m experiments.build_corpus --assets_dir=/tmp/a --workdir=/tmp/w
"""

from __future__ import annotations

import platform
import shutil
import time
from pathlib import Path

from absl import app, flags

from experiments import common
from jaxinfer import data

_VOCAB_SIZE = flags.DEFINE_integer(
    "vocab_size", data.DEFAULT_VOCAB_SIZE, "Tokenizer vocabulary, specials included.", lower_bound=1
)
_MIN_FREQUENCY = flags.DEFINE_integer(
    "min_frequency", 2, "Minimum count of a merged pair.", lower_bound=1
)
_TOKENIZER_TRAIN_BYTES = flags.DEFINE_integer(
    "tokenizer_train_bytes",
    0,
    "Train the tokenizer on the first train files (by path) up to this many bytes; 0 = all.",
    lower_bound=0,
)
_ASSETS_DIR = flags.DEFINE_string(
    "assets_dir", str(data.ASSETS_DIR), "Where data/ and tokenizer/ are written."
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Optional: also write config.json and results.json here."
)
_CONFIG = common.config_flag()

_README = """\
# Shipped corpus splits

Python source code from the CPython {version} standard library, as selected and split by
`jaxinfer/data.py` (test suites, site-packages, non-UTF-8 files and files over {max_kb} kB left
out; split by the sha1 of each file's path relative to the stdlib root).

| file | split | documents | bytes of text | tokens (shipped tokenizer, with bos/eos) |
|---|---|---|---|---|
{rows}

Each file is xz-compressed JSON: `{{"format", "split", "python_version", "documents": [{{"path",
"text"}}]}}`, documents sorted by path. `test` is the held-out split on which quality figures are
measured; `calib` is a deterministic ~{calib_kb} kB subset of the train split used to calibrate
quantization. Shipping them makes those figures reproducible on any Python version; train and
validation are read from the local standard library.

The texts are Copyright (c) Python Software Foundation and distributed under the PSF License
Agreement, reproduced in `LICENSE-PSF.txt` (the interpreter's own `LICENSE.txt`).

Rebuilt by `python -m experiments.build_corpus` (vocabulary {vocab_size}).
"""


def _nbytes(docs: list[str]) -> int:
    return sum(len(d.encode("utf-8")) for d in docs)


def _tokenizer_docs(train_files: list[tuple[str, str]], max_bytes: int) -> list[str]:
    if max_bytes <= 0:
        return [t for _, t in train_files]
    docs, total = [], 0
    for _, text in train_files:
        if total >= max_bytes:
            break
        docs.append(text)
        total += len(text.encode("utf-8"))
    return docs


def main(argv: list[str]) -> None:
    del argv
    common.apply_config(_CONFIG.value)
    if _WORKDIR.value:
        common.save_config(_WORKDIR.value)
    start = time.perf_counter()
    assets = Path(_ASSETS_DIR.value)
    data_dir = assets / "data"
    files = data.stdlib_files()
    print(f"Python {platform.python_version()} stdlib at {data.stdlib_root()}: {len(files)} files")

    # Shipped splits, read back so the token counts below are of what ships.
    for name in data.SHIPPED_SPLITS:
        path = data.write_shipped_split(name, data.local_split_files(name, files), data_dir)
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    shutil.copyfile(data.stdlib_root() / "LICENSE.txt", data_dir / "LICENSE-PSF.txt")

    # Tokenizer.
    train_files = data.local_split_files("train", files)
    tok_docs = _tokenizer_docs(train_files, _TOKENIZER_TRAIN_BYTES.value)
    t0 = time.perf_counter()
    tokenizer = data.train_tokenizer(
        tok_docs, _VOCAB_SIZE.value, min_frequency=_MIN_FREQUENCY.value
    )
    train_s = time.perf_counter() - t0
    tok_path = assets / "tokenizer" / "tokenizer.json"
    tok_path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tok_path), pretty=True)
    print(
        f"trained tokenizer (vocab {tokenizer.get_vocab_size()}) on {len(tok_docs)} docs, "
        f"{_nbytes(tok_docs):,} bytes in {train_s:.1f}s -> {tok_path}"
    )

    # Sizes, token counts and a round-trip check of every split.
    split_docs = {
        "train": [t for _, t in train_files],
        "validation": [t for _, t in data.local_split_files("validation", files)],
        "test": [d["text"] for d in data.read_shipped_split("test", data_dir)["documents"]],
        "calib": [d["text"] for d in data.read_shipped_split("calib", data_dir)["documents"]],
    }
    results = {"python_version": platform.python_version(), "splits": {}}
    print(f"{'split':<11}{'docs':>6}{'bytes':>12}{'tokens':>11}{'bytes/token':>13}")
    for name, docs in split_docs.items():
        stream = data.tokenize_documents(tokenizer, docs)
        encodings = tokenizer.encode_batch(docs, add_special_tokens=False)
        decoded = tokenizer.decode_batch([e.ids for e in encodings], skip_special_tokens=False)
        mismatched = sum(a != b for a, b in zip(decoded, docs))
        if mismatched:
            raise RuntimeError(f"{mismatched} {name} documents do not round-trip the tokenizer")
        stats = {"documents": len(docs), "bytes": _nbytes(docs), "tokens": int(stream.shape[0])}
        stats["bytes_per_token"] = round(stats["bytes"] / stats["tokens"], 3)
        results["splits"][name] = stats
        print(
            f"{name:<11}{stats['documents']:>6}{stats['bytes']:>12,}{stats['tokens']:>11,}"
            f"{stats['bytes_per_token']:>13.3f}"
        )
    shipped = {
        name: data.shipped_path(name, data_dir).stat().st_size for name in data.SHIPPED_SPLITS
    }
    results["shipped_bytes"] = shipped
    print(f"shipped split files: {sum(shipped.values()):,} bytes compressed")

    rows = "\n".join(
        f"| `{name}.json.xz` | {name} | {s['documents']} | {s['bytes']:,} | {s['tokens']:,} |"
        for name, s in results["splits"].items()
        if name in data.SHIPPED_SPLITS
    )
    readme = _README.format(
        version=platform.python_version(),
        max_kb=data.MAX_FILE_BYTES // 1000,
        calib_kb=data.CALIB_TARGET_BYTES // 1000,
        rows=rows,
        vocab_size=_VOCAB_SIZE.value,
    )
    (data_dir / "README.md").write_text(readme, encoding="utf-8")

    if _WORKDIR.value:
        common.write_results(_WORKDIR.value, results)
    print(f"done in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    app.run(main)
