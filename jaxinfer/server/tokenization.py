"""vLLM's tokenizer endpoints and the request fields that need the served tokenizer.

    POST /tokenize    a prompt's (or a conversation's, rendered as /v1/chat/completions renders
                      it) token ids: {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  the text of token ids, special tokens included: {"prompt"}

`bad_words_ids` turns vLLM's `bad_words` strings into the token sequences `SamplingParams`
bans (`jaxinfer.penalties`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request

from jaxinfer.sampling import MAX_BAD_WORD_LEN, MAX_BAD_WORDS
from jaxinfer.server import protocol as P
from jaxinfer.server.detokenizer import decode, encode, encode_prompt


class TokenizeCompletionRequest(P.StrictModel):
    """vLLM's POST /tokenize body of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's post-processor (a BOS), as a completion
    return_token_strs: bool | None = False


class TokenizeChatRequest(P.ChatInput):
    """vLLM's POST /tokenize body of a conversation, rendered as /v1/chat/completions renders it."""

    model: str | None = None
    return_token_strs: bool | None = False
    # vLLM's, not built here: refused unless neutral (the chat route's own answer to each).
    chat_template: Any = None
    tools: Any = None


class DetokenizeRequest(P.StrictModel):
    """vLLM's POST /detokenize body."""

    model: str | None = None
    tokens: list[int]


def bad_words_ids(req: P.SamplingFields, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """`bad_words` as token sequences, as vLLM's `SamplingParams.update_from_tokenizer` makes
    them: each word without its leading whitespace, encoded without special tokens, and also
    " " + that word where it encodes to as many tokens with another first one (the word-start
    token of a byte-level BPE vocabulary, so the word is banned after a space too). Raises
    APIError(400) naming `bad_words`: a word that encodes to no tokens, one longer than
    MAX_BAD_WORD_LEN tokens, or more than MAX_BAD_WORDS sequences in all.

    Args:
      req: the parsed request.
      tokenizer: the served tokenizer.
    """
    words = req.bad_words or []
    if len(words) > MAX_BAD_WORDS:  # each word is at least one sequence: before encoding them
        raise P.bad_param(
            "bad_words", f"{len(words)} words; at most {MAX_BAD_WORDS} token sequences"
        )
    out: list[list[int]] = []
    for i, word in enumerate(words):
        ids = encode(tokenizer, word.lstrip())
        if not ids:
            raise P.bad_param(
                "bad_words",
                f"word {i} {P.shown(word)} encodes to no tokens once its leading whitespace is "
                "stripped",
            )
        if len(ids) > MAX_BAD_WORD_LEN:
            raise P.bad_param(
                "bad_words",
                f"word {i} {P.shown(word)} is {len(ids)} tokens; at most {MAX_BAD_WORD_LEN}",
            )
        out.append(ids)
        spaced = encode(tokenizer, " " + word.lstrip())
        if spaced and spaced[0] != ids[0] and len(spaced) == len(ids):
            out.append(spaced)
    if len(out) > MAX_BAD_WORDS:
        raise P.bad_param(
            "bad_words",
            f"{len(words)} words encode to {len(out)} token sequences (a word after a space is "
            f"its own sequence where it encodes differently); at most {MAX_BAD_WORDS}",
        )
    return tuple(tuple(ids) for ids in out)


def add_routes(app: FastAPI, srv: Any, tokenizer: Any) -> None:
    """Adds POST /tokenize and /detokenize for the server `srv` (app._Server) to `app`."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.body()
        try:  # vLLM's two bodies: a conversation has messages
            raw = json.loads(body)
        except ValueError:
            raw = None  # the prompt body's validation names the fault
        chat = isinstance(raw, dict) and "messages" in raw
        req = P.parse_body(body, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        if req.model is not None:
            srv.check_model(req.model)
        if chat:
            for field in ("chat_template", "tools"):
                if getattr(req, field):
                    raise P.APIError(400, f"{field}: not supported by this server", field)
            text = P.chat_prompt(req, tokenizer, srv.chat_template)
        else:
            text = req.prompt
        ids = encode_prompt(tokenizer, text) if req.add_special_tokens else encode(tokenizer, text)
        strs = [_token_str(tokenizer, t) for t in ids] if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": srv.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = P.parse_body(await request.body(), DetokenizeRequest)
        if req.model is not None:
            srv.check_model(req.model)
        vocab = srv.engine.engine.cfg.vocab_size  # the ids a prompt may hold
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise P.APIError(400, f"tokens: {bad} is not a token id in [0, {vocab})", "tokens")
        return {"prompt": decode(tokenizer, req.tokens, skip_special_tokens=False)}


def _token_str(tokenizer: Any, tid: int) -> str:
    """A token as the vocabulary writes it (vLLM's `convert_ids_to_tokens`)."""
    to_token = getattr(tokenizer, "id_to_token", None)  # tokenizers.Tokenizer
    if to_token is not None:
        return to_token(tid)
    return tokenizer.convert_ids_to_tokens(tid)
