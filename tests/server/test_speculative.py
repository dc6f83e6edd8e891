"""A server with speculative decoding: greedy text as `ji.generate`, /metrics as the engine's
acceptance counters, the cycle log and the request log, logprobs refused, bad_words and
prompt_logprobs served."""

from __future__ import annotations

import dataclasses
import json
import re

import httpx
import openai
import pytest

import jaxinfer as ji
from jaxinfer.server import Server
from tests.server.conftest import CHAT_TEMPLATE, ECFG, MODEL, check_prompt_logprobs, served

# Repetitive prompts, so the n-gram drafter finds matches and some drafts are accepted.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
]
# A fixed γ: "auto" picks γ from measured step times, so whether any draft is proposed (and
# accepted) would depend on the machine's load; the counters' equality holds for any γ.
SPEC = ji.SpeculativeConfig(drafter="ngram", num_speculative_tokens=3, max_gamma=3)


@pytest.fixture(scope="module")
def spec_server(model, tmp_path_factory):
    cfg, params, tok = model
    d = tmp_path_factory.mktemp("spec")
    ecfg = dataclasses.replace(ECFG, speculative=SPEC, cycle_log=str(d / "cycles.jsonl"))
    engine = ji.Engine(cfg, params, ecfg, detokenize=lambda ids: tok.decode(ids))
    srv = Server(
        engine, tok, port=0, model_name=MODEL, chat_template=CHAT_TEMPLATE,
        request_log=str(d / "requests.jsonl"), shutdown_timeout=5.0,
    ).start()  # fmt: skip
    srv.dir = d
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec_client(spec_server):
    # A long timeout: a hang guard (the first requests compile the speculative step).
    return openai.OpenAI(
        base_url=spec_server.url + "/v1", api_key="none", max_retries=0, timeout=1800
    )


