"""Text of a token stream: incremental detokenization and stop strings.

`IncrementalDetokenizer` is vLLM's scheme: it decodes a short window of ids (a few tokens of
context, then the new ones) and emits the text the new ids add, but only once that text does not
end in U+FFFD: a byte-level BPE token can hold part of a UTF-8 character, and its text is held
until the token that completes the character arrives. `StopMatcher` finds stop strings in the
text, truncates the text before the first match, and while streaming holds back a suffix that is
still a prefix of some stop string, so a stop string never reaches the client.

`TextOptions` are vLLM's per-request text fields: `include_stop_str_in_output` keeps the matched
stop string (cut after it, nothing held back, as vLLM) and the text of a stop token (eos or
`stop_token_ids`), which is otherwise left out of the text as vLLM leaves it out;
`skip_special_tokens=False` decodes special tokens into the text, and with it
`spaces_between_special_tokens=False` writes an added token that follows another one as its bare
content, as vLLM's fast detokenizer does (a decoder that joins tokens with spaces, WordPiece's,
otherwise puts a space between them; byte-level BPE never does, so there it changes nothing).

Any tokenizer with `encode(text)` (a `tokenizers.Encoding` with `.ids`, or a list of ids) and
`decode(ids, skip_special_tokens=...)` works: `tokenizers.Tokenizer` and transformers' alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

_CONTEXT = 5  # prompt tokens decoded before the new ones, so leading spaces come out right


def encode(tokenizer: Any, text: str) -> list[int]:
    enc = tokenizer.encode(text, add_special_tokens=False)
    return [int(t) for t in (enc.ids if hasattr(enc, "ids") else enc)]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A completion prompt as the tokenizer encodes it on its own (its post-processor on)."""
    enc = tokenizer.encode(text)
    return [int(t) for t in (enc.ids if hasattr(enc, "ids") else enc)]


@dataclasses.dataclass(frozen=True)
class TextOptions:
    """How one choice's token ids become its text: vLLM's SamplingParams fields of these names."""

    stops: tuple[str, ...] = ()  # stop strings
    stop_token_ids: frozenset[int] = frozenset()  # the request's stop tokens (eos unless ignored)
    min_tokens: int = 0  # the text of this many first tokens ends no stop string
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def added_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's added tokens (special or not), the ones vLLM joins without spaces."""
    get = getattr(tokenizer, "get_added_tokens_decoder", None)  # tokenizers.Tokenizer
    table = get() if get is not None else getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(int(t) for t in table)


def decode(
    tokenizer: Any,
    ids: Sequence[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    added: frozenset[int] | None = None,
) -> str:
    """The text of `ids`, as vLLM's options ask (see the module docstring).

    Args:
      tokenizer: any tokenizer with `decode(ids, skip_special_tokens=...)`.
      ids: token ids.
      skip_special_tokens: leave special tokens out of the text.
      spaces_between_special_tokens: False (with skip_special_tokens False): an added token right
        after another one is decoded on its own, so no separator comes between them.
      added: `added_token_ids(tokenizer)`, if the caller has it.
    """
    ids = list(ids)
    if skip_special_tokens or spaces_between_special_tokens:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    added = added_token_ids(tokenizer) if added is None else added
    cuts = [i for i in range(1, len(ids)) if ids[i] in added and ids[i - 1] in added]
    bounds = [0, *cuts, len(ids)]
    return "".join(
        tokenizer.decode(ids[a:b], skip_special_tokens=False) for a, b in zip(bounds, bounds[1:])
    )


class IncrementalDetokenizer:
    """Text of generated ids, a UTF-8-complete piece at a time."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        joined = skip_special_tokens or spaces_between_special_tokens
        self._added = None if joined else added_token_ids(tokenizer)
        self.ids = list(prompt_ids[-_CONTEXT:])  # context, then generated ids
        self.prefix_offset = 0  # start of the decoded window
        self.read_offset = len(self.ids)  # ids before this are in `text`
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        skip, spaces = self.skip_special_tokens, self.spaces_between_special_tokens
        return decode(self.tokenizer, ids, skip, spaces, self._added)

    def add(self, new_ids: list[int]) -> str:
        """Appends ids; returns the text they complete ('' while a character is split)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of the stream: whatever is still held (a split character as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        new = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new
        return new


class StopMatcher:
    """Stop-string state of one sample: `push` text, get what may be shown."""

    def __init__(self, stops: Sequence[str], include_in_output: bool = False):
        self.stops = list(stops)
        self.include = include_in_output  # keep the stop string: nothing to hold back (vLLM)
        self.text = ""  # everything pushed, up to the first stop string (kept if `include`)
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
        found = ((self.text.find(s, max(start, self.floor - len(s) + 1)), s) for s in self.stops)
        hits = [(i, i + len(s)) for i, s in found if i >= 0]
        if hits:
            # Cut before the stop string that starts first or, keeping it, after the one that
            # ends first: either way no text past a complete stop string.
            self.text = self.text[: min(end for _, end in hits) if self.include else min(hits)[0]]
            self.stopped = True

    def _holdback(self) -> int:
        """Length of the longest suffix of `text` that some stop string starts with."""
        if self.stopped or self.include:
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
