"""Disaggregated serving across two processes (prefill, decode) joined by a `SocketConnector`.

One launch covers the acceptance: every request's tokens equal one colocated engine's, greedy
and seeded, with prefix-cache hits and preemptions on both sides (the prefill side's forced
mid-prefill, since a prefill reserves its whole prompt at admission); the bytes moved are
2·L·K·D·itemsize per transferred token; one request aborted while its load is in flight frees
its blocks on the decode side, and the prefill side drops its copy (nothing pending, no block
used anywhere at exit); both processes are reaped.
"""

from __future__ import annotations

import json
import sys

import pytest

from jaxinfer.distributed import worker
from jaxinfer.distributed.launch import launch
from tests.distributed._child import SMALL_ENGINE, child_env, mixed_requests
from tests.distributed.test_multiprocess import _gone

ABORT = 2  # the request aborted during its transfer


def _spec() -> dict:
    requests, shared = mixed_requests(seed=1, sample_seed=20)
    requests.append(dict(prompt=shared[:8], sampling=dict(max_tokens=6, ignore_eos=True)))
    engine = dict(SMALL_ENGINE, long_prefill_threshold=8)
    decode = {**engine, "num_blocks": 9}  # a smaller decode pool: it must preempt
    return dict(model="target", engine=engine, decode_engine=decode, requests=requests)


@pytest.fixture(scope="module")
def colocated():
    return worker.serve(_spec(), mesh=None, check_schedules=False)


def test_two_process_disaggregation(colocated, tmp_path):
    spec = _spec()
    path = tmp_path / "requests.json"
    path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "jaxinfer.distributed.disagg_worker", "--requests", str(path),
           "--out", str(tmp_path), "--abort", str(ABORT), "--preempt_prefill", "2"]  # fmt: skip
    assert launch(cmd, 2, tmp_path, timeout=300, env=child_env(devices=1)) == [0, 0]
    pre = json.loads((tmp_path / "process_0.json").read_text())
    dec = json.loads((tmp_path / "process_1.json").read_text())
    for i, (g, w) in enumerate(zip(dec["tokens"], colocated["tokens"])):
        assert g == ([] if i == ABORT else w), f"request {i}"
    assert dec["finish_reasons"][ABORT] == "abort"
    # prefix caching and preemption on both sides
    assert pre["forced_preemptions"] == 2 and pre["prefix_cache_hits"] > 0
    assert dec["preemptions"] > 0 and dec["prefix_cache_hits"] > 0 and dec["blocks_skipped"] > 0
    # transfer bytes = 2 · L · K · D · itemsize · tokens, the tokens those of the full prompt
    # blocks each completed load did not find in the decode prefix cache
    cfg, _ = worker.load_model("target")
    S = spec["engine"]["block_size"]
    skipped = {int(k): v for k, v in dec["skipped"].items()}
    loaded = [i for i in range(len(spec["requests"])) if i != ABORT]
    tokens = sum(len(spec["requests"][i]["prompt"]) // S - skipped[i] for i in loaded) * S
    assert dec["num_loads"] == len(loaded)  # the aborted load never completed
    assert dec["bytes_moved"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * tokens
    # the abort freed the decode side's blocks at once; nothing is held anywhere at exit
    before, after = dec["aborted_used_blocks"]
    assert after < before
    assert pre["used_blocks"] == dec["used_blocks"] == 0
    assert pre["pending"] == dec["pending"] == 0
    assert _gone(pre["pid"]) and _gone(dec["pid"])


_ARGS = ["--coordinator=localhost:1", "--requests=unused.json", "--out=unused"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num_processes=3", "--process_id=0"], r"--num_processes=3: expected 2"),
        (["--num_processes=2", "--process_id=2"], r"--process_id=2: expected 0 .* or 1"),
        (["--num_processes=2", "--process_id=1", "--pin_cores"], r"1 core\(s\) \(\[0\]\), fewer"),
    ],
)
def test_worker_refuses_bad_flags_before_any_work(monkeypatch, extra, message):
    from jaxinfer.distributed import disagg_worker

    pinned = []
    monkeypatch.setattr(disagg_worker.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(disagg_worker.os, "sched_setaffinity", lambda pid, c: pinned.append(c))
    with pytest.raises(SystemExit, match=message):
        disagg_worker.main(_ARGS + extra)
    assert pinned == []  # refused before pinning (or reading --requests)
