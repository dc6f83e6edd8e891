"""One server over the shipped target model for the whole directory, on a free port, and the
checks the test modules share.

Every test talks to it over HTTP with the official `openai` client (or httpx for raw bodies).
The engine's batch shape is fixed (B = 8 rows, M = 16 blocks) so the jitted step compiles once
per token bucket for the whole directory.
"""

from __future__ import annotations

import re

import httpx
import jax
import numpy as np
import openai
import pytest

import jaxinfer as ji
from jaxinfer.server import Server

MODEL = "target"
# The shipped tiny model has no chat template; a minimal one in the usual shape, with Llama 3.1's
# optional `date_string` (a chat_template_kwargs variable; a non-string one fails to render).
CHAT_TEMPLATE = (
    "{% if date_string is defined %}{{ 'Today: ' + date_string + '\\n' }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ECFG = ji.EngineConfig(
    block_size=16,
    num_blocks=65,  # 64 usable blocks = 1024 slots
    max_num_seqs=8,
    max_num_batched_tokens=128,
    min_token_bucket=16,
    min_block_bucket=16,  # M fixed: 256 positions
    min_seq_bucket=8,  # B fixed at max_num_seqs
)


@pytest.fixture(scope="session")
def model():
    path = ji.models.path(MODEL)
    cfg, params = ji.load_checkpoint(path)
    return cfg, params, ji.load_tokenizer(path)


@pytest.fixture(scope="session")
def server(model, tmp_path_factory):
    cfg, params, tok = model
    log = tmp_path_factory.mktemp("server") / "requests.jsonl"
    srv = Server(
        ji.Engine(cfg, params, ECFG),
        tok,
        port=0,
        model_name=MODEL,
        chat_template=CHAT_TEMPLATE,
        max_waiting=64,
        request_log=str(log),
        shutdown_timeout=5.0,
    ).start()
    srv.request_log = log
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="session")
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def metric(server, name: str) -> float:
    """One sample of /metrics (the only series of `name`)."""
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def served(client) -> None:
    """The server still answers a plain request."""
    r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1


def _log_softmax(model, ids) -> np.ndarray:
    cfg, params, _ = model
    logits = ji.score(cfg, params, np.asarray([ids], np.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits, -1))  # [S, V]


def check_prompt_logprobs(model, ids, entries, k, atol=2e-4):
    """vLLM's shape: None, then per prompt token {id: {logprob, rank, decoded_token}} holding the
    token first and the k most likely (ranks 1..k), against a full forward's log-softmax."""
    tok = model[2]
    assert len(entries) == len(ids) and entries[0] is None
    want = _log_softmax(model, ids)  # [P, V]
    for i in range(1, len(ids)):
        row, t, entry = want[i - 1], ids[i], entries[i]
        assert next(iter(entry)) == str(t), (i, entry)  # the prompt token itself first
        assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in entry.values())
        lp = entry[str(t)]["logprob"]
        np.testing.assert_allclose(lp, row[t], atol=atol)
        # vLLM's rank: the number of tokens at least as likely (1 = the argmax).
        lo, hi = np.sum(row > row[t] + atol) + 1, np.sum(row >= row[t] - atol)
        assert lo <= entry[str(t)]["rank"] <= hi, (i, entry[str(t)], lo, hi)
        top = sorted((e["rank"], int(j), e["logprob"]) for j, e in entry.items() if e["rank"] <= k)
        assert [r for r, _, _ in top] == list(range(1, k + 1)), (i, entry)
        assert len(entry) == k + (t not in [j for _, j, _ in top]), (i, entry)
        np.testing.assert_allclose([v for *_, v in top], np.sort(row)[::-1][:k], atol=atol)
        for _, j, v in top:
            np.testing.assert_allclose(v, row[j], atol=atol)
        for j, e in entry.items():
            assert e["decoded_token"] == tok.decode([int(j)], skip_special_tokens=False)
