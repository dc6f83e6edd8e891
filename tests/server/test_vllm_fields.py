"""vLLM's request fields over the shared server: `bad_words` (tokenized as vLLM tokenizes them,
served as `ji.generate` with those `bad_words_ids`), `prompt_logprobs` (against a full forward's
log-softmax), chat's `continue_final_message` and `add_special_tokens` (the prompt ids the engine
gets, against the template's text tokenized by hand)."""

from __future__ import annotations

import httpx
import pytest
from tokenizers import processors

import jaxinfer as ji
from jaxinfer.server import protocol, tokenization
from tests.server.conftest import CHAT_TEMPLATE, MODEL, check_prompt_logprobs

PROMPT = "def add(a, b):\n    return"
BOS = 0  # the shipped tokenizer's <|bos|>


def _enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _generate(model, ids, max_tokens, **kw):
    cfg, params, _ = model
    sp = ji.SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return ji.generate(cfg, params, [ids], sp)[0]


def _post(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=600)  # a first request may compile
    assert r.status_code == 200, r.text
    return r.json()


def _holds(ids, seq) -> bool:
    return any(tuple(ids[i : i + len(seq)]) == tuple(seq) for i in range(len(ids)))


# -------------------------------------------------------------------------------- bad_words


def _bad_words_ids(tokenizer, words):
    req = protocol.CompletionRequest.model_validate(
        {"model": MODEL, "prompt": "x", "bad_words": words}
    )
    return tokenization.bad_words_ids(req, tokenizer)


class _PrefixSpaceTokenizer:
    """A SentencePiece-like tokenizer: a leading space is part of the word, " w" encodes as
    "w" (one id per character)."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text.lstrip(" ")]


def test_bad_words_tokenized_as_vllm(model):
    """Each word without its leading whitespace, and again after a space where that encodes to
    as many tokens with another first one (vLLM's update_from_tokenizer)."""
    tok = model[2]
    a, space_a = _enc(tok, "a"), _enc(tok, " a")
    assert len(a) == len(space_a) == 1 and a != space_a  # " a" is its own token: both banned
    ret, space_ret = _enc(tok, "return"), _enc(tok, " return")
    assert len(ret) == len(space_ret) and ret[0] != space_ret[0]
    hw, space_hw = _enc(tok, "hello world"), _enc(tok, " hello world")
    assert len(hw) != len(space_hw)  # the spaced form is another length: not banned
    want = (tuple(a), tuple(space_a), tuple(ret), tuple(space_ret), tuple(hw))
    assert _bad_words_ids(tok, ["a", "  return", "hello world"]) == want
    # " w" encodes as "w" (the same first id): the word once.
    assert _bad_words_ids(_PrefixSpaceTokenizer(), [" ab", "c"]) == ((97, 98), (99,))
    assert _bad_words_ids(tok, []) == () and _bad_words_ids(tok, None) == ()


def test_bad_words_ids_limits_are_400s_naming_bad_words(model):
    """The SamplingParams bounds (MAX_BAD_WORDS sequences of at most MAX_BAD_WORD_LEN tokens)
    are 400s naming bad_words, checked before SamplingParams and by it (never a 500)."""
    from jaxinfer.sampling import MAX_BAD_WORD_LEN, MAX_BAD_WORDS

    tok = model[2]
    req = protocol.CompletionRequest.model_validate({"model": MODEL, "prompt": "x"})
    for bans in (((5,),) * (MAX_BAD_WORDS + 1), ((5,) * (MAX_BAD_WORD_LEN + 1),)):
        with pytest.raises(protocol.APIError) as e:
            protocol.sampling_params(req, 16, None, 8, bans)
        assert e.value.status == 400 and e.value.param == "bad_words", e.value.message
        assert len(e.value.message) < 300, e.value.message
    words = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(150)]  # <= 256 words
    for bad in (words, ["x " * (MAX_BAD_WORD_LEN + 1)], ["a", " \n "], [""]):
        with pytest.raises(protocol.APIError) as e:
            _bad_words_ids(tok, bad)
        assert e.value.status == 400 and e.value.param == "bad_words", e.value.message


def _streamed(client, **kw) -> str:
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    return "".join(c.choices[0].text for c in chunks)