def _series(server, name: str) -> dict[str, float]:
    """Every sample of `name` in /metrics, keyed by its labels other than model_name."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for labels, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        key = ",".join(x for x in labels.split(",") if not x.startswith("model_name="))
        out[key] = float(value)
    assert out, f"{name} not in /metrics"
    return out


def _generate_all(model, spec_client):
    cfg, params, tok = model
    for k, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt).ids
        sp = ji.SamplingParams(temperature=0, max_tokens=20)
        ref = ji.generate(cfg, params, [ids], sp)[0]
        want = tok.decode(ref.token_ids, skip_special_tokens=True)
        kw = dict(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        if k % 2:  # streaming and not
            chunks = list(spec_client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks)
        else:
            r = spec_client.completions.create(**kw)
            text = r.choices[0].text
            assert r.usage.completion_tokens == len(ref.token_ids)
        assert text == want, (prompt, text, want)


def test_greedy_text_equals_generate_and_metrics_equal_engine_counters(model, spec_server,
                                                                       spec_client):  # fmt: skip
    # The counters below are the server's totals; only the request log is read from here on (a
    # test of this module that ran earlier on the same server has its own lines before).
    logged = (spec_server.dir / "requests.jsonl").read_text().splitlines()
    _generate_all(model, spec_client)

    def counters(eng):
        c = eng.spec_counters
        return (c.cycles, c.proposed, c.accepted, c.accepted_at.copy(), c.reached.copy(),
                eng.num_steps)  # fmt: skip

    cycles, proposed, accepted, accepted_at, reached, steps = spec_server.engine.call(
        counters
    ).result()
    assert cycles > 0 and accepted > 0  # the repetitive prompts drafted and were accepted
    total = lambda name: _series(spec_server, name)[""]  # noqa: E731
    assert total("jaxinfer:spec_decode_num_drafts_total") == cycles
    assert total("jaxinfer:spec_decode_num_draft_tokens_total") == proposed
    assert total("jaxinfer:spec_decode_num_accepted_tokens_total") == accepted
    acc = _series(spec_server, "jaxinfer:spec_decode_num_accepted_tokens_per_pos_total")
    got = _series(spec_server, "jaxinfer:spec_decode_num_reached_per_pos_total")
    for j in range(SPEC.max_gamma):
        assert acc[f'position="{j}"'] == accepted_at[j]
        assert got[f'position="{j}"'] == reached[j]
    assert sum(acc.values()) == accepted and got['position="0"'] == cycles
    by_gamma = _series(spec_server, "jaxinfer:spec_decode_steps_total")
    assert set(by_gamma) == {f'gamma="{g}"' for g in range(SPEC.max_gamma + 1)}
    assert sum(by_gamma.values()) == steps
    assert total("jaxinfer:engine_step_seconds_count") == steps  # every step timed
    assert by_gamma['gamma="0"'] < steps  # γ = 3 drafted on some steps

    # The engine's cycle log: one line per row per speculative step, summing to the counters.
    lines = [json.loads(x) for x in (spec_server.dir / "cycles.jsonl").read_text().splitlines()]
    assert sum(r["gamma"] for r in lines) == proposed
    assert sum(r["accepted"] for r in lines) == accepted
    assert all(isinstance(r["text"], str) for r in lines)
    # The request log: one line per finished request, in order of time.
    reqs = (spec_server.dir / "requests.jsonl").read_text().splitlines()
    assert reqs[: len(logged)] == logged
    reqs = [json.loads(x) for x in reqs[len(logged) :]]
    assert len(reqs) == len(PROMPTS)
    for r in reqs:
        assert r["arrival"] <= r["first_token"] <= r["last_token"] <= r["finish"]
        assert r["completion_tokens"] == 20 or r["finish_reason"] == "stop"


def test_logprobs_refused_with_speculation(spec_server, spec_client):
    for kw in ({"logprobs": 2}, {"echo": True, "logprobs": 0}):
        with pytest.raises(openai.BadRequestError) as e:
            spec_client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kw)
        assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        spec_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, logprobs=True
        )
    assert e.value.body["param"] == "logprobs"
    served(spec_client)


def test_penalties_with_speculation_equal_generate(model, spec_server, spec_client):
    """Each verified position is penalized by the history that includes the drafts before it:
    greedy text as ji.generate's with the same penalties (and not the unpenalized text)."""
    cfg, params, tok = model
    prompt = "ab ab ab ab ab ab ab ab"  # repetitive: the n-gram drafter drafts and lands
    ids = tok.encode(prompt).ids
    plain = ji.generate(cfg, params, [ids], ji.SamplingParams(temperature=0, max_tokens=20))
    before = spec_server.engine.call(lambda eng: eng.spec_counters.accepted).result()
    for kw in ({"presence_penalty": 0.4}, {"extra_body": {"repetition_penalty": 1.1}}):
        r = spec_client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                           temperature=0, **kw)  # fmt: skip
        sp = ji.SamplingParams(temperature=0, max_tokens=20, **kw.get("extra_body", kw))
        want = ji.generate(cfg, params, [ids], sp)[0].token_ids
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=True), kw
        assert want != plain[0].token_ids, kw  # the setting changes this output
    assert spec_server.engine.call(lambda eng: eng.spec_counters.accepted).result() > before


def test_no_speculative_metrics_without_speculation(server):
    text = httpx.get(server.url + "/metrics").text
    assert "jaxinfer:spec_decode" not in text
    assert "jaxinfer:kv_cache_used_blocks{" in text


def test_bad_words_and_prompt_logprobs_with_speculation(model, spec_server, spec_client):
    """vLLM's bad_words reach the speculative engine (greedy text as ji.generate's with those
    bad_words_ids, drafts verified under the bans), and prompt_logprobs, a scoring pass rather
    than the engine's logprobs, are served there too."""
    cfg, params, tok = model
    prompt = "ab ab ab ab ab ab ab ab"
    ids = tok.encode(prompt).ids
    bans = tuple(tuple(tok.encode(w, add_special_tokens=False).ids) for w in ("ab", " ab"))
    sp = ji.SamplingParams(temperature=0, max_tokens=20)
    plain = ji.generate(cfg, params, [ids], sp)[0].token_ids
    want = ji.generate(cfg, params, [ids], dataclasses.replace(sp, bad_words_ids=bans))[0]
    assert bans[1][0] in plain and not set(want.token_ids) & {bans[0][0], bans[1][0]}
    before = spec_server.engine.call(lambda eng: eng.spec_counters.accepted).result()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0,
            "bad_words": ["ab"], "prompt_logprobs": 2}  # fmt: skip
    r = httpx.post(spec_server.url + "/v1/completions", json=body, timeout=1800)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == tok.decode(want.token_ids, skip_special_tokens=True)
    assert spec_server.engine.call(lambda eng: eng.spec_counters.accepted).result() > before
    check_prompt_logprobs(model, ids, choice["prompt_logprobs"], 2)
