"""The OpenAI routes with the official client: text, streaming, n, stop, seed, logprobs, usage."""

from __future__ import annotations

import json

import httpx
import jax
import numpy as np
import openai
import pytest

import jaxinfer as ji
from jaxinfer.server import protocol
from tests.server.conftest import MODEL, metric, served

PROMPT = "def add(a, b):\n    return"


def _ids(tok, text):
    return tok.encode(text).ids


def _reference(model, ids, max_tokens, **kw):
    cfg, params, tok = model
    sp = ji.SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    out = ji.generate(cfg, params, [ids], sp)[0]
    return out, tok.decode(out.token_ids, skip_special_tokens=True)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(server.url + "/health").json()
    assert health == {"status": "ok", "token_buckets": list(server.engine.engine.token_buckets)}
    r = httpx.get(server.url + "/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_greedy_completion_equals_generate_and_usage(model, client):
    tok = model[2]
    ref, text = _reference(model, _ids(tok, PROMPT), 24)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == ("length" if len(ref.token_ids) == 24 else "stop")
    assert r.usage.prompt_tokens == len(_ids(tok, PROMPT))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Token ids as the prompt give the same.
    r2 = client.completions.create(
        model=MODEL, prompt=_ids(tok, PROMPT), max_tokens=24, temperature=0
    )
    assert r2.choices[0].text == text


def test_streaming_completion_and_usage(model, client, server):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # The raw stream is SSE ending with [DONE].
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in resp.iter_lines() if x]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)


def test_chat_streaming_and_not(model, client):
    msgs = [{"role": "system", "content": "Python."}, {"role": "user", "content": "sum"}]
    tok = model[2]
    ids = tok.encode("<|system|>Python.\n<|user|>sum\n<|assistant|>", add_special_tokens=False).ids
    ref, text = _reference(model, ids, 16)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_completion_tokens=16, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_n2_seed_and_reproducibility(model, client):
    tok = model[2]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=11)
    a = client.completions.create(n=2, **kw)
    b = client.completions.create(n=2, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # forks draw their own noise
    # Sample 0 is ji.generate's sample with the same seed.
    cfg, params, _ = model
    sp = ji.SamplingParams(temperature=1.0, max_tokens=16, seed=11)
    ref = ji.generate(cfg, params, [_ids(tok, PROMPT)], sp)[0]
    assert a.choices[0].text == tok.decode(ref.token_ids, skip_special_tokens=True)
    c = client.completions.create(n=1, **{**kw, "seed": 12})
    assert c.choices[0].text != a.choices[0].text
    # usage counts the tokens of both choices: one logprob entry per token.
    lp = client.completions.create(n=2, logprobs=0, **kw)
    assert lp.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in lp.choices)


def test_penalties_and_logit_bias_equal_generate(model, client):
    """OpenAI's presence / frequency penalties and logit_bias and vLLM's repetition_penalty
    reach the engine: greedy text equals ji.generate's with the same settings, and differs
    from the unpenalized text."""
    tok = model[2]
    ids = _ids(tok, PROMPT)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    first = _ids(tok, plain.choices[0].text)[0]
    cases = [
        dict(presence_penalty=1.5, frequency_penalty=0.7),
        dict(logit_bias={str(first): -100}),
        dict(extra_body={"repetition_penalty": 1.6}),
    ]
    for kw in cases:
        r = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, **kw
        )
        sp = {**kw.pop("extra_body", {}), **kw}
        if "logit_bias" in sp:
            sp["logit_bias"] = {int(k): v for k, v in sp["logit_bias"].items()}
        _, text = _reference(model, ids, 24, **sp)
        assert r.choices[0].text == text, kw
        assert r.choices[0].text != plain.choices[0].text, kw
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "sum"}], max_tokens=8, temperature=0,
        logit_bias={str(first): 100},
    )  # fmt: skip
    assert _ids(tok, chat.choices[0].message.content)[0] == first


