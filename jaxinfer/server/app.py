"""The FastAPI app: OpenAI routes that validate, enqueue on the engine thread and stream.

    GET  /health               200 while the engine thread runs, with the engine's T buckets
    GET  /v1/models            the one served model
    GET  /metrics              Prometheus text (metrics.py)
    POST /reset_prefix_cache   forgets every unused cached block (vLLM's route), for benchmarks
                               that replay the same prompts: {"freed_blocks": n}
    POST /v1/completions       prompt: a string, a list of strings, token ids or lists of them
    POST /v1/chat/completions  messages rendered with the model's chat template
    POST /tokenize             vLLM's: a prompt's (or a conversation's) token ids
    POST /detokenize           vLLM's: the text of token ids, special tokens included

A request with k prompts and n samples is k engine requests (each forking its n samples off the
prompt's blocks); choice `i * n + j` is sample j of prompt i. Every engine request delivers its
outputs into the one asyncio queue of the HTTP request. Text is detokenized incrementally per
choice and passed through its stop strings (responses.Choice over detokenizer.py). A choice
that meets a stop string is finished here; once every choice of an engine request is finished,
the request is aborted so its blocks go back at once. When the client goes away (a cancelled
stream or a disconnect seen while waiting), every engine request of the HTTP request is aborted.
Prompt logprobs (an echo's, and vLLM's `prompt_logprobs`) come from one dense scoring pass per
prompt on the engine thread (`jaxinfer.scoring.score`), not from the engine's steps, so they
need no engine support (speculative decoding included).

Status codes: 400 invalid request (the `param` names the field), 404 unknown model or route,
413 a request that needs more KV blocks than the pool holds, 503 + Retry-After when the waiting
queue is full or the server is shutting down, 500 only when the engine step of the request
failed; a streaming response that already started reports that as an error event, then
`data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.cache.metadata import bucket
from jaxinfer.requests import SamplingError, check_sampling, stop_ids
from jaxinfer.scoring import score
from jaxinfer.server import protocol as P
from jaxinfer.server import responses as R
from jaxinfer.server import tokenization
from jaxinfer.server.async_engine import AsyncEngine, EngineFailure
from jaxinfer.server.detokenizer import decode, encode, encode_prompt

RETRY_AFTER_S = 1  # what a 503 tells the client to wait
log = logging.getLogger("jaxinfer.server")


class _Server:
    """Per-app state: the engine thread, the tokenizer, the served model's limits."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, chat_template, max_len):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.chat_template = chat_template
        eng = engine.engine
        positions = int(eng.cfg.max_position_embeddings)
        self.max_model_len = min(int(max_len or positions), positions)
        self.block_size = eng.config.block_size
        self.pool_blocks = eng.config.num_blocks - 1
        self.max_n = eng.config.max_num_seqs
        self.speculative = eng.config.speculative is not None
        self.created = int(time.time())
        self.shutting_down = False
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ helpers

    def token_text(self, tid: int) -> str:
        s = self._token_text.get(tid)
        if s is None:
            s = self._token_text[tid] = decode(self.tokenizer, [tid], skip_special_tokens=False)
        return s

    def token_bytes(self, tid: int) -> list[int]:
        raw = getattr(self.tokenizer, "id_to_token", lambda _: None)(tid)
        if raw and all(c in R.BYTES for c in raw):
            return [R.BYTES[c] for c in raw]
        return list(self.token_text(tid).encode("utf-8"))

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise P.APIError(
                404,
                f"model {P.shown(name)} does not exist; this server serves {self.model_name!r}",
                "model", "model_not_found",
            )  # fmt: skip

    def check_lengths(self, prompt: list[int], max_tokens: int, n: int, field: str) -> None:
        if not prompt:
            raise P.APIError(400, f"{field}: the prompt is empty", field)
        vocab = self.engine.engine.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise P.APIError(400, f"{field}: token ids must be in [0, {vocab})", field)
        total = len(prompt) + max_tokens
        if len(prompt) >= self.max_model_len or total > self.max_model_len:
            raise P.APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request has {len(prompt)} prompt tokens + max_tokens {max_tokens} = {total}",
                field if len(prompt) >= self.max_model_len else "max_tokens",
                "context_length_exceeded",
            )
        # The prompt's full blocks are shared by the n samples; each sample holds the rest of its
        # blocks, the partial prompt block included (a fork copies it on write): n = 1 needs
        # exactly the ceil(total / S) blocks the scheduler admits.
        S = self.block_size
        blocks = len(prompt) // S + n * (math.ceil(total / S) - len(prompt) // S)
        if blocks > self.pool_blocks:
            raise P.APIError(
                413,
                f"the request needs {blocks} KV blocks of {S} tokens ({len(prompt)} prompt tokens, "
                f"max_tokens {max_tokens}, n {n}); the pool holds {self.pool_blocks}",
                field,
                "kv_pool_exceeded",
            )

    def default_max_tokens(self, prompt: list[int]) -> int:
        room = min(self.max_model_len, self.pool_blocks * self.block_size) - len(prompt)
        return max(1, room)

    def score_prompt(self, prompt: list[int], k: int):
        """A future of prompt tokens 1.. (token 0 has no logprob) as `(id, logprob, rank, top)`,
        top the k most likely `((id, logprob), ...)`: one dense scoring pass on the engine
        thread, the model's distribution before any processing (as vLLM's prompt logprobs). The
        rank is vLLM's, the number of tokens at least as likely (1: the argmax)."""

        def run(eng):
            P = len(prompt)
            T = min(bucket(P), int(eng.cfg.max_position_embeddings))
            toks = np.zeros((1, T), np.int32)  # causal: padding after the prompt is inert
            toks[0, :P] = prompt
            logits = np.asarray(score(eng.cfg, eng.params, toks))[0, : P - 1]  # [P-1, V]
            return R.prompt_entries(logits, prompt, k)

        return self.engine.call(run)


