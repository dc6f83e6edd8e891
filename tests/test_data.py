"""Tests for jaxinfer.data: corpus selection, splits, shipped files, tokenizer, windows."""

from __future__ import annotations

import hashlib
import lzma
import platform
import re

import numpy as np
import pytest

from jaxinfer import data

# A mix of Python source features the byte-level tokenizer must reproduce exactly.
TRICKY_SOURCE = (
    "def f(x):\r\n\treturn x  # tab, CRLF\n"
    "s = 'naïve café — ünïcödé ✓ 🐍 \\u2603'\n"
    "    \n\n\n        trailing   \n"
    "x = 0x1F_FF + 1e-10j  # numbers\n"
    '"""docstring with "quotes" and \'apostrophes\'"""\n'
)

_TEST_DIR = re.compile(r"^(test.*|tests|idle_test|site-packages|dist-packages|__pycache__)$")


@pytest.fixture(scope="module")
def files():
    return data.stdlib_files()


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer()


@pytest.fixture(scope="module")
def shipped():
    return {name: data.read_shipped_split(name) for name in data.SHIPPED_SPLITS}


# ---------------------------------------------------------------------------------------------
# Corpus selection and splits
# ---------------------------------------------------------------------------------------------


def test_stdlib_files_selection_on_a_synthetic_stdlib(tmp_path):
    def write(rel, content):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)

    keep = {"os.py": b"import sys\r\n", "pkg/mod.py": "x = 'é'\n".encode(), "pkg/sub/a.py": b"a=1"}
    for rel, content in keep.items():
        write(rel, content)
    for rel in [
        "test/test_os.py",
        "tests/x.py",
        "unittest/test/testmock/m.py",
        "tkinter/test/test_ttk/t.py",
        "idlelib/idle_test/h.py",
        "lib2to3/tests/data/d.py",
        "site-packages/numpy/core.py",
        "__pycache__/os.py",
        "pkg/test_mod.py",
        "_sysconfigdata__linux.py",
        "README.txt",
    ]:
        write(rel, b"x = 1\n")
    write("big.py", b"#" * (data.MAX_FILE_BYTES + 1))
    write("latin1.py", "# caf\xe9\n".encode("latin-1"))
    write("empty.py", b" \n\n")

    got = data.stdlib_files(tmp_path)
    expected = sorted((rel, content.decode("utf-8")) for rel, content in keep.items())
    assert got == expected  # exact bytes, CRLF kept


def test_no_test_suite_files_in_the_corpus(files):
    assert len(files) > 300  # the stdlib has several hundred eligible modules
    paths = [p for p, _ in files]
    assert paths == sorted(paths) and len(set(paths)) == len(paths)
    for path, text in files:
        *folders, name = path.split("/")
        assert not any(_TEST_DIR.match(folder) for folder in folders), path
        assert name.endswith(".py") and not name.startswith("test_"), path
        assert len(text.encode("utf-8")) <= data.MAX_FILE_BYTES, path
    for path in ["json/decoder.py", "collections/__init__.py", "textwrap.py"]:
        assert path in set(paths)


def test_split_of_matches_a_sha1_reference_and_is_stable():
    paths = [f"pkg{i}/mod_{i % 7}.py" for i in range(500)] + ["json/decoder.py", "os.py"]
    for path in paths:
        digest = hashlib.sha1(("jaxinfer-split-v1:" + path).encode()).digest()
        bucket = int.from_bytes(digest[:8], "big") % 100
        expected = "train" if bucket < 90 else "validation" if bucket < 95 else "test"
        assert data.split_of(path) == expected == data.split_of(path)
    with pytest.raises(ValueError, match="relative"):
        data.split_of("/abs/os.py")
    with pytest.raises(ValueError, match="rel_path"):
        data.split_of("")


def _proportions_ok(split_fn, n: int = 20_000) -> bool:
    """Each split's share is within 5 binomial sigmas of 90/5/5 (false alarm < 1e-5 per split)."""
    names = [split_fn(f"lib/module_{i}.py") for i in range(n)]
    for name, p in [("train", 0.90), ("validation", 0.05), ("test", 0.05)]:
        share = names.count(name) / n
        if abs(share - p) > 5 * np.sqrt(p * (1 - p) / n):
            return False
    return True


def _biased_split(path: str) -> str:
    bucket = int(hashlib.sha1(path.encode()).hexdigest(), 16) % 100
    return "train" if bucket < 85 else "validation" if bucket < 90 else "test"  # 85/5/10


def test_split_proportions_with_negative_control():
    assert _proportions_ok(data.split_of)
    assert not _proportions_ok(_biased_split)  # negative control: 10% test must be rejected


