"""vLLM's text extensions over the shared server: include_stop_str_in_output, skip_special_tokens,
truncate_prompt_tokens, and the /tokenize and /detokenize routes, against `ji.generate` and the
tokenizer itself."""

from __future__ import annotations

import httpx
import pytest
from tokenizers import processors

import jaxinfer as ji
from jaxinfer.server import protocol
from tests.server.conftest import CHAT_TEMPLATE, MODEL, served

PROMPT = "def add(a, b):\n    return"
BOS, EOS = 0, 1  # the shipped tokenizer's specials


def _generate(model, ids, max_tokens, **kw):
    cfg, params, _ = model
    sp = ji.SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return ji.generate(cfg, params, [ids], sp)[0]


def _streamed(client, **kw) -> tuple[str, str]:
    """The text of a streamed completion and its last finish_reason."""
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


# ------------------------------------------------------------------ include_stop_str_in_output


def test_include_stop_str_in_output_keeps_the_stop_string(model, client):
    tok = model[2]
    ids = tok.encode(PROMPT).ids
    want = tok.decode(_generate(model, ids, 32).token_ids)  # the greedy text, no stop
    stop = want[8:11]
    assert want.index(stop) == 8, want
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop])
    r = client.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == want[:11] and r.choices[0].text.endswith(stop)
    assert r.choices[0].finish_reason == "stop"
    streamed = _streamed(client, **kw, extra_body={"include_stop_str_in_output": True})
    assert streamed == (want[:11], "stop")
    assert client.completions.create(**kw).choices[0].text == want[:8]  # the default cuts it
    # Two stop strings, the later-starting one complete first (it is one token, "('"): the
    # text stops at it, kept or cut, and never runs on to the other one.
    long, short = want[8:14], want[10:12]
    assert want.index(short) == 10, want
    kw["stop"] = [long, short]
    for extra, text in (({"include_stop_str_in_output": True}, want[:12]), ({}, want[:10])):
        assert client.completions.create(**kw, extra_body=extra).choices[0].text == text, extra
        assert _streamed(client, **kw, extra_body=extra) == (text, "stop"), extra


def test_stop_token_text_only_with_include_stop_str_in_output(model, client):
    """As vLLM: the stop token that ends a sample (stop_token_ids, eos) is left out of the text
    unless include_stop_str_in_output; eos is special, so its text also needs
    skip_special_tokens = false."""
    tok = model[2]
    ids = tok.encode(PROMPT).ids
    plain = _generate(model, ids, 32).token_ids
    stop_id = plain[2]
    assert stop_id not in plain[:2] and stop_id not in (BOS, EOS)
    out = _generate(model, ids, 32, stop_token_ids=(stop_id,))
    assert out.finish_reason == "stop" and out.token_ids == plain[:3]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0)
    for include, want_ids in ((False, plain[:2]), (True, plain[:3])):
        body = {"stop_token_ids": [stop_id], "include_stop_str_in_output": include}
        r = client.completions.create(**kw, extra_body=body)
        want = tok.decode(want_ids)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop", include
        assert r.usage.completion_tokens == 3  # the stop token is counted either way
        assert _streamed(client, **kw, extra_body=body) == (want, "stop"), include
    # eos first (biased): its text only when kept and not skipped.
    kw["logit_bias"] = {str(EOS): 100}
    for include, skip, want in ((True, False, "<|eos|>"), (False, False, ""), (True, True, "")):
        body = {"include_stop_str_in_output": include, "skip_special_tokens": skip}
        r = client.completions.create(**kw, extra_body=body)
        assert r.choices[0].text == want and r.usage.completion_tokens == 1, body


# ------------------------------------------------------------------------- skip_special_tokens


