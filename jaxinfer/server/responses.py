"""Response pieces: the per-choice stream state and the OpenAI shapes of usage and logprobs
(vLLM's `prompt_logprobs` too).

`Choice` holds one choice's tokens, text (through the incremental detokenizer and its stop
strings) and logprob entries `(token id, logprob, ((id, logprob), ...) top)` as outputs arrive.
The formatters take `token_text(id)` / `token_bytes(id)` from the app's state.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from jaxinfer.server.detokenizer import IncrementalDetokenizer, StopMatcher, TextOptions


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: a byte-level BPE token's characters -> bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTES = _byte_decoder()


class Choice:
    """The text, tokens and logprobs of one choice as they stream in."""

    def __init__(self, index: int, tokenizer, prompt: list[int], options: TextOptions):
        self.index = index
        self.options = options
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt, options.skip_special_tokens, options.spaces_between_special_tokens
        )
        self.stop = StopMatcher(options.stops, options.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, float, tuple]] = []  # (id, logprob, top)
        self.finished = False
        self.finish_reason: str | None = None
        self.error: str | None = None

    def feed(self, out) -> tuple[str, list]:
        """A StreamOutput of this choice -> (text to send, its new logprob entries)."""
        if self.finished:
            return "", []
        opts = self.options
        ids = list(out.new_token_ids)
        text_ids = ids  # the stop token that ended the sample is counted, not shown (vLLM)
        stop_token = out.finish_reason == "stop" and ids and ids[-1] in opts.stop_token_ids
        if stop_token and not opts.include_stop_str_in_output:
            text_ids = ids[:-1]
        k = min(len(text_ids), max(0, opts.min_tokens - len(self.token_ids)))  # protected ids
        self.token_ids += ids
        entries = [(t, lp, top) for t, (lp, top) in zip(ids, out.logprobs or ())]
        self.logprobs += entries
        if k:
            self.stop.push(self.detok.add(text_ids[:k]), protected=True)
        piece = self.detok.add(text_ids[k:]) if k < len(text_ids) else ""
        if out.finished:
            piece += self.detok.flush()
        self.stop.push(piece)
        error = getattr(out, "error", None)
        if error or out.finish_reason == "error":
            self.finished, self.finish_reason = True, "error"
            self.error = error or "engine step failed"
        elif self.stop.stopped:
            self.finished, self.finish_reason = True, "stop"
        elif out.finished:
            self.finished, self.finish_reason = True, out.finish_reason
        return self.stop.release(final=self.finished), entries

    def fail(self, message: str) -> None:
        if not self.finished:
            self.finished, self.finish_reason, self.error = True, "error", message


def usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(ch.token_ids) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_logprobs(srv: Any, entries: list, offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for tid, lp, top in entries:
        s = srv.token_text(tid)
        tokens.append(s)
        lps.append(lp)
        if top is None:
            tops.append(None)
        else:
            d = {srv.token_text(j): v for j, v in top}
            d.setdefault(s, lp)  # the sampled token is always there (vLLM)
            tops.append(d)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(srv: Any, scored: list, k: int) -> list:
    """vLLM's `prompt_logprobs` of one prompt from `(id, logprob, rank, top)` of its tokens 1..:
    None for token 0, then per token `{id: {"logprob", "rank", "decoded_token"}}` holding the
    token itself first, then its k most likely (ranks 1..k; a dict, so a token among them is
    there once). Logprobs below -9999 are -9999, as vLLM clamps them."""

    def item(tid, lp, rank):
        return {"logprob": max(lp, -9999.0), "rank": rank, "decoded_token": srv.token_text(tid)}

    out: list = [None]
    for tid, lp, rank, top in scored:
        d = {str(tid): item(tid, lp, rank)}
        d.update((str(j), item(j, v, r)) for r, (j, v) in enumerate(top[:k], 1))
        out.append(d)
    return out


def chat_logprobs(srv: Any, entries: list) -> dict:
    def item(tid, lp):
        return {"token": srv.token_text(tid), "logprob": lp, "bytes": srv.token_bytes(tid)}

    content = [
        {**item(tid, lp), "top_logprobs": [item(j, v) for j, v in top]} for tid, lp, top in entries
    ]
    return {"content": content, "refusal": None}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def prompt_entries(logits: np.ndarray, prompt: list[int], k: int) -> list[tuple]:
    """Prompt tokens 1.. as `(id, logprob, rank, top)` from the logits that predict them
    (`[P-1, V]`), top the k most likely `((id, logprob), ...)`; the rank is vLLM's, the number
    of tokens at least as likely (1: the argmax)."""
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))  # [P-1, V]
    n = logp.shape[0]
    ids = np.asarray(prompt[1:])  # [P-1]
    lp = logp[np.arange(n), ids]  # [P-1]
    rank = (logp >= lp[:, None]).sum(-1)  # [P-1]
    kk = min(k, logp.shape[-1])
    top = np.argpartition(-logp, kk - 1, -1)[:, :kk] if kk else np.zeros((n, 0), int)
    vals = np.take_along_axis(logp, top, -1)  # [P-1, k], unordered
    order = np.argsort(-vals, axis=-1, kind="stable")
    top, vals = np.take_along_axis(top, order, -1), np.take_along_axis(vals, order, -1)
    return [
        (int(t), float(lp[i]), int(rank[i]), tuple(zip(top[i].tolist(), vals[i].tolist())))
        for i, t in enumerate(ids)
    ]