def test_bad_words_served_equal_generate(model, client):
    """A one-token word (" a", the greedy output's first token) and a two-token one ("replace('",
    inside it): the greedy output no longer holds them and is ji.generate's with the same
    bad_words_ids, for n = 2, streaming, and chat."""
    tok = model[2]
    ids = tok.encode(PROMPT).ids
    plain = _generate(model, ids, 16).token_ids
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    for word in ("a", "replace('"):
        bans = (tuple(_enc(tok, word)), tuple(_enc(tok, " " + word)))
        assert any(_holds(plain, w) for w in bans), word  # the ban bites
        out = _generate(model, ids, 16, bad_words_ids=bans).token_ids
        assert not any(_holds(out, w) for w in bans), word
        want = tok.decode(out)
        r = client.completions.create(**kw, n=2, extra_body={"bad_words": [word]})
        assert [c.text for c in r.choices] == [want, want], word
        assert r.usage.completion_tokens == 2 * len(out)
        assert _streamed(client, **kw, extra_body={"bad_words": [word]}) == want, word
    messages = [{"role": "user", "content": "sum"}]
    chat_ids = _enc(tok, ji.apply_chat_template(tok, messages, True, chat_template=CHAT_TEMPLATE))
    bans = (tuple(_enc(tok, "a")), tuple(_enc(tok, " a")))
    assert any(_holds(_generate(model, chat_ids, 8).token_ids, w) for w in bans)
    want = tok.decode(_generate(model, chat_ids, 8, bad_words_ids=bans).token_ids)
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"bad_words": ["a"]}
    )
    assert r.choices[0].message.content == want


# --------------------------------------------------------------------------- prompt_logprobs


def test_prompt_logprobs_equal_full_forward_and_echo(model, server):
    """Two prompts, n = 2: every choice carries its prompt's entries, equal to a full forward's
    log-softmax and to the echo's logprobs of the same request; an echo with logprobs alone
    returns them as prompt_logprobs too (vLLM)."""
    tok = model[2]
    ids = tok.encode(PROMPT).ids
    prompts = [ids, ids[:4]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 2, "temperature": 0, "n": 2,
            "echo": True, "logprobs": 2, "prompt_logprobs": 3}  # fmt: skip
    r = _post(server, "/v1/completions", body)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for c in r["choices"]:
        p = prompts[c["index"] // 2]
        check_prompt_logprobs(model, p, c["prompt_logprobs"], 3)
        echo = c["logprobs"]["token_logprobs"][: len(p)]
        assert echo[1:] == [c["prompt_logprobs"][i][str(p[i])]["logprob"] for i in range(1, len(p))]
    r = _post(server, "/v1/completions", {**body, "prompt": ids, "n": 1, "prompt_logprobs": None})
    check_prompt_logprobs(model, ids, r["choices"][0]["prompt_logprobs"], 2)
    r = _post(server, "/v1/completions", {**body, "prompt": ids, "n": 1, "echo": False})
    check_prompt_logprobs(model, ids, r["choices"][0]["prompt_logprobs"], 3)
    r = _post(server, "/v1/completions", {**body, "prompt": ids, "n": 1, "echo": False,
                                          "logprobs": None, "prompt_logprobs": None})  # fmt: skip
    assert "prompt_logprobs" not in r["choices"][0]


def test_prompt_logprobs_chat_and_stream(model, server):
    """Chat: one list for the response (vLLM's place), of the rendered prompt; k = 0 holds the
    prompt token alone. A stream takes only k = 0 and carries none (vLLM)."""
    tok = model[2]
    messages = [{"role": "user", "content": "sum the list"}]
    ids = _enc(tok, ji.apply_chat_template(tok, messages, True, chat_template=CHAT_TEMPLATE))
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    r = _post(server, "/v1/chat/completions", body)
    check_prompt_logprobs(model, ids, r["prompt_logprobs"], 0)
    assert all(len(e) == 1 for e in r["prompt_logprobs"][1:])
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as s:  # fmt: skip
        assert s.status_code == 200
        lines = [x for x in s.iter_lines() if x]
    assert lines[-1] == "data: [DONE]" and not any("prompt_logprobs" in x for x in lines)


# ------------------------------------------------------- continue_final_message, add_special_tokens


def test_continue_final_message_leaves_the_final_message_open(model, server, client):
    """The prompt ends inside the assistant's message (the template's text cut after its
    content): the engine gets that text's ids, and /tokenize gives the same ones."""
    tok = model[2]
    messages = [{"role": "user", "content": "sum"}, {"role": "assistant", "content": "def f(x):"}]
    ids = _enc(tok, "<|user|>sum\n<|assistant|>def f(x):")
    closed = _enc(tok, "<|user|>sum\n<|assistant|>def f(x):\n")  # the turn ended, as without it
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": False,
            "continue_final_message": True}  # fmt: skip
    assert _post(server, "/tokenize", body)["tokens"] == ids
    assert _post(server, "/tokenize", {**body, "continue_final_message": False})["tokens"] == closed
    r = _post(server, "/v1/chat/completions", {**body, "max_tokens": 6, "temperature": 0})
    ref = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["choices"][0]["message"]["content"] == ref.choices[0].text
    # vLLM's role without a generation prompt: the final message's, streamed or not.
    assert r["choices"][0]["message"]["role"] == "assistant"
    user = {**body, "messages": messages[:1], "continue_final_message": False, "max_tokens": 2}
    assert _post(server, "/v1/chat/completions", user)["choices"][0]["message"]["role"] == "user"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages[:1], max_tokens=2, stream=True,
        extra_body={"add_generation_prompt": False},
    )  # fmt: skip
    assert next(iter(stream)).choices[0].delta.role == "user"
    opened = _post(server, "/v1/chat/completions", {**user, "add_generation_prompt": True})
    assert opened["choices"][0]["message"]["role"] == "assistant"