def test_min_tokens_and_allowed_token_ids_equal_generate(model, client):
    """vLLM's `min_tokens` and `allowed_token_ids` reach the engine (they were ignored, as
    unknown fields): greedy text and finish equal ji.generate's, and min_tokens also holds back
    stop strings in the text of its first tokens, as vLLM does."""
    cfg, _, tok = model
    ids = _ids(tok, PROMPT)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    plain = client.completions.create(**kw)
    first = _ids(tok, plain.choices[0].text)[0]
    even = list(range(0, cfg.vocab_size, 2))
    stop_first = dict(stop_token_ids=[first], logit_bias={first: 100.0})  # stops at once
    cases = [
        (dict(allowed_token_ids=even), "length"),
        (stop_first, "stop"),
        (dict(stop_first, min_tokens=5), "stop"),
    ]
    for sp, reason in cases:
        body = dict(sp, logit_bias={str(k): v for k, v in sp.get("logit_bias", {}).items()})
        r = client.completions.create(**kw, extra_body=body)
        out, text = _reference(model, ids, 24, **sp)
        if reason == "stop":  # the stop token's text is not in the output, as vLLM's default
            text = tok.decode(out.token_ids[:-1], skip_special_tokens=True)
        assert r.choices[0].text == text and r.choices[0].finish_reason == reason, sp
        assert r.usage.completion_tokens == len(out.token_ids), sp
    assert len(out.token_ids) == 6 and out.token_ids[-1] == first  # the last case: 5, then stop
    # A stop string inside the first min_tokens tokens' text does not stop the request.
    full_ids = _ids(tok, plain.choices[0].text)
    stop = tok.decode(full_ids[:1])
    assert client.completions.create(**kw, stop=[stop]).choices[0].text == ""
    r = client.completions.create(**kw, stop=[stop], extra_body={"min_tokens": 4})
    full, floor = plain.choices[0].text, len(tok.decode(full_ids[:4]))
    end = full.find(stop, max(0, floor - len(stop) + 1))
    assert r.choices[0].text == (full if end < 0 else full[:end])
    assert len(r.choices[0].text) >= floor


def test_unimplemented_fields_at_neutral_values_are_served(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
        extra_body={"bad_words": [], "use_beam_search": False, "skip_special_tokens": True,
                    "include_stop_str_in_output": False, "min_tokens": 0},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        tool_choice="none", extra_body={"modalities": ["text"]},
    )  # fmt: skip
    assert chat.usage.completion_tokens == 2


def test_stop_strings_streaming_and_not(model, client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0)
    text = full.choices[0].text
    stop = text[8:11]
    assert stop and text.index(stop) == 8, text
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop, "\x00never"]
    )
    assert r.choices[0].text == text[:8] and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text[:8]
    assert chunks[-1].choices[0].finish_reason == "stop"


def _score_logprobs(model, ids):
    cfg, params, _ = model
    logits = ji.score(cfg, params, np.asarray([ids], np.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits, -1))  # [S, V]


def test_logprobs_completion_and_echo(model, client):
    tok = model[2]
    prompt_ids = _ids(tok, PROMPT)
    r = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=8, temperature=0, logprobs=3, echo=True
    )
    lp = r.choices[0].logprobs
    P = len(prompt_ids)
    assert len(lp.tokens) == P + r.usage.completion_tokens
    assert r.choices[0].text.startswith(tok.decode(prompt_ids))
    ref, _ = _reference(model, prompt_ids, 8)
    ids = prompt_ids + ref.token_ids
    want = _score_logprobs(model, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):  # prompt tokens (scored) and generated ones (engine)
        np.testing.assert_allclose(lp.token_logprobs[i], want[i - 1, ids[i]], atol=2e-4)
        top = lp.top_logprobs[i]
        best = np.sort(want[i - 1])[::-1][:3]
        np.testing.assert_allclose(sorted(top.values(), reverse=True)[:3], best, atol=2e-4)
    assert "".join(lp.tokens) == r.choices[0].text


