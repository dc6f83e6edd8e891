"""Concurrency, disconnects, a bounded soak and a failed step, over HTTP."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import openai
import pytest

import jaxinfer.engine.engine as engine_module
from tests.server.conftest import MODEL, metric, served

PROMPTS = [f"def f{i}(x):\n    return x +" for i in range(32)]


def test_concurrent_streams_then_disconnects(server, aclient, client):
    """32 streaming clients; 20 of them go away mid-stream. The other 12 complete with the text
    a lone request gets, and the blocks of the 20 are back within a second of the last one
    leaving (they asked for 400 tokens, so without the aborts they would hold blocks for
    seconds)."""
    want = {
        i: client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0)
        .choices[0]
        .text
        for i in range(0, 32, 8)
    }
    leave = set(range(32)) - set(range(0, 32, 8)) - {1, 2, 3, 5, 6, 7, 9, 11}  # 20 leave
    assert len(leave) == 20

    async def run():
        left_at = []

        async def one(i):
            stream = await aclient.completions.create(
                model=MODEL, prompt=PROMPTS[i], temperature=0, stream=True,
                max_tokens=400 if i in leave else 24, extra_body={"ignore_eos": i in leave},
            )  # fmt: skip
            text = ""
            async for chunk in stream:
                text += chunk.choices[0].text
                if i in leave and len(text) >= 3:
                    await stream.close()
                    left_at.append(time.monotonic())
                    return i, None
            return i, text

        return await asyncio.gather(*(one(i) for i in range(32))), left_at

    results, left_at = asyncio.run(run())
    texts = dict(results)
    for i, text in texts.items():
        if i not in leave:
            assert text is not None and len(text) > 0
            if i in want:
                assert text == want[i]
    # The streams of the 12 may finish after the last disconnect; check the aborts' blocks
    # within a second of it.
    deadline = max(left_at) + 1.0
    while metric(server, "jaxinfer:kv_cache_blocks_held_by_aborted") != 0:
        assert time.monotonic() < deadline, "aborted requests still hold blocks"
        time.sleep(0.02)
    live = server.engine.call(lambda e: set(e._live)).result(5)
    assert not any(str(r).startswith("cmpl-") for r in live)
    assert metric(server, "jaxinfer:kv_cache_used_blocks") == 0
    assert metric(server, "jaxinfer:num_requests_running") == 0
    served(client)


def test_soak_mixed_requests_above_capacity(server, client):
    """200 requests of mixed sizes, Poisson arrivals well above capacity, against a small
    waiting queue: only 200s and queue-full 503s, no leaked blocks, an empty queue after."""
    rng = np.random.RandomState(0)
    old, server.engine.max_waiting = server.engine.max_waiting, 24

    async def one(h, k, delay):
        await asyncio.sleep(delay)
        words = " ".join(f"x{j}" for j in rng.randint(0, 99, rng.randint(1, 60)))
        body = {
            "model": MODEL,
            "prompt": words,
            "max_tokens": int(rng.randint(1, 32)),
            "temperature": float(rng.choice([0.0, 0.8])),
            "n": int(rng.choice([1, 1, 2])),
            "stream": bool(k % 2),
            "stop": ["x5"] if k % 7 == 0 else None,
        }
        if body["stream"]:
            async with h.stream("POST", "/v1/completions", json=body) as r:
                lines = [x async for x in r.aiter_lines() if x]
                if r.status_code == 200:
                    assert lines[-1] == "data: [DONE]", lines[-3:]
                    assert not any('"error"' in x for x in lines)
                return r.status_code, r.headers.get("retry-after")
        r = await h.post("/v1/completions", json=body)
        return r.status_code, r.headers.get("retry-after")

    async def run():
        arrivals = np.cumsum(rng.exponential(1 / 400.0, 200))  # ~400 req/s
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as h:
            return await asyncio.gather(*(one(h, k, t) for k, t in enumerate(arrivals)))

    try:
        out = asyncio.run(run())
    finally:
        server.engine.max_waiting = old
    codes = [c for c, _ in out]
    assert set(codes) <= {200, 503}, codes
    assert all(ra == "1" for c, ra in out if c == 503)
    assert codes.count(200) >= 24
    assert metric(server, "jaxinfer:kv_cache_used_blocks") == 0
    assert metric(server, "jaxinfer:num_requests_waiting") == 0
    assert server.engine.num_waiting == 0
    served(client)


@pytest.mark.parametrize("stream", [False, True])
def test_failed_step_is_500_and_the_next_request_succeeds(server, client, monkeypatch, stream):
    real = engine_module._step
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "_step", failing)
    with pytest.raises(openai.APIError) as e:
        r = client.completions.create(
            model=MODEL, prompt="x", max_tokens=4, temperature=0, stream=stream
        )
        if stream:
            list(r)
    if not stream:
        assert isinstance(e.value, openai.InternalServerError)
    assert "injected device failure" in str(e.value)
    served(client)
    assert metric(server, "jaxinfer:kv_cache_used_blocks") == 0


def test_engine_error_output_is_500_for_that_request_only(server, client, monkeypatch):
    """The hardened engine's contract: a failed step returns its samples finished with
    finish_reason "error" and `error` set (and has freed them). Emulated on this engine."""
    import types

    engine = server.engine.engine
    real_step = engine.step
    marked = []

    def step():
        outs = real_step()
        for i, o in enumerate(outs):
            if str(o.request_id) in marked[:1] and not o.request_finished:
                engine.abort(o.request_id)
                outs[i] = types.SimpleNamespace(
                    **{**o.__dict__, "finished": True, "finish_reason": "error",
                       "request_finished": True, "error": "step failed: injected"}
                )  # fmt: skip
        return outs

    monkeypatch.setattr(engine, "step", step)
    real_submit = server.engine.submit

    def submit(prompt, sampling, request_id, sink, loop=None):
        if not marked:
            marked.append(str(request_id))
        return real_submit(prompt, sampling, request_id, sink, loop)

    monkeypatch.setattr(server.engine, "submit", submit)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
    assert "injected" in str(e.value)
    served(client)
    assert metric(server, "jaxinfer:kv_cache_used_blocks") == 0