def test_splits_partition_the_corpus_and_calib_is_a_subset_of_train(files):
    split_paths = {
        name: [p for p, _ in data.local_split_files(name, files)] for name in data.SPLITS
    }
    main = ["train", "validation", "test"]
    all_paths = [p for name in main for p in split_paths[name]]
    assert sorted(all_paths) == [p for p, _ in files]  # disjoint and covering
    assert all(len(split_paths[name]) > 0 for name in data.SPLITS)
    assert set(split_paths["calib"]) <= set(split_paths["train"])
    calib_bytes = sum(len(t.encode()) for t in (dict(files)[p] for p in split_paths["calib"]))
    assert data.CALIB_TARGET_BYTES <= calib_bytes <= data.CALIB_MAX_BYTES
    assert data.calibration_paths(files) == data.calibration_paths(list(reversed(files)))
    local_validation = data.load_split("validation")
    assert local_validation == [dict(files)[p] for p in split_paths["validation"]]
    with pytest.raises(ValueError, match="split must be one of"):
        data.load_split("dev")


# ---------------------------------------------------------------------------------------------
# Shipped files
# ---------------------------------------------------------------------------------------------


def test_shipped_files_exist_fit_and_decompress(shipped):
    sizes = [data.shipped_path(name).stat().st_size for name in data.SHIPPED_SPLITS]
    assert sum(sizes) <= 2_000_000
    for name in data.SHIPPED_SPLITS:
        raw = lzma.decompress(data.shipped_path(name).read_bytes())
        assert raw.decode("utf-8").startswith("{")
        docs = shipped[name]["documents"]
        assert len(docs) > 10 and [d["path"] for d in docs] == sorted(d["path"] for d in docs)
        assert data.load_split(name) == [d["text"] for d in docs]
    licence = (data.DATA_DIR / "LICENSE-PSF.txt").read_text(encoding="utf-8")
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in licence
    assert shipped["test"]["python_version"] in (data.DATA_DIR / "README.md").read_text()


def test_shipped_documents_are_the_files_the_split_assigns(shipped, files):
    test_paths = [d["path"] for d in shipped["test"]["documents"]]
    calib_paths = [d["path"] for d in shipped["calib"]["documents"]]
    # Holds on any Python version: the split is a function of the path alone.
    assert all(data.split_of(p) == "test" for p in test_paths)
    assert all(data.split_of(p) == "train" for p in calib_paths)
    assert all(not data.is_excluded(p) for p in test_paths + calib_paths)
    if shipped["test"]["python_version"] == platform.python_version():
        # Built from this very stdlib: the shipped splits are exactly the local ones.
        for name in data.SHIPPED_SPLITS:
            shipped_docs = [(d["path"], d["text"]) for d in shipped[name]["documents"]]
            assert shipped_docs == data.local_split_files(name, files)
    else:
        # Another version: every local file the shipped test split names is still a test file.
        local = {p for p, _ in files}
        assert all(data.split_of(p) == "test" for p in set(test_paths) & local)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def test_shipped_tokenizer_specials_and_round_trip(tok, shipped):
    assert tok.get_vocab_size() == data.DEFAULT_VOCAB_SIZE
    for token, token_id in [("<|bos|>", 0), ("<|eos|>", 1), ("<|pad|>", 2)]:
        assert tok.token_to_id(token) == token_id
    assert (data.BOS_ID, data.EOS_ID, data.PAD_ID) == (0, 1, 2)
    docs = [d["text"] for d in shipped["test"]["documents"]] + [TRICKY_SOURCE]
    encodings = tok.encode_batch(docs, add_special_tokens=False)
    assert tok.decode_batch([e.ids for e in encodings], skip_special_tokens=False) == docs
    ids = np.concatenate([e.ids for e in encodings])
    assert not np.isin(ids, [data.BOS_ID, data.EOS_ID, data.PAD_ID]).any()
    assert len(ids) < 0.5 * sum(len(d.encode()) for d in docs)  # BPE compresses source > 2x


def test_transformers_fast_tokenizer_encodes_identically(tok, shipped):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(data.TOKENIZER_PATH))
    docs = [d["text"] for d in shipped["test"]["documents"][:4]] + [TRICKY_SOURCE]
    for doc in docs:
        ids = tok.encode(doc, add_special_tokens=False).ids
        assert hf.encode(doc, add_special_tokens=False) == ids
        assert hf(doc)["input_ids"] == ids  # no post-processor: nothing is added by default
        assert hf.decode(ids) == doc
    assert hf.convert_tokens_to_ids(["<|bos|>", "<|eos|>", "<|pad|>"]) == [0, 1, 2]


def test_train_tokenizer_on_a_tiny_corpus():
    docs = [TRICKY_SOURCE, "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n"] * 3
    a = data.train_tokenizer(docs, 300)
    b = data.train_tokenizer(docs, 300)
    assert a.to_str() == b.to_str()  # deterministic
    assert data.MIN_VOCAB_SIZE < a.get_vocab_size() <= 300
    assert [a.token_to_id(t) for t in data.SPECIAL_TOKENS] == [0, 1, 2]
    unseen = "λ = {'k': [1, 2]}\n\tyield from g()  # 😀\n"
    assert a.decode(a.encode(unseen).ids) == unseen
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_tokenizer(docs, 100)
    with pytest.raises(ValueError, match="single str"):
        data.train_tokenizer("not a list", 300)


