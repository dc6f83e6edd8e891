"""experiments/serve.py as a subprocess: flags checked at parse time, SIGTERM is graceful."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spawn(*flags):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "experiments", "serve.py"), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize(
    "flags",
    [
        ["--model=no-such-model"], ["--port=70000"], ["--max_waiting=0"],
        ["--speculative=ngram", "--num_speculative_tokens=x"],
        ["--speculative=ngram", "--num_speculative_tokens=5", "--max_gamma=4"],
        ["--cycle_log=cycles.jsonl"],  # without --speculative
        ["--speculative=model"],  # without --draft_model
        ["--speculative=head"],  # without --draft_head
        ["--speculative=head", "--draft_head=no-such-head"],
        ["--speculative=ngram", "--ngram_first=2"],  # the hybrid needs a head
        ["--ngram_first=4"],
        ["--token_buckets=1,3"], ["--token_buckets=fixed"],
        ["--compilation_cache=README.md"],  # a file, not a folder
        ["--compilation_cache_mb=-1"],
    ],
)  # fmt: skip
def test_bad_flags_fail_at_parse_time(flags):
    proc = _spawn(*flags)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "Flags parsing error" in out and flags[-1].split("=")[0].lstrip("-") in out


def _wait_serving(proc) -> str:
    lines = []
    for line in proc.stdout:
        if line.startswith("serving "):
            return line.split(" at ")[1].strip()
        lines.append(line)
    raise AssertionError("the server did not start:\n" + "".join(lines[-20:]))


def test_speculative_flags_metrics_and_logs(tmp_path):
    cycles, requests = tmp_path / "cycles.jsonl", tmp_path / "requests.jsonl"
    proc = _spawn(
        "--model=target", "--port=0", "--num_blocks=65", "--max_num_seqs=2",
        "--max_num_batched_tokens=32", "--nowarmup", "--speculative=ngram",
        "--num_speculative_tokens=2", f"--cycle_log={cycles}", f"--request_log={requests}",
        "--token_buckets=1,4",
    )  # fmt: skip
    try:
        url = _wait_serving(proc)
        assert httpx.get(url + "/health").json()["token_buckets"] == [1, 4]  # as given
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(
            model="target", prompt="a b c a b c a b c a b", max_tokens=8, temperature=0
        )
        text = httpx.get(url + "/metrics").text
        found = {
            k: re.search(rf"^jaxinfer:spec_decode_num_{k}_total{{.*}} (\S+)$", text, re.M)
            for k in ("drafts", "draft_tokens")
        }
        assert all(found.values()), text
        drafts, tokens = (float(m[1]) for m in found.values())
        assert drafts > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [json.loads(x) for x in cycles.read_text().splitlines()]
    # A line per row and step; rows that drafted (γ = 2, as the flag says) are the drafts.
    assert sum(x["gamma"] > 0 for x in lines) == drafts and sum(x["gamma"] for x in lines) == tokens
    assert {x["gamma"] for x in lines} <= {0, 2}
    (rec,) = [json.loads(x) for x in requests.read_text().splitlines()]
    assert rec["completion_tokens"] == r.usage.completion_tokens
    assert rec["arrival"] <= rec["first_token"] <= rec["finish"]


def test_sigterm_finishes_in_flight_and_exits_0(tmp_path):
    proc = _spawn(
        "--model=target", "--port=0", "--num_blocks=129", "--max_num_seqs=4",
        "--max_num_batched_tokens=64", "--shutdown_timeout=300",  # a guard: a loaded CPU is slow
        f"--compilation_cache={tmp_path / 'xla'}",
    )  # fmt: skip
    try:
        url = _wait_serving(proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="target", prompt="def f(x):", max_tokens=300, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)  # mid-stream
        rest = []
        t = threading.Thread(target=lambda: rest.extend(stream))
        t.start()
        t.join(300)
        chunks += rest
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=60) == 0
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
        assert len(os.listdir(tmp_path / "xla")) >= 2  # the warm-up's step programs were kept
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
