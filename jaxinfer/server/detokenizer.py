"""Text of a token stream: incremental detokenization and stop strings.

`IncrementalDetokenizer` is vLLM's scheme: it decodes a short window of ids (a few tokens of
context, then the new ones) and emits the text the new ids add, but only once that text does not
end in U+FFFD: a byte-level BPE token can hold part of a UTF-8 character, and its text is held
until the token that completes the character arrives. `StopMatcher` finds stop strings in the
text, truncates the text before the first match, and while streaming holds back a suffix that is
still a prefix of some stop string, so a stop string never reaches the client.

Any tokenizer with `encode(text)` (a `tokenizers.Encoding` with `.ids`, or a list of ids) and
`decode(ids, skip_special_tokens=...)` works: `tokenizers.Tokenizer` and transformers' alike.
"""

from __future__ import annotations

from typing import Any

_CONTEXT = 5  # prompt tokens decoded before the new ones, so leading spaces come out right


def encode(tokenizer: Any, text: str) -> list[int]:
    enc = tokenizer.encode(text, add_special_tokens=False)
    return [int(t) for t in (enc.ids if hasattr(enc, "ids") else enc)]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A completion prompt as the tokenizer encodes it on its own (its post-processor on)."""
    enc = tokenizer.encode(text)
    return [int(t) for t in (enc.ids if hasattr(enc, "ids") else enc)]


def decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text of generated ids, a UTF-8-complete piece at a time."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT:])  # context, then generated ids
        self.prefix_offset = 0  # start of the decoded window
        self.read_offset = len(self.ids)  # ids before this are in `text`
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        """Appends ids; returns the text they complete ('' while a character is split)."""
        self.ids.extend(new_ids)
        prefix = decode(self.tokenizer, self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.tokenizer, self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of the stream: whatever is still held (a split character as U+FFFD)."""
        prefix = decode(self.tokenizer, self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.tokenizer, self.ids[self.prefix_offset :])
        new = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new
        return new


class StopMatcher:
    """Stop-string state of one sample: `push` text, get what may be shown."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""  # everything pushed, up to the first stop string (excluded)
        self.shown = 0  # characters of `text` released to the client
        self.floor = 0  # a stop string must end past this many characters (min_tokens)
        self.stopped = False

    def push(self, piece: str, protected: bool = False) -> None:
        """Appends text; `protected` text (of the first min_tokens tokens, as vLLM) cannot end
        a stop string."""
        if self.stopped or not piece:
            return
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0) + 1)
        self.text += piece
        if protected:
            self.floor = len(self.text)
            return
        found = (self.text.find(s, max(start, self.floor - len(s) + 1)) for s in self.stops)
        hits = [i for i in found if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _holdback(self) -> int:
        """Length of the longest suffix of `text` that some stop string starts with."""
        if self.stopped:
            return 0
        for k in range(
            min(len(self.text), max((len(s) for s in self.stops), default=1) - 1), 0, -1
        ):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def release(self, final: bool = False) -> str:
        """The text that can no longer become part of a stop string (all of it if final)."""
        end = len(self.text) if final else len(self.text) - self._holdback()
        out = self.text[self.shown : end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return out
