"""Incremental detokenization and stop strings, against whole-text decoding."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import jaxinfer as ji
from jaxinfer.server.detokenizer import IncrementalDetokenizer, StopMatcher, decode

TEXTS = ["héllo wörld — ünïcode ✓ 日本語 🙂🙂 done", "def f(x):\n    return x  # ok", "a"]
# Special tokens among text, back to back and at the ends.
SPECIAL_TEXTS = ["<|bos|>héllo<|eos|><|eos|> wörld 🙂<|pad|>", "x<|eos|><|bos|><|pad|>"]
OPTIONS = [(True, True), (False, True), (False, False)]  # skip_special / spaces_between


@pytest.fixture(scope="module")
def tok():
    return ji.load_tokenizer(ji.models.path("target"))


@pytest.fixture(scope="module")
def wordpiece():
    """A WordPiece tokenizer: its decoder joins tokens with spaces, specials included."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    t = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece()
    t.add_special_tokens(["[CLS]", "[SEP]"])
    return t


def _incremental(tok, prompt, ids, skip, spaces):
    d = IncrementalDetokenizer(tok, prompt, skip, spaces)
    return [d.add([t]) for t in ids] + [d.flush()]


@pytest.mark.parametrize("skip,spaces", OPTIONS)
@pytest.mark.parametrize("text", SPECIAL_TEXTS + TEXTS[:1])
def test_incremental_equals_whole_decode_with_the_same_options(tok, text, skip, spaces):
    """skip_special_tokens / spaces_between_special_tokens: token by token is the whole decode
    (the tokenizers library's, for a byte-level tokenizer that puts no spaces anywhere)."""
    prompt = tok.encode("say:<|eos|>").ids
    ids = tok.encode(text).ids
    pieces = _incremental(tok, prompt, ids, skip, spaces)
    assert "".join(pieces) == decode(tok, ids, skip, spaces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|eos|>" in "".join(pieces)) == (not skip and "<|eos|>" in text)
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("skip,spaces", OPTIONS)
def test_spaces_between_special_tokens_as_vllm(wordpiece, skip, spaces):
    """False: an added token right after another has no space before it (vLLM's fast
    detokenizer writes its bare content), token by token as in the whole decode."""
    ids = [3, 1, 2, 2, 4, 5, 1]  # hello [CLS] [SEP] [SEP] world ##s [CLS]
    want = {
        (True, True): "hello worlds",
        (False, True): "hello [CLS] [SEP] [SEP] worlds [CLS]",
        (False, False): "hello [CLS][SEP][SEP] worlds [CLS]",
    }[skip, spaces]
    assert decode(wordpiece, ids, skip, spaces) == want
    assert "".join(_incremental(wordpiece, [4], ids, skip, spaces)) == " " + want  # after world


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_whole_decode_and_never_splits(tok, text):
    prompt = tok.encode("say:").ids
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(tok, prompt)
    pieces = [d.add([t]) for t in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # a split character is held, never sent
    assert sum(len(tok.id_to_token(t)) for t in ids) > len(text) - 2  # multi-byte tokens exist


def test_a_split_character_at_the_end_is_flushed(tok):
    ids = tok.encode("🙂").ids
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok, [])
    assert d.add(ids[:1]) == ""
    assert d.flush() == tok.decode(ids[:1])


@pytest.mark.parametrize(
    "pieces,stops,shown,text",
    [
        (["hello wor", "ld!"], ["world"], ["hello ", ""], "hello "),
        (["ab", "c", "d"], ["cx"], ["ab", "", "cd"], "abcd"),  # held while it could match
        (["a<", "|e", "nd|>tail"], ["<|end|>"], ["a", "", ""], "a"),
        (["xyz"], [], ["xyz"], "xyz"),
        (["stop here"], ["stop"], [""], ""),
    ],
)
def test_stop_strings_held_back_and_excluded(pieces, stops, shown, text):
    _check_stops(StopMatcher(stops), pieces, shown, text)


@pytest.mark.parametrize(
    "pieces,stops,shown,text",
    [
        (["hello wor", "ld!"], ["world"], ["hello wor", "ld"], "hello world"),  # not held
        (["a<", "|e", "nd|>tail"], ["<|end|>"], ["a<", "|e", "nd|>"], "a<|end|>"),
        (["xabcd"], ["abcd", "bc"], ["xabc"], "xabc"),  # the one that ends first
        (["x", "abcdef"], ["abcd", "zz"], ["x", "abcd"], "xabcd"),
        (["stop here"], ["stop"], ["stop"], "stop"),
    ],
)
def test_stop_strings_kept_with_include_in_output(pieces, stops, shown, text):
    _check_stops(StopMatcher(stops, include_in_output=True), pieces, shown, text)


def _check_stops(m, pieces, shown, text):
    out = []
    for p in pieces:
        m.push(p)
        out.append(m.release())
    out[-1] += m.release(final=True)
    assert out == shown and "".join(out) == text == m.text
