"""Multi-process serving under `jax.distributed` on localhost against one process.

Two and four worker processes (one CPU device each, gloo collectives) serve the same requests,
greedy and seeded, with preemption and prefix-cache hits; every process must produce the
one-process tokens, request by request, and make the very same scheduling decisions (schedule
digests of every step). The launcher's reaping is tested with processes that hang, fail, or
leave a grandchild behind: none may survive `launch`.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import pytest

from jaxinfer.distributed import worker
from jaxinfer.distributed.launch import LaunchError, launch
from tests.distributed._child import ROOT, SMALL_ENGINE, child_env, mixed_requests

TIMEOUT = 300  # seconds per launch; 2 processes take ~20 s on the shared 2-core machine


def _spec() -> dict:
    requests, _ = mixed_requests(seed=0, sample_seed=10)
    return dict(model="target", engine=dict(SMALL_ENGINE), requests=requests)


@pytest.fixture(scope="module")
def reference():
    out = worker.serve(_spec(), mesh=None, check_schedules=False)
    assert out["preemptions"] > 0 and out["prefix_cache_hits"] > 0  # the workload covers both
    return out


def _gone(pid: int, wait: float = 10.0) -> bool:
    """Whether no live process has this pid (a zombie awaiting its reaper counts as gone)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("num_processes", [2, 4])
def test_processes_serve_like_one(num_processes, reference, tmp_path):
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps(_spec()))
    cmd = [sys.executable, "-m", "jaxinfer.distributed.worker", "--requests", str(requests),
           "--out", str(tmp_path), "--check_schedules"]  # fmt: skip
    env = child_env(devices=1)
    assert launch(cmd, num_processes, tmp_path, timeout=TIMEOUT, env=env) == [0] * num_processes
    for i in range(num_processes):
        got = json.loads((tmp_path / f"process_{i}.json").read_text())
        assert got["devices"] == num_processes
        assert got["mesh"] == {"kv": 2, "rep": num_processes // 2}  # degree 4: KV replicated
        for r, (g, w) in enumerate(zip(got["tokens"], reference["tokens"])):
            assert g == w, f"process {i}, request {r}"
        assert got["finish_reasons"] == reference["finish_reasons"]
        assert got["digests"] == reference["digests"]  # the same decisions, step by step
        assert _gone(got["pid"])


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", body]


HANG = """
import os, pathlib, subprocess, sys, time
out = pathlib.Path(sys.argv[1]); i = sys.argv[-1]
kid = subprocess.Popen(["sleep", "600"])  # a grandchild in the same process group
(out / f"tmp_{i}").write_text(f"{os.getpid()} {kid.pid}")
os.replace(out / f"tmp_{i}", out / f"pid_{i}")  # atomic: a pid file is never seen half-written
if i == "1" and sys.argv[2] == "fail":
    # fail only once every process has started (and written its pids): on a loaded machine the
    # launcher otherwise stops the slow starters before they write, and there is nothing to check
    n = int(sys.argv[sys.argv.index("--num_processes") + 1])
    deadline = time.monotonic() + 60
    while len(list(out.glob("pid_*"))) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
time.sleep(600)
"""


@pytest.mark.parametrize("mode", ["hang", "fail"])
def test_launch_always_reaps(mode, tmp_path):
    cmd = _script(HANG) + [str(tmp_path), mode]
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timed out" if mode == "hang" else "a process failed"):
        launch(cmd, 3, tmp_path, timeout=90 if mode == "fail" else 8, env=child_env(), grace=1)
    if mode == "fail":
        assert time.monotonic() - start < 90  # a failure stops the job before the deadline
    pids = [int(p) for f in sorted(tmp_path.glob("pid_*")) for p in f.read_text().split()]
    assert len(pids) == 6
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p, 0.1)]


def test_launch_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"num_processes=0"):
        launch(["true"], 0, tmp_path, timeout=1)
    with pytest.raises(ValueError, match="command is empty"):
        launch([], 2, tmp_path, timeout=1)
    assert os.path.isdir(ROOT)
