"""experiments/serve.py as a subprocess: flags checked at parse time, SIGTERM is graceful."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import openai
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spawn(*flags):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "experiments", "serve.py"), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize("flag", ["--model=no-such-model", "--port=70000", "--max_waiting=0"])
def test_bad_flags_fail_at_parse_time(flag):
    proc = _spawn(flag)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert flag.split("=")[0].lstrip("-") in out


def test_sigterm_finishes_in_flight_and_exits_0():
    proc = _spawn(
        "--model=target", "--port=0", "--num_blocks=129", "--max_num_seqs=4",
        "--max_num_batched_tokens=64", "--shutdown_timeout=20",
    )  # fmt: skip
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("serving "):
                url = line.split(" at ")[1].strip()
                break
        assert url, "the server did not start"
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
        t.join(60)
        chunks += rest
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=60) == 0
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