def test_skip_special_tokens_false_decodes_them(model, client):
    """Echo of a prompt holding specials and a generation that makes one (the model answers
    <|bos|> after <|eos|>): the text is the tokenizers library's decode of the ids with
    skip_special_tokens=False, streaming and not, and the logprob tokens spell it out."""
    tok = model[2]
    prompt = tok.encode("x = 1<|eos|><|bos|>y = 2<|eos|>").ids
    assert EOS in prompt and BOS in prompt
    gen = _generate(model, prompt, 8, ignore_eos=True).token_ids
    assert BOS in gen  # a special token is generated too
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    for skip in (False, True):
        body = {"ignore_eos": True, "skip_special_tokens": skip}
        want = tok.decode(prompt + gen, skip_special_tokens=skip)
        r = client.completions.create(**kw, logprobs=0, extra_body=body)
        assert r.choices[0].text == want, skip
        assert ("".join(r.choices[0].logprobs.tokens) == want) == (not skip)  # specials in both
        assert _streamed(client, **kw, extra_body=body)[0] == want, skip
    # spaces_between_special_tokens = false: byte-level BPE puts no space between specials.
    body = {"ignore_eos": True, "skip_special_tokens": False}
    r = client.completions.create(**kw, extra_body={**body, "spaces_between_special_tokens": False})
    assert r.choices[0].text == tok.decode(prompt + gen, skip_special_tokens=False)
    # Chat: a generation of specials (eos biased, not a stop).
    messages = [{"role": "user", "content": "hi"}]
    ids = tok.encode(
        ji.apply_chat_template(tok, messages, True, chat_template=CHAT_TEMPLATE),
        add_special_tokens=False,
    ).ids
    gen = _generate(model, ids, 4, ignore_eos=True, logit_bias={EOS: 100.0}).token_ids
    assert gen == [EOS] * 4
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logit_bias={str(EOS): 100},
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )  # fmt: skip
    assert r.choices[0].message.content == tok.decode(gen, skip_special_tokens=False)


# ---------------------------------------------------------------------- truncate_prompt_tokens


def test_truncate_prompt_tokens_keeps_the_last_k(model, client):
    tok = model[2]
    ids = tok.encode(PROMPT).ids
    k = 5
    assert len(ids) > k
    want = tok.decode(_generate(model, ids[-k:], 12).token_ids)
    assert want != tok.decode(_generate(model, ids, 12).token_ids)  # truncation shows
    kw = dict(model=MODEL, max_tokens=12, temperature=0)
    body = {"truncate_prompt_tokens": k}
    r = client.completions.create(prompt=PROMPT, **kw, extra_body=body)
    assert r.usage.prompt_tokens == k and r.choices[0].text == want
    r = client.completions.create(prompt=ids, echo=True, **kw, extra_body=body)  # token ids
    assert r.usage.prompt_tokens == k and r.choices[0].text == tok.decode(ids[-k:]) + want
    r = client.completions.create(prompt=PROMPT, **kw, extra_body={"truncate_prompt_tokens": 99})
    assert r.usage.prompt_tokens == len(ids)  # a longer k keeps the prompt
    # Chat: the rendered conversation's last k tokens.
    messages = [{"role": "user", "content": "sum the list"}]
    chat_ids = tok.encode(
        ji.apply_chat_template(tok, messages, True, chat_template=CHAT_TEMPLATE),
        add_special_tokens=False,
    ).ids
    r = client.chat.completions.create(messages=messages, **kw, extra_body=body)
    ref = client.completions.create(prompt=chat_ids[-k:], **kw)
    assert r.usage.prompt_tokens == k and r.choices[0].message.content == ref.choices[0].text