def test_logprobs_chat(client):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob <= 0 and item.top_logprobs[0].logprob >= item.logprob - 1e-5
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, stream=True
        )
    )
    streamed = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.content
    ]
    assert [x.token for x in streamed] == [x.token for x in content]


BAD = [
    ("temperature", {"temperature": "hot"}),
    ("temperature", {"temperature": -1}),
    ("temperature", {"temperature": True}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_p", {"top_p": 1e-46}),  # below float32: was accepted and kept every token
    ("temperature", {"temperature": 1e-40}),  # logits / T overflowed: was token 0, not argmax
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 1.5}),
    ("min_p", {"min_p": 2}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": "10"}),
    ("n", {"n": 0}),
    ("n", {"n": 100}),
    ("seed", {"seed": "s"}),
    ("stop", {"stop": 3}),
    ("stop", {"stop": [""]}),
    ("logprobs", {"logprobs": 21}),
    ("logprobs", {"logprobs": -1}),
    ("stream", {"stream": "yes"}),
    ("stream_options.include_usage", {"stream": True, "stream_options": {"include_usage": 1}}),
    ("presence_penalty", {"presence_penalty": "x"}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -2.01}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("repetition_penalty", {"repetition_penalty": "1.1"}),
    ("logit_bias", {"logit_bias": {"1": 101.0}}),
    ("logit_bias", {"logit_bias": {"one": 5.0}}),
    ("logit_bias", {"logit_bias": {"-1": 5.0}}),
    ("logit_bias", {"logit_bias": {str(10**6): 5.0}}),  # beyond the vocabulary
    ("logit_bias", {"logit_bias": {"4096": 5.0}}),  # the first id beyond it (check_sampling's)
    ("logit_bias", {"logit_bias": {"9999999999": 5.0}}),  # beyond int32 (SamplingParams')
    ("logit_bias.1", {"logit_bias": {"1": "5"}}),
    ("best_of", {"best_of": 3}),
    ("user", {"user": 5}),
    ("prompt", {"prompt": 5}),
    ("prompt", {"prompt": [1.5, 2]}),
    ("prompt", {"prompt": {"text": "x"}}),
    ("prompt", {"prompt": []}),
    ("prompt", {"prompt": [10**9]}),
    ("prompt", {"prompt": "x" * 5000}),
    ("max_tokens", {"max_tokens": 1030}),  # beyond the context of 1024
    ("echo", {"echo": "true"}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    # Beyond the engine's int32 (were 500s from SamplingParams) and beyond the vocabulary (was
    # a 400 naming "prompt").
    ("max_tokens", {"max_tokens": 2**31}),
    ("top_k", {"top_k": 2**40}),
    ("stop_token_ids", {"stop_token_ids": [2**31]}),
    ("stop_token_ids", {"stop_token_ids": [10**6]}),
    ("prompt", {"prompt": ["x"] * 65}),  # more prompts than max_waiting: was 503 "retry later"
    # Without stream = true, as OpenAI (were accepted and ignored).
    ("stream_options", {"stream_options": {"include_usage": True}}),
    ("stream_options", {"stream": False, "stream_options": {"include_usage": False}}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("min_tokens", {"min_tokens": 1.5}),
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [3, -1]}),
    ("allowed_token_ids", {"allowed_token_ids": [10**6]}),
    ("allowed_token_ids", {"allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 1}),
    # vLLM's and OpenAI's fields that change the output and are not built here (were ignored).
    ("guided_json", {"guided_json": {"type": "object"}}),
    ("guided_choice", {"guided_choice": ["a", "b"]}),
    ("guided_regex", {"guided_regex": "a+"}),
    ("structured_outputs", {"structured_outputs": {"choice": ["a"]}}),
    ("use_beam_search", {"use_beam_search": True}),
    ("truncation_side", {"truncate_prompt_tokens": 2, "truncation_side": "right"}),
    ("logits_processors", {"logits_processors": ["m.f"]}),
    # vLLM's text extensions, built: their bad values.
    ("include_stop_str_in_output", {"include_stop_str_in_output": "yes"}),
    ("skip_special_tokens", {"skip_special_tokens": 0}),
    ("spaces_between_special_tokens", {"spaces_between_special_tokens": "no"}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": -2}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 2.5}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": True}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 1009}),  # > 1024 - max_tokens 16
    # vLLM's bad_words (were refused as not built): not a list of strings, a word of no tokens
    # (vLLM's own tokenization fails on it), more than the engine's limits.
    ("bad_words", {"bad_words": "x"}),
    ("bad_words.0", {"bad_words": [1]}),
    ("bad_words", {"bad_words": [""]}),
    ("bad_words", {"bad_words": ["a", "  "]}),
    ("bad_words", {"bad_words": ["x " * 40]}),  # 41 tokens > MAX_BAD_WORD_LEN
    ("bad_words", {"bad_words": [str(i) for i in range(300)]}),  # > MAX_BAD_WORDS
    # vLLM's prompt_logprobs: its max_logprobs (20; -1 is the vocabulary), not with a stream.
    ("prompt_logprobs", {"prompt_logprobs": 21}),
    ("prompt_logprobs", {"prompt_logprobs": -1}),
    ("prompt_logprobs", {"prompt_logprobs": -2}),
    ("prompt_logprobs", {"prompt_logprobs": "1"}),
    ("prompt_logprobs", {"prompt_logprobs": 1.5}),
    ("prompt_logprobs", {"prompt_logprobs": True}),
    ("prompt_logprobs", {"prompt_logprobs": 1, "stream": True}),
    ("prompt_logprobs", {"prompt_logprobs": -1, "stream": True}),
    ("add_special_tokens", {"add_special_tokens": "no"}),
]