# ---------------------------------------------------------------------------------------------
# Streams, windows, calibration
# ---------------------------------------------------------------------------------------------


def test_tokenize_documents_wraps_each_document(tok):
    docs = ["x = 1\n", "", "def f():\n    pass\n"]
    pieces = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    stream = data.tokenize_documents(tok, docs)
    assert stream.dtype == np.int32
    np.testing.assert_array_equal(stream, np.concatenate([[0, *p, 1] for p in pieces]))
    np.testing.assert_array_equal(
        data.tokenize_documents(tok, docs, add_bos=False), np.concatenate([[*p, 1] for p in pieces])
    )
    np.testing.assert_array_equal(
        data.tokenize_documents(tok, docs, add_eos=False), np.concatenate([[0, *p] for p in pieces])
    )
    assert data.tokenize_documents(tok, []).shape == (0,)
    with pytest.raises(ValueError, match="single str"):
        data.tokenize_documents(tok, "x = 1")


def test_token_stream_caches(tok, tmp_path, monkeypatch):
    expected = data.tokenize_documents(tok, data.load_split("calib"))
    first = data.token_stream("calib", tok, cache_dir=tmp_path)
    np.testing.assert_array_equal(first, expected)
    assert len(list(tmp_path.glob("calib-*.npy"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("tokenized again instead of reading the cache")

    monkeypatch.setattr(data, "tokenize_documents", fail)
    np.testing.assert_array_equal(data.token_stream("calib", tok, cache_dir=tmp_path), expected)


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_random_windows_are_contiguous_and_shifted(seq_len):
    n = 200
    stream = np.arange(n, dtype=np.int32)  # token value == position, so windows reveal starts
    w = data.random_windows(stream, 16, seq_len, np.random.default_rng(0))
    assert w.shape == (16, seq_len + 1) and w.dtype == np.int32
    inputs, targets = w[:, :-1], w[:, 1:]
    np.testing.assert_array_equal(targets, inputs + 1)  # targets are inputs shifted by one
    assert w.min() >= 0 and w.max() <= n - 1
    again = data.random_windows(stream, 16, seq_len, np.random.default_rng(0))
    np.testing.assert_array_equal(w, again)
    with pytest.raises(ValueError, match="at least"):
        data.random_windows(stream[:seq_len], 2, seq_len, np.random.default_rng(0))
    with pytest.raises(ValueError, match="Generator"):
        data.random_windows(stream, 2, seq_len, 0)


def test_random_windows_reach_both_ends():
    stream = np.arange(10, dtype=np.int32)
    w = data.random_windows(stream, 500, 4, np.random.default_rng(1))
    assert set(w[:, 0].tolist()) == set(range(6))  # every start 0..N-seq_len-1 occurs


@pytest.mark.parametrize("n, seq_len, max_tokens", [(100, 8, 50), (100, 8, 1000), (33, 4, 33)])
def test_eval_windows_cover_the_budget_once(n, seq_len, max_tokens):
    stream = np.arange(n, dtype=np.int32)
    w = data.eval_windows(stream, seq_len, max_tokens)
    num = (min(n, max_tokens) - 1) // seq_len
    assert w.shape == (num, seq_len + 1) and w.dtype == np.int32
    np.testing.assert_array_equal(w[:, 1:], w[:, :-1] + 1)
    np.testing.assert_array_equal(w[:, 0], np.arange(num) * seq_len)
    # Every token after the first and within the budget is a target exactly once.
    np.testing.assert_array_equal(w[:, 1:].ravel(), np.arange(1, num * seq_len + 1))
    assert w.max() < min(n, max_tokens)
    with pytest.raises(ValueError, match="max_tokens"):
        data.eval_windows(stream, seq_len, seq_len)


def test_calibration_batch_is_deterministic_distinct_chunks(tok):
    stream = data.tokenize_documents(tok, data.load_split("calib"))
    a = data.calibration_batch(tok, 16, 128, seed=0)
    b = data.calibration_batch(tok, 16, 128, seed=0)
    c = data.calibration_batch(tok, 16, 128, seed=1)
    assert a.shape == (16, 128) and a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    chunks = stream[: len(stream) // 128 * 128].reshape(-1, 128)
    rows = {row.tobytes() for row in chunks}
    assert all(row.tobytes() in rows for row in a)  # each row is a chunk of the calib stream
    # Drawing every chunk returns each exactly once (no chunk is drawn twice).
    every = data.calibration_batch(tok, len(chunks), 128, seed=3)
    assert sorted(row.tobytes() for row in every) == sorted(row.tobytes() for row in chunks)
    with pytest.raises(ValueError, match="exceeds"):
        data.calibration_batch(tok, len(chunks) + 1, 128)