def _truncation(k, max_tokens, max_model_len=100):
    req = protocol.CompletionRequest.model_validate(
        {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": k}
    )
    return protocol.truncation(req, max_model_len, max_tokens)


def test_truncation_values_as_vllm():
    """None keeps all; -1 keeps what fits beside max_tokens (a chat without max_tokens: the
    context); k >= 1 up to that; anything else is a 400 naming the field."""
    assert _truncation(None, 16) is None
    assert _truncation(-1, 16) == 84 and _truncation(-1, None) == 100
    assert _truncation(84, 16) == 84 and _truncation(1, 16) == 1
    assert _truncation(-1, 100) == 1  # nothing fits: max_tokens' own 400 follows
    for k, max_tokens in ((85, 16), (0, 16), (-2, 16), (101, None)):
        with pytest.raises(protocol.APIError) as e:
            _truncation(k, max_tokens)
        assert e.value.status == 400 and e.value.param == "truncate_prompt_tokens", k


# --------------------------------------------------------------------- /tokenize, /detokenize


def _post(server, path, body):
    return httpx.post(server.url + path, json=body)


def test_tokenize_and_detokenize(model, server):
    tok = model[2]
    text = "héllo wörld 🙂 <|eos|> done"
    want = tok.encode(text).ids
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(want), "max_model_len": 1024, "tokens": want,
                        "token_strs": None}  # fmt: skip
    assert EOS in want  # the special token in the text is one token
    r = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True})  # model optional
    assert r.json()["token_strs"] == [tok.id_to_token(t) for t in want]
    # Round trip: the text back, special tokens included (vLLM's decode keeps them).
    r = _post(server, "/detokenize", {"model": MODEL, "tokens": want})
    assert r.status_code == 200 and r.json() == {"prompt": text}, r.text
    ids = [BOS, 300, EOS, 17, 4095]
    r = _post(server, "/detokenize", {"tokens": ids})
    assert r.json()["prompt"] == tok.decode(ids, skip_special_tokens=False)
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_tokenize_add_special_tokens(model, server):
    """With a post-processor that adds BOS (as Llama's): the prompt form adds it unless
    add_special_tokens = false; the chat form only if add_special_tokens = true."""
    tok = model[2]
    backend = tok.backend
    old = backend.post_processor
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", BOS)]
    )
    try:
        plain = tok.encode("a b", add_special_tokens=False).ids
        for body, want in (
            ({"prompt": "a b"}, [BOS, *plain]),
            ({"prompt": "a b", "add_special_tokens": False}, plain),
        ):
            assert _post(server, "/tokenize", body).json()["tokens"] == want, body
        messages = [{"role": "user", "content": "a b"}]
        rendered = ji.apply_chat_template(tok, messages, True, chat_template=CHAT_TEMPLATE)
        chat = tok.encode(rendered, add_special_tokens=False).ids
        for extra, want in (({}, chat), ({"add_special_tokens": True}, [BOS, *chat])):
            r = _post(server, "/tokenize", {"messages": messages, **extra})
            assert r.json()["tokens"] == want, extra
    finally:
        backend.post_processor = old


def test_tokenize_chat_equals_the_chat_route(model, server, client):
    tok = model[2]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "sum"}]
    for add in (True, False):
        rendered = ji.apply_chat_template(tok, messages, add, chat_template=CHAT_TEMPLATE)
        want = tok.encode(rendered, add_special_tokens=False).ids
        body = {"model": MODEL, "messages": messages, "add_generation_prompt": add}
        r = _post(server, "/tokenize", body)
        assert r.status_code == 200 and r.json()["tokens"] == want, r.text
        assert r.json()["count"] == len(want)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    tokens = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert chat.usage.prompt_tokens == len(tokens)


TOKENIZE_BAD = [
    ("/tokenize", 404, "model", {"model": "gpt-4", "prompt": "x"}),
    ("/tokenize", 404, "model", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
    ("/tokenize", 400, "prompt", {"prompt": 5}),
    ("/tokenize", 400, "prompt", {}),
    ("/tokenize", 400, "add_special_tokens", {"prompt": "x", "add_special_tokens": "yes"}),
    ("/tokenize", 400, "messages.0.role", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/tokenize", 400, "messages", {"messages": []}),
    ("/tokenize", 400, "chat_template", {"messages": [{"role": "user", "content": "x"}],
                                         "chat_template": "{{ 1 }}"}),
    ("/tokenize", 400, "continue_final_message", {  # add_generation_prompt is true by default
        "messages": [{"role": "user", "content": "x"}], "continue_final_message": True}),
    ("/detokenize", 404, "model", {"model": "gpt-4", "tokens": [1]}),
    ("/detokenize", 400, "tokens", {"tokens": [-1]}),
    ("/detokenize", 400, "tokens", {"tokens": [5, 4096]}),  # the vocabulary is [0, 4096)
    ("/detokenize", 400, "tokens", {"tokens": [10**12]}),
    ("/detokenize", 400, "tokens.0", {"tokens": ["a"]}),
    ("/detokenize", 400, "tokens.1", {"tokens": [2, 1.5]}),
    ("/detokenize", 400, "tokens", {}),
]  # fmt: skip


@pytest.mark.parametrize("path,status,param,body", TOKENIZE_BAD)
def test_tokenize_detokenize_errors(server, client, path, status, param, body):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and param.split(".")[0] in err["message"], err
    r = httpx.post(server.url + path, content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    served(client)