@pytest.fixture
def bos_post_processor(model):
    """The served tokenizer's post-processor adds <|bos|> (as Llama's) for the test."""
    backend = model[2].backend
    old = backend.post_processor
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", BOS)]
    )
    yield
    backend.post_processor = old


def test_add_special_tokens(model, client, bos_post_processor):
    """A completion's text gets the post-processor's BOS unless add_special_tokens = false; a
    chat's rendered text only with add_special_tokens = true (vLLM's defaults): the engine's
    prompt is those ids (its length, and the greedy text of those ids)."""
    tok = model[2]
    plain = _enc(tok, "a b")
    messages = [{"role": "user", "content": "a b"}]
    chat = _enc(tok, ji.apply_chat_template(tok, messages, True, chat_template=CHAT_TEMPLATE))
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    texts = {}
    for extra, want in (({}, [BOS, *plain]), ({"add_special_tokens": False}, plain)):
        r = client.completions.create(prompt="a b", **kw, extra_body=extra)
        ref = client.completions.create(prompt=want, **kw)
        assert r.usage.prompt_tokens == len(want) and r.choices[0].text == ref.choices[0].text
        texts[len(want)] = r.choices[0].text
    for extra, want in (({}, chat), ({"add_special_tokens": True}, [BOS, *chat])):
        r = client.chat.completions.create(messages=messages, **kw, extra_body=extra)
        ref = client.completions.create(prompt=want, **kw)
        assert r.usage.prompt_tokens == len(want), extra
        assert r.choices[0].message.content == ref.choices[0].text, extra
        texts[("chat", len(want))] = r.choices[0].message.content
    assert len(set(texts.values())) == 4  # the BOS changes each greedy text: the check can fail


def test_special_tokens_in_logprobs_are_named_by_their_text(model, server):
    """A special token in logprobs is shown as its literal text, also where the response text
    drops it: prompt_logprobs' decoded_token for a <|bos|> inside the prompt, and the chat
    entry (token and its UTF-8 bytes) of an eos that ends the sample (vLLM shows both)."""
    cfg, _, tok = model
    bos, eos = tok.id_to_token(BOS), tok.id_to_token(cfg.eos_token_id)
    assert bos.startswith("<|") and eos.startswith("<|") and bos != eos
    ids = _enc(tok, PROMPT)
    prompt = ids[:2] + [BOS] + ids[2:4]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1}
    r = _post(server, "/v1/completions", body)
    entry = r["choices"][0]["prompt_logprobs"][2]
    assert entry[str(BOS)]["decoded_token"] == bos
    for j, e in entry.items():  # the most likely token there, whatever it is, by its text too
        assert e["decoded_token"] == tok.decode([int(j)], skip_special_tokens=False)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "logprobs": True, "top_logprobs": 1,
            "logit_bias": {str(cfg.eos_token_id): 100}}  # fmt: skip
    r = _post(server, "/v1/chat/completions", body)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    (item,) = choice["logprobs"]["content"]
    assert item["token"] == eos and item["bytes"] == list(eos.encode("utf-8"))
