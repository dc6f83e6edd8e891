"""Incremental detokenization and stop strings, against whole-text decoding."""

from __future__ import annotations

import pytest

import jaxinfer as ji
from jaxinfer.server.detokenizer import IncrementalDetokenizer, StopMatcher

TEXTS = ["héllo wörld — ünïcode ✓ 日本語 🙂🙂 done", "def f(x):\n    return x  # ok", "a"]


@pytest.fixture(scope="module")
def tok():
    return ji.load_tokenizer(ji.models.path("target"))


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
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        m.push(p)
        out.append(m.release())
    out[-1] += m.release(final=True)
    assert out == shown and "".join(out) == text == m.text