@pytest.mark.parametrize("param,body", BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_invalid_completion_fields_400(server, client, param, body):
    body = {"model": MODEL, "prompt": "x", **body}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    served(client)


CHAT_BAD = [
    ("messages", {"messages": []}),
    ("messages", {"messages": "hi"}),
    ("messages.0.role", {"messages": [{"content": "hi"}]}),
    ("messages.0.content", {"messages": [{"role": "user", "content": 5}]}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 30}),
    ("top_logprobs", {"top_logprobs": 2}),
    ("logprobs", {"logprobs": 2}),
    ("max_completion_tokens", {"max_completion_tokens": "a"}),
    ("tools", {"tools": [{"type": "function"}]}),
    ("max_completion_tokens", {"max_completion_tokens": 0}),  # was ignored (max_tokens used)
    ("max_completion_tokens", {"max_completion_tokens": 2**31}),  # was a 500
    # apply_chat_template's own arguments (were 500s: "got multiple values for argument")
    ("chat_template_kwargs", {"chat_template_kwargs": {"messages": []}}),
    ("chat_template_kwargs", {"chat_template_kwargs": {"add_generation_prompt": False}}),
    ("chat_template_kwargs", {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
    # Faults of chat_template_kwargs were 400s naming messages (documents=5 was a 500 before).
    ("chat_template_kwargs", {"chat_template_kwargs": {"documents": 5}}),
    ("chat_template_kwargs", {"chat_template_kwargs": {"date_string": 5}}),  # 'Today: ' + 5
    ("chat_template_kwargs", {"chat_template_kwargs": {"continue_final_message": True}}),
    ("stream_options", {"stream_options": {"include_usage": True}}),  # without stream = true
    # Tools by other names (were ignored, or reached the template past the refused `tools`).
    ("tool_choice", {"tool_choice": "auto"}),
    ("functions", {"functions": [{"name": "f"}]}),
    ("function_call", {"function_call": "auto"}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("chat_template_kwargs.tools", {"chat_template_kwargs": {"tools": [{"type": "function"}]}}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 1021, "max_tokens": 4}),  # > 1020
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
    ("bad_words", {"bad_words": [" "]}),
    ("prompt_logprobs", {"prompt_logprobs": 2, "stream": True}),
    ("prompt_logprobs", {"prompt_logprobs": 21}),
    # vLLM's continue_final_message (was ignored): not with add_generation_prompt (default true),
    # and a final message it cannot continue (no content).
    ("continue_final_message", {"continue_final_message": True}),
    ("continue_final_message", {"continue_final_message": True, "add_generation_prompt": True}),
    ("continue_final_message", {"continue_final_message": True, "add_generation_prompt": False,
                                "messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "tool_calls": []}]}),
    ("continue_final_message", {"continue_final_message": "yes"}),
    ("add_special_tokens", {"add_special_tokens": 1}),
]  # fmt: skip


@pytest.mark.parametrize("param,body", CHAT_BAD, ids=[p for p, _ in CHAT_BAD])
def test_invalid_chat_fields_400(server, client, param, body):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    served(client)


# Unknown roles were passed to the template; a null user / system content rendered as ""; an
# image part was refused with "Input should be a valid string".
MESSAGES_BAD = [
    ("messages.0.role", "'wizard'", [{"role": "wizard", "content": "hi"}]),
    ("messages.1.role", "'User'", [{"role": "user", "content": "a"}, {"role": "User"}]),
    ("messages.0.content", "'user'", [{"role": "user", "content": None}]),
    ("messages.0.content", "'system'", [{"role": "system"}, {"role": "user", "content": "a"}]),
    ("messages.0.content", "'tool'", [{"role": "tool", "tool_call_id": "c"}]),
    (
        "messages.0.content",
        "'image_url'",
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ),
    (
        "messages.0.content",
        "part 1",
        [{"role": "user", "content": [{"type": "text", "text": ""}, 5]}],
    ),
    ("messages.0.content", "'text'", [{"role": "user", "content": [{"type": "text"}]}]),
    ("messages.0.content", "empty list", [{"role": "user", "content": []}]),  # was ""
    # A long bad value is named by its start and its length, not echoed whole.
    ("messages.0.role", "'wwwww", [{"role": "w" * 100_000, "content": "hi"}]),
]


@pytest.mark.parametrize("param,named,messages", MESSAGES_BAD)
def test_bad_message_role_or_content_400(server, client, param, named, messages):
    body = {"model": MODEL, "messages": messages}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and named in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    assert len(err["message"]) < 300, len(err["message"])
    served(client)


def test_every_role_text_parts_and_template_kwargs_render(model, server, client):
    """The six OpenAI roles, text parts (joined by newlines, as vLLM does), a null assistant
    content and a template variable render as the template says: the chat completion is the
    completion of that text."""
    messages = [
        {"role": "system", "content": "S"},
        {"role": "developer", "content": [{"type": "text", "text": "D"}]},
        {"role": "user", "content": [{"type": "text", "text": t} for t in ("U1", "U2")]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
        {"role": "tool", "content": "T", "tool_call_id": "c"},
        {"role": "function", "content": None, "name": "f"},
    ]
    text = "Today: d\n<|system|>S\n<|developer|>D\n<|user|>U1\nU2\n<|assistant|>\n<|tool|>T\n"
    text += "<|function|>\n<|assistant|>"
    body = {
        "model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0,
        "chat_template_kwargs": {"date_string": "d"},
    }  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600)  # may compile
    assert r.status_code == 200, r.text
    ids = model[2].encode(text, add_special_tokens=False).ids
    ref = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert r.json()["choices"][0]["message"]["content"] == ref.choices[0].text


def test_template_failure_names_the_input_at_fault():
    """A template that fails only with chat_template_kwargs is their fault; one that fails on
    the messages without them is the messages' (the same request with both: messages)."""
    template = (
        "{% if date_string is defined %}{{ 'Today: ' + date_string }}{% endif %}"
        "{% for m in messages %}{% if m.content == 'no' %}{{ raise_exception('no') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )

    def render(content, kwargs):
        req = protocol.ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": [{"role": "user", "content": content}],
             "chat_template_kwargs": kwargs}
        )  # fmt: skip
        return protocol.chat_prompt(req, None, template)

    assert render("hi", {"date_string": "d "}) == "Today: d hi"
    for content, kwargs, param in [
        ("hi", {"date_string": 5}, "chat_template_kwargs"),
        ("no", {"date_string": "d"}, "messages"),
        ("no", {"date_string": 5}, "messages"),
        ("no", None, "messages"),
    ]:
        with pytest.raises(protocol.APIError) as e:
            render(content, kwargs)
        assert e.value.status == 400 and e.value.param == param, (content, kwargs, e.value.message)


def test_malformed_json_unknown_model_and_pool(server, client):
    for raw in (b"{", b"[1, 2]", b"", b"not json", b'{"model": "target", "prompt": "x",}'):
        r = httpx.post(
            server.url + "/v1/completions", content=raw,
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert r.status_code == 400, (raw, r.text)
        served(client)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["param"] == "model" and "'gpt-4'" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:  # a long name is cut, not echoed whole
        client.completions.create(model="m" * 100_000, prompt="x")
    assert "'mmm" in e.value.body["message"] and len(e.value.body["message"]) < 300
    # Fits the context (1024) but not the pool (64 blocks x 16 slots) with n = 4 forks.
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x " * 300, "max_tokens": 700, "n": 4},
    )
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt", r.text
    # Unknown fields are ignored.
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1, "vendor_extra": {"a": 1}},
    )
    assert r.status_code == 200
    served(client)


def test_request_that_fills_the_pool_exactly_is_admitted(server, client, model):
    """n = 1 needs ceil((prompt + max_tokens) / S) blocks, as the scheduler admits: a chat request
    without max_tokens (which defaults to the pool's room) was refused with 413 when its prompt
    did not end on a block boundary."""
    tok = model[2]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
    prompt = _ids(tok, "a b c")  # not a multiple of 16 tokens
    assert len(prompt) % 16
    room = 64 * 16 - len(prompt)
    fits = {"model": MODEL, "prompt": prompt, "stream": True, "max_tokens": room}
    with httpx.stream("POST", server.url + "/v1/completions", json=fits, timeout=60) as r:
        assert r.status_code == 200, r.read()
    r = httpx.post(server.url + "/v1/completions", json={**fits, "max_tokens": room + 1})
    assert r.status_code in (400, 413), r.text  # one slot beyond: the context or the pool
    served(client)


def test_queue_full_503_with_retry_after(server, client):
    import threading

    gate = threading.Event()
    server.engine.call(lambda engine: gate.wait(30))  # hold the engine thread between steps
    old, server.engine.max_waiting = server.engine.max_waiting, 2
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as h:
            pending = [
                threading.Thread(target=h.post, args=("/v1/completions",), kwargs={"json": body})
                for _ in range(2)
            ]
            for t in pending:
                t.start()
            while server.engine.num_waiting < 2:
                gate.wait(0.01)
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            gate.set()
            for t in pending:
                t.join()
    finally:
        gate.set()
        server.engine.max_waiting = old
    served(client)


def test_request_log(server, client):
    served(client)
    lines = [json.loads(x) for x in server.request_log.read_text().splitlines()]
    rec = lines[-1]
    assert {"arrival", "first_token", "finish", "prompt_tokens", "completion_tokens"} <= set(rec)
    assert rec["arrival"] <= rec["first_token"] <= rec["finish"]
    assert rec["finish_reason"] in ("stop", "length")


def test_reset_prefix_cache(server, client):
    """A replayed prompt hits the prefix cache; after POST /reset_prefix_cache it does not."""
    prompt = list(range(300, 340))  # 40 tokens: two full blocks of 16 are cached

    def hits_of_one_request() -> float:
        before = metric(server, "jaxinfer:prefix_cache_hits_total")
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        return metric(server, "jaxinfer:prefix_cache_hits_total") - before

    hits_of_one_request()
    assert hits_of_one_request() >= 32  # the replay found both blocks
    freed = httpx.post(server.url + "/reset_prefix_cache").json()["freed_blocks"]
    assert freed >= 2
    assert httpx.post(server.url + "/reset_prefix_cache").json()["freed_blocks"] == 0
    assert hits_of_one_request() == 0