async def _parse(request: Request, srv: _Server, model: type[P.BaseModel], unsupported=()):
    """The request body as `model`, for the served model, with no `unsupported` field set."""
    req = P.parse_body(await request.body(), model)
    srv.check_model(req.model)
    for field in unsupported:
        if getattr(req, field):
            raise P.APIError(400, f"{field}: not supported by this server", field)
    return req


# ----------------------------------------------------------------------------- the app


def build_app(
    engine: AsyncEngine,
    tokenizer: Any,
    model_name: str,
    chat_template: str | None = None,
    max_model_len: int | None = None,
) -> FastAPI:
    """The FastAPI app over a started `AsyncEngine`.

    Args:
      engine: the engine thread (started by the caller, stopped at the app's shutdown).
      tokenizer: any tokenizer with `encode` / `decode` (see detokenizer.py); its
        `chat_template` is used unless `chat_template` overrides it.
      model_name: the id clients pass as `model`.
      chat_template: a jinja chat template overriding the tokenizer's.
      max_model_len: the longest prompt + completion admitted; None: the model's positions.
    """
    srv = _Server(engine, tokenizer, model_name, chat_template, max_model_len)
    app = FastAPI(title="jaxinfer", docs_url=None, redoc_url=None)
    app.state.server = srv

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):  # a bug of the server: still an OpenAI body
        log.exception("unhandled error in %s", request.url.path)
        err = P.APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")
        return JSONResponse(err.body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        err = P.APIError(e.status_code, str(e.detail), None)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise P.APIError(503, "the engine is not running")
        # The T buckets its steps pad to: a benchmark's in-process twin takes the same ones.
        return {"status": "ok", "token_buckets": list(engine.engine.token_buckets)}

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": srv.created,
            "owned_by": "jaxinfer",
            "max_model_len": srv.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        body, ctype = engine.metrics.render()
        return Response(body, media_type=ctype)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        if not engine.alive:
            raise P.APIError(503, "the engine is not running")
        fut = engine.call(lambda e: e.allocator.reset_prefix_cache())  # on the engine thread
        return {"freed_blocks": await asyncio.wrap_future(fut)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, srv, P.CompletionRequest, unsupported=("suffix",))
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise P.APIError(400, "prompt: must not be empty", "prompt")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        keep = P.truncation(req, srv.max_model_len, max_tokens)
        enc = encode_prompt if req.add_special_tokens else encode  # vLLM's: a text's BOS or not
        prompts = [enc(tokenizer, p) if isinstance(p, str) else list(p) for p in prompt]
        prompts = [p[-keep:] for p in prompts] if keep else prompts
        return await _generate(request, srv, req, prompts, max_tokens, P.completion_logprobs(req))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(request, srv, P.ChatCompletionRequest, unsupported=("tools",))
        rf = req.response_format
        if rf and rf.get("type", "text") != "text":
            raise P.APIError(400, "response_format: only type 'text'", "response_format")
        # max_completion_tokens (OpenAI's newer name) wins; 0 is refused, not skipped.
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        keep = P.truncation(req, srv.max_model_len, max_tokens)
        enc = encode_prompt if req.add_special_tokens else encode  # default: the template's only
        prompt = enc(tokenizer, P.chat_prompt(req, tokenizer, srv.chat_template))
        prompts = [prompt[-keep:] if keep else prompt]
        if max_tokens is None:
            max_tokens = srv.default_max_tokens(prompts[0])
        logprobs = P.chat_logprobs(req)
        return await _generate(request, srv, req, prompts, max_tokens, logprobs)

    tokenization.add_routes(app, srv, tokenizer)
    return app


async def _generate(request: Request, srv: _Server, req, prompts, max_tokens, logprobs):
    chat = isinstance(req, P.ChatCompletionRequest)
    # vLLM's response role: the assistant's after a generation prompt, else the final message's.
    role = "assistant" if not chat or req.add_generation_prompt else req.messages[-1].role
    field = "messages" if chat else "prompt"
    cfg = srv.engine.engine.cfg
    bad_words = tokenization.bad_words_ids(req, srv.tokenizer)
    sp = P.sampling_params(req, max_tokens, logprobs, srv.max_n, bad_words)
    opts = P.text_options(req, stop_ids(cfg, sp), sp.min_tokens)
    if srv.speculative and sp.logprobs is not None:
        raise P.APIError(400, "logprobs: not supported with speculative decoding", "logprobs")
    try:
        check_sampling(cfg, sp)  # ids in the vocabulary (logit_bias, bad words too), min_tokens
    except SamplingError as e:
        if e.field == "bad_words_ids":  # the request's field is the words
            raise P.APIError(400, f"bad_words: their token sequences: {e}", "bad_words") from None
        raise P.APIError(400, str(e), e.field) from None
    echo = not chat and req.echo
    # Prompt scoring (a dense pass per prompt, not the engine's): the echo's logprob entries and
    # vLLM's prompt_logprobs, which an echo with logprobs returns too (never in a stream).
    echo_k = logprobs if echo and logprobs is not None else None
    prompt_k = P.num_prompt_logprobs(req)
    if prompt_k is None:
        prompt_k = echo_k
    if req.stream:
        prompt_k = None
    score_k = max((k for k in (echo_k, prompt_k) if k is not None), default=None)
    for p in prompts:
        srv.check_lengths(p, sp.max_tokens, sp.n, field)
    if len(prompts) > srv.engine.max_waiting:  # 503 "retry later" would never succeed
        raise P.APIError(
            400, f"{field}: {len(prompts)} prompts in one request; this server queues at most "
            f"{srv.engine.max_waiting}", field,
        )  # fmt: skip
    engine = srv.engine
    if srv.shutting_down or not engine.alive:
        raise P.APIError(503, "the server is shutting down", None, "shutting_down")
    if not engine.try_admit(len(prompts)):
        raise P.APIError(
            503, f"the waiting queue is full ({engine.max_waiting} requests); retry later",
            None, "queue_full",
        )  # fmt: skip
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()  # filled on this loop by the engine thread
    base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    rids = [f"{base}-{i}" for i in range(len(prompts))]
    scored = None
    try:
        if score_k is not None:
            futs = [srv.score_prompt(p, score_k) for p in prompts]
            scored = [await asyncio.wrap_future(f) for f in futs]
    except BaseException:
        engine.release(len(prompts))
        raise
    prompt_lps = None  # the echo's entries of prompt tokens 1..
    if echo_k is not None:
        prompt_lps = [[(t, lp, top[:echo_k]) for t, lp, _, top in s] for s in scored]
    prompt_logprobs = None  # per prompt, vLLM's shape
    if prompt_k is not None:
        prompt_logprobs = [R.prompt_logprobs(srv, s, prompt_k) for s in scored]
    futs = [engine.submit(p, sp, rid, queue.put_nowait, loop) for p, rid in zip(prompts, rids)]
    results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futs), return_exceptions=True)
    bad = [r for r in results if isinstance(r, BaseException)]
    if bad:
        for rid, r in zip(rids, results):
            if not isinstance(r, BaseException):
                engine.abort(rid, "abort")
        if isinstance(bad[0], RuntimeError):
            raise P.APIError(503, str(bad[0]), None, "shutting_down")
        raise P.APIError(400, f"{field}: {bad[0]}", field)

    n = sp.n
    choices = [
        R.Choice(i * n + j, srv.tokenizer, prompts[i], opts)
        for i in range(len(prompts))
        for j in range(n)
    ]
    index_of = {rid: i for i, rid in enumerate(rids)}
    live = set(rids)  # engine requests that may still hold blocks
    skip, spaces = opts.skip_special_tokens, opts.spaces_between_special_tokens
    prompt_text = [decode(srv.tokenizer, p, skip, spaces) for p in prompts] if echo else None

    def apply(items) -> list[tuple[R.Choice, str, list]]:
        """Routes one delivery; returns (choice, text, logprob entries) updates."""
        updates = []
        for item in items:
            i = index_of[item.request_id]
            if isinstance(item, EngineFailure):
                live.discard(item.request_id)
                for ch in choices[i * n : (i + 1) * n]:
                    if not ch.finished:
                        ch.fail(item.message)
                        updates.append((ch, "", []))
                continue
            ch = choices[i * n + item.sample_index]
            was_finished = ch.finished
            text, entries = ch.feed(item)
            if not was_finished:
                updates.append((ch, text, entries))
            if item.request_finished:
                live.discard(item.request_id)
        for rid in list(live):  # every choice done by a stop string: free the blocks now
            i = index_of[rid]
            if all(ch.finished for ch in choices[i * n : (i + 1) * n]):
                live.discard(rid)
                engine.abort(rid, "stop")
        return updates

    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"

    if not req.stream:
        try:
            while not all(ch.finished for ch in choices):
                try:
                    items = await asyncio.wait_for(queue.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                apply(items)
        finally:
            for rid in live:
                engine.abort(rid)
        failed = [ch for ch in choices if ch.finish_reason == "error"]
        if failed:
            raise P.APIError(500, failed[0].error, None, "engine_step_failed")
        out = []
        for ch in choices:
            text = ch.stop.text
            entries = ch.logprobs
            if echo:
                i = ch.index // n
                text = prompt_text[i] + text
                if prompt_lps is not None:
                    entries = [(prompts[i][0], None, None)] + prompt_lps[i] + entries
            lp = None
            if logprobs is not None:
                lp = (
                    R.chat_logprobs(srv, entries)
                    if chat
                    else R.completion_logprobs(srv, entries, 0)
                )
            c = {"index": ch.index, "logprobs": lp, "finish_reason": ch.finish_reason}
            if chat:
                c["message"] = {"role": role, "content": text}
            else:
                c["text"] = text
                if prompt_logprobs is not None:  # vLLM's: on each choice of a completion
                    c["prompt_logprobs"] = prompt_logprobs[ch.index // n]
            out.append(c)
        body = {
            "id": base,
            "object": obj,
            "created": created,
            "model": srv.model_name,
            "choices": out,
            "usage": R.usage(prompts, choices),
        }
        if chat and prompt_logprobs is not None:  # vLLM's: on a chat response, its one prompt
            body["prompt_logprobs"] = prompt_logprobs[0]
        return body

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"
    offsets = [0] * len(choices)

    def chunk(ch: R.Choice, text: str, entries: list, first: bool = False) -> str:
        lp = None
        if logprobs is not None and (entries or not chat):
            if chat:
                lp = R.chat_logprobs(srv, entries)
            else:
                lp = R.completion_logprobs(srv, entries, offsets[ch.index])
        offsets[ch.index] += len(text)
        reason = ch.finish_reason if ch.finished and ch.finish_reason != "error" else None
        if chat:
            delta = {"role": role, "content": text} if first else {"content": text}
            c = {"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            c = {"index": ch.index, "text": text, "logprobs": lp, "finish_reason": reason}
        body = {
            "id": base,
            "object": chunk_obj,
            "created": created,
            "model": srv.model_name,
            "choices": [c],
        }
        if include_usage:
            body["usage"] = None
        return R.sse(body)

    async def events():
        done = False
        try:
            for ch in choices:
                if chat:
                    yield chunk(ch, "", [], first=True)
                elif echo:
                    i = ch.index // n
                    pre = [(prompts[i][0], None, None)] + prompt_lps[i] if prompt_lps else []
                    yield chunk(ch, prompt_text[i], pre)
            while not all(ch.finished for ch in choices):
                items = await queue.get()
                while not queue.empty():  # steps that came while we were sending: one write
                    items = items + queue.get_nowait()
                sse = []
                for ch, text, entries in apply(items):
                    if ch.finish_reason == "error":
                        err = P.APIError(500, ch.error, None, "engine_step_failed")
                        sse.append(R.sse(err.body()))
                    elif text or entries or ch.finished:
                        sse.append(chunk(ch, text, entries))
                if sse:
                    yield "".join(sse)
            if include_usage:
                yield R.sse(
                    {
                        "id": base,
                        "object": chunk_obj,
                        "created": created,
                        "model": srv.model_name,
                        "choices": [],
                        "usage": R.usage(prompts, choices),
                    }
                )
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                for rid in live:
                    engine.abort(rid)

    return StreamingResponse(events(), media_type="text/event-stream")
